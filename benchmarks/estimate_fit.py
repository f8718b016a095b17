"""Fits `eqx_lean.memory.estimate`'s allowance for `build_stacked` on CPU to fresh processes.

`estimate` predicts `build_stacked`'s peak as the final stack, plus XLA's temporaries of its
largest write, plus what compiling and glibc leave resident on CPU (`_CPU_BUILD_RETAINED` in
`eqx_lean/_memory/estimates.py`). That last part is measured here: for six configurations (none
of them the held-out ones of `tests/test_memory.py`), `build_stacked` runs in fresh processes
with the benchmark's worker, twice each, and the script prints each overhead over the final
stack beyond the largest write's temporaries, and their mean, the constant to use.

    python benchmarks/estimate_fit.py
"""

import dataclasses
import json
import statistics
import sys

import jax
import jax.numpy as jnp
from _worker_runs import run_json

from eqx_lean.internal import Block, BlockConfig, plan_build, write_temp_bytes


MiB = 2**20

FIT_CONFIGS = [
    (BlockConfig(num_layers=8, dim=1024, hidden=3584, heads=8, kv_heads=2), "bfloat16"),
    (BlockConfig(num_layers=16, dim=768, hidden=2048, heads=12, kv_heads=4), "bfloat16"),
    (BlockConfig(num_layers=3, dim=2048, hidden=5632, heads=16, kv_heads=4), "bfloat16"),
    (BlockConfig(num_layers=10, dim=1024, hidden=2816, heads=8, kv_heads=8), "float32"),
    (BlockConfig(num_layers=24, dim=512, hidden=1536, heads=8, kv_heads=2), "bfloat16"),
    (BlockConfig(num_layers=5, dim=1536, hidden=4096, heads=12, kv_heads=3), "float32"),
]
RUNS = 2


def _measure(config: BlockConfig, dtype: str) -> dict:
    payload = json.dumps({**dataclasses.asdict(config), "dtype": dtype})
    return run_json([sys.executable, "-m", "eqx_lean.bench._worker", "build_stacked", payload])


def main() -> None:
    overheads = []
    print("| configuration | final | largest write temp | overhead beyond it (runs) |")
    print("| --- | --- | --- | --- |")
    for config, dtype in FIT_CONFIGS:
        keys = jax.random.split(jax.random.key(0), config.num_layers)
        plan = plan_build(lambda k, c=config: Block(c, key=k), keys, jnp.dtype(dtype))
        temp = max(write_temp_bytes(plan), default=0)
        measured = [_measure(config, dtype) for _ in range(RUNS)]
        runs = [m["peak_over_idle_bytes"] - m["final_bytes"] - temp for m in measured]
        overheads += runs
        final = measured[-1]["final_bytes"]
        shown = " / ".join(f"{r / MiB:.0f}" for r in runs)
        print(
            f"| {config.num_layers} x d={config.dim}, {dtype} | {final / MiB:.0f} MiB "
            f"| {temp / MiB:.2f} MiB | {shown} MiB |"
        )
    print(
        f"\nmean {statistics.mean(overheads) / MiB:.1f} MiB, range "
        f"{min(overheads) / MiB:.0f}-{max(overheads) / MiB:.0f} MiB over {len(overheads)} runs"
    )


if __name__ == "__main__":
    main()
