"""`build_stacked`'s write groups for a small layer: grouped by the largest leaf alone (as before
`SMALL_GROUP_BYTES`) against up to 4 MiB (now), compiled for this CPU and, compile only, for an
H100 and a TPU v5e slice (the `plan` extra).

Prints, per target and grouping (each twice, alternated), the number of compiled writes, their
compile time (wall, and XLA's backend compile seconds summed over the writes, which compile
side by side in threads) and XLA's temporaries (`memory_analysis()`) of each. Nothing runs on
the targets.

    python benchmarks/write_groups.py [--targets cpu,h100,v5e-4] [--dim 32] [--hidden 128]
"""

import argparse
import time

import jax
import jax.numpy as jnp

import eqx_lean
from eqx_lean.internal import (
    Block,
    BlockConfig,
    WriteGroup,
    compile_writes,
    leaf_groups,
    memory_analysis,
    plan_build,
)


def _mesh(spec: str):
    if spec == "cpu":
        return None
    where = eqx_lean.memory.target(spec)
    return where.mesh((len(where.devices),), ("data",))


def measure(spec: str, config: BlockConfig, small_group_bytes: int | None) -> str:
    keys = jax.random.split(jax.random.key(0), config.num_layers)
    plan = plan_build(lambda k: Block(config, key=k), keys, jnp.bfloat16, None, _mesh(spec))
    if small_group_bytes is not None:
        groups = leaf_groups(plan.layout.structs, small_group_bytes)
        plan = plan._replace(
            groups=tuple(WriteGroup(g, tuple(plan.shardings[j] for j in g)) for g in groups)
        )
    # Compiled afresh each time: eqx_lean's cache of compiled writes and JAX's emptied.
    eqx_lean.clear_caches()
    jax.clear_caches()
    backend_seconds.clear()
    start = time.perf_counter()
    compiled = compile_writes(plan)
    seconds = time.perf_counter() - start
    temps = [memory_analysis(c).temp_size_in_bytes for c in compiled]
    grouping = "largest leaf" if small_group_bytes == 0 else "up to 4 MiB"
    return (
        f"| {spec} ({plan.platform}) | {grouping} | {len(plan.layout.structs)} | {len(compiled)} "
        f"| {seconds:.2f} s | {sum(backend_seconds):.2f} s "
        f"| {', '.join(f'{t / 2**10:.1f}' for t in temps)} KiB |"
    )


backend_seconds: list[float] = []


def _on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        backend_seconds.append(duration_secs)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--targets", default="cpu,h100,v5e-4")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    config = BlockConfig(num_layers=4, dim=args.dim, hidden=args.hidden, heads=4, kv_heads=2)
    print(f"Block dim {args.dim}, hidden {args.hidden}, bfloat16, 4 layers")
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    print(
        "| target | groups | leaves | compiled writes | compile (wall, side by side in threads) "
        "| backend compile seconds, summed | XLA temp per write |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for spec in args.targets.split(","):
        # Each grouping twice, alternated: the first compile for a target also starts its
        # compiler, which the first line pays.
        for small_group_bytes in (0, None, 0, None):
            print(measure(spec, config, small_group_bytes), flush=True)


if __name__ == "__main__":
    main()
