"""How bitsandbytes 0.50.2 picks 8-bit codes on CPU: the rule double quantisation must match.

    python benchmarks/bnb_nested_codes.py

NF4's block scales are double-quantised by `bitsandbytes.functional.quantize_blockwise`
(blocks of 256, the signed dynamic map), which on CPU runs the native
`cquantize_blockwise_cpu_fp32`. Its source reads as: `x / absmax`, an exact floor search over
the map (with its first entry set to -1), then the nearer of the floor and the next code, ties
to the floor. That is nearest-code. This script compares the kernel's codes with three rules on
random scale-like data, and measures its decision boundary between each pair of neighbouring
codes by bisection:

- nearest code (`argmin`, ties to the lower index);
- bucketing on float32 midpoints (what bitsandbytes' Python kernel does);
- the measured boundaries, used as a threshold table.

Measured (2026-11-25, the 2-core box, this script): on 65,536 values at three scales the kernel
differs from nearest-code in 95-101 codes and from midpoint bucketing in the same 95-101; its
boundaries sit up to 1.5e-5 from the midpoints, in both directions (codes 177/178: 0.0634469
against 0.0634375). Half a bin of a 65,536-bin table over [-1, 1] is 1.5e-5: bitsandbytes'
source (`csrc/cpu_ops.cpp`, `quantize_cpu_impl`, since 0.50.0) reads each code from such a
table, `lut[(v + 1) * 0.5 * 65535 + 0.5]`, bin `i` holding the code nearest its centre
`-1 + 2i / 65535`. That rule ("bin table" below, `eqx_lean.quant._dynamic8`) differs in 0
codes; `tests/test_quant.py` checks it on values a few ulp either side of every bin edge.
"""

import numpy as np
import torch
from bitsandbytes import functional as bnb


def codes_by_rules(values: np.ndarray, code: np.ndarray) -> dict[str, np.ndarray]:
    """Each rule's codes for values already scaled into [-1, 1]."""
    ties_low = np.abs(values[:, None] - code[None, :]).argmin(axis=1)
    midpoints = ((code[:-1] + code[1:]) / np.float32(2)).astype(np.float32)
    bins = (
        (np.clip(values, -1, 1) + np.float32(1)) * np.float32(0.5) * np.float32(65535)
        + np.float32(0.5)
    ).astype(np.uint16)
    centres = np.float32(-1) + (np.float32(2) * np.arange(65536, dtype=np.float32)) / np.float32(
        65535
    )
    table = np.searchsorted(midpoints, centres.astype(np.float32), side="left")
    return {
        "nearest code": ties_low,
        "midpoint bucketing": np.searchsorted(midpoints, values, side="left"),
        "bin table": table[bins],
    }


def native(values: np.ndarray, blocksize: int) -> tuple[np.ndarray, np.ndarray]:
    codes, state = bnb.quantize_blockwise(torch.from_numpy(values), blocksize=blocksize)
    return codes.numpy(), state.absmax.numpy()


def boundaries(code: np.ndarray) -> np.ndarray:
    """The smallest float32 the kernel gives code k + 1 rather than k, for each k, by bisection
    (each probe is a block whose absmax is 1, so the kernel sees the value itself)."""
    lo = code[:-1].astype(np.float32).copy()
    hi = code[1:].astype(np.float32).copy()
    lo[0] = np.float32(-1.0)
    for _ in range(40):
        mid = ((lo.astype(np.float64) + hi.astype(np.float64)) / 2).astype(np.float32)
        probe = np.concatenate([[np.float32(1.0)], mid]).astype(np.float32)
        got = native(probe, 4096)[0][1:]
        lower = got <= np.arange(255)
        lo, hi = np.where(lower, mid, lo), np.where(lower, hi, mid)
    return hi


def main() -> None:
    code = bnb.create_dynamic_map(signed=True).numpy().astype(np.float32)
    bounds = boundaries(code)
    midpoints = ((code[:-1] + code[1:]) / np.float32(2)).astype(np.float32)
    offsets = bounds.astype(np.float64) - midpoints
    print(f"boundary - midpoint: min {offsets.min():.3g}, max {offsets.max():.3g}")
    for seed, scale in ((0, 0.01), (1, 1.0), (2, 0.3)):
        rng = np.random.default_rng(seed)
        values = (rng.standard_normal(65536) * scale).astype(np.float32)
        got, absmax = native(values, 256)
        # x * (1 / absmax), as the kernel scales
        inverse = (np.float32(1) / absmax).astype(np.float32)
        scaled = (values.reshape(-1, 256) * inverse[:, None]).reshape(-1).astype(np.float32)
        rules = codes_by_rules(scaled, code)
        rules["measured boundaries"] = np.searchsorted(bounds, scaled, side="right")
        row = ", ".join(f"{name} {int((c != got).sum())}" for name, c in rules.items())
        print(f"seed {seed}, scale {scale}: codes differing from the kernel: {row}")


if __name__ == "__main__":
    main()
