"""`python -m eqx_lean.bench`: builds the same stacked model with each method, side by side.

Every method runs in a fresh subprocess (the protocol of the project's design notes): idle is
the resident size after imports and inputs, peak is `VmHWM`, and the ratio is
(peak - idle) / final bytes.
"""

import argparse
import dataclasses
import json
import subprocess
import sys
from typing import Any

import jax.numpy as jnp

from ._measure import available_bytes
from ._models import PRESETS, BlockConfig
from ._predict import sizes
from ._worker import METHODS


GiB = 2**30
MiB = 2**20


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m eqx_lean.bench",
        description="Peak memory of building stacked layers: filter_vmap versus build_stacked.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--layers", type=int, help="number of stacked blocks")
    parser.add_argument("--dim", type=int, help="model width")
    parser.add_argument("--hidden", type=int, help="MLP hidden width")
    parser.add_argument("--heads", type=int, help="attention heads")
    parser.add_argument("--kv-heads", type=int, help="key/value heads")
    parser.add_argument("--dtype", default="bfloat16", help="target dtype (default bfloat16)")
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated subset of: {', '.join(METHODS)}",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    args.methods = methods
    return args


def _config(args: argparse.Namespace) -> BlockConfig:
    overrides = {
        "num_layers": args.layers,
        "dim": args.dim,
        "hidden": args.hidden,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
    }
    return dataclasses.replace(
        PRESETS[args.preset], **{k: v for k, v in overrides.items() if v is not None}
    )


def _run_worker(method: str, config: BlockConfig, dtype: str) -> dict[str, Any]:
    payload = json.dumps({**dataclasses.asdict(config), "dtype": dtype})
    proc = subprocess.run(
        [sys.executable, "-m", "eqx_lean.bench._worker", method, payload],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return {"method": method, "error": proc.stderr.strip().splitlines()[-1:] or "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _format_table(rows: list[dict[str, Any]]) -> str:
    header = f"{'method':<26}{'final':>11}{'peak-idle':>12}{'ratio':>8}{'time':>9}  note"
    lines = [header, "-" * len(header)]
    for row in rows:
        if "error" in row or "skipped" in row:
            note = row.get("skipped") or f"failed: {row['error']}"
            lines.append(f"{row['method']:<26}{'':>11}{'':>12}{'':>8}{'':>9}  {note}")
            continue
        lines.append(
            f"{row['method']:<26}{row['final_bytes'] / MiB:>8.0f} MiB"
            f"{row['peak_over_idle_bytes'] / MiB:>8.0f} MiB{row['ratio']:>7.2f}x"
            f"{row['seconds']:>8.1f}s  {row.get('note', '')}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    config = _config(args)
    dtype = jnp.dtype(args.dtype).name
    predicted = sizes(config, dtype)
    if not args.json:
        print(
            f"{config.num_layers} blocks, d={config.dim}, hidden={config.hidden}, "
            f"{config.heads} heads, {config.kv_heads} KV heads"
            + (f", vocab {config.vocab}" if config.vocab else "")
            + f"; {predicted.final / MiB:.0f} MiB in {dtype}, "
            f"{predicted.construction / MiB:.0f} MiB at construction precision",
            flush=True,
        )

    rows = []
    for method in args.methods:
        need = predicted.predicted_peak(method)
        free = available_bytes()
        if need > free:
            rows.append(
                {
                    "method": method,
                    "skipped": f"refused: predicted peak {need / GiB:.1f} GiB exceeds the "
                    f"{free / GiB:.1f} GiB available (the float32 layers alone need "
                    f"{predicted.float32_model / GiB:.1f} GiB)",
                    "predicted_peak_bytes": need,
                    "available_bytes": free,
                }
            )
        else:
            rows.append(_run_worker(method, config, dtype))
        if not args.json:
            print(_format_table(rows[-1:]).splitlines()[-1], flush=True)

    for row in rows:
        if row["method"] == "build_stacked" and "ratio" in row:
            overhead = row["peak_over_idle_bytes"] - row["final_bytes"]
            temp = predicted.largest_write_temp
            row["overhead_bytes"] = overhead
            row["largest_write_temp_bytes"] = temp
            row["note"] = (
                f"overhead {overhead / MiB:.0f} MiB; largest write's XLA temp {temp / MiB:.0f} MiB"
            )

    if args.json:
        print(json.dumps({"config": dataclasses.asdict(config), "dtype": dtype, "rows": rows}))
    else:
        print()
        print(_format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
