"""How `build_stacked` writes layers: per-group compiled writes versus one compiled loop.

For one configuration, compiles each candidate strategy twice, with JAX's own lowering of
Threefry (a rolled loop on CPU) and with the unrolled one `build_stacked` uses, and prints XLA's
`memory_analysis()` (temporary bytes on top of the donated, aliased stack) and the compile
times. The chosen strategy, one donated write per group of leaves, has the smallest
temporaries with JAX's lowering: XLA removes what a write does not return, so a group builds
only its own leaves. Unrolled, every draw fuses into its write and all strategies are lean.

    python benchmarks/build_strategies.py [--preset default|large|mistral7b]
"""

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from eqx_lean.internal import (
    PRESETS,
    Block,
    Tricks,
    WriteGroup,
    build_in_trace,
    lower,
    plan_build,
    trace_writes,
    tree_bytes,
)


MiB = 2**20


def _compile(lowered) -> tuple[int, int, float]:
    start = time.perf_counter()
    analysis = lowered.compile().memory_analysis()
    seconds = time.perf_counter() - start
    return analysis.temp_size_in_bytes, analysis.alias_size_in_bytes, seconds


CPU = Tricks.for_platform("cpu")


def _report(name: str, traced: jax.stages.Traced) -> None:
    jax_lowering = dataclasses.replace(CPU, fused_threefry=False)
    rolled_temp, alias, rolled_seconds = _compile(lower(traced, jax_lowering))
    unrolled_temp, _, unrolled_seconds = _compile(lower(traced, CPU))
    print(
        f"| {name} | {rolled_temp / MiB:.0f} MiB | {unrolled_temp / MiB:.2f} MiB "
        f"| {alias / MiB:.0f} MiB | {rolled_seconds:.2f} s | {unrolled_seconds:.2f} s |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    config = PRESETS[parser.parse_args().preset]
    keys = jax.random.split(jax.random.key(0), config.num_layers)

    def make(k):
        return Block(config, key=k)

    plan = plan_build(make, keys, jnp.bfloat16)
    structs = plan.structs
    every_leaf = plan._replace(groups=(WriteGroup(tuple(range(len(structs))), plan.shardings),))
    final = tree_bytes(structs)
    print(f"{config}: final {final / MiB:.0f} MiB in bfloat16\n")
    print(
        "| strategy | XLA temp, JAX's Threefry | XLA temp, unrolled (used) | aliased "
        "| compile, JAX's | compile, unrolled |"
    )
    print("| --- | --- | --- | --- | --- | --- |")

    for group, traced in zip(plan.groups, trace_writes(plan, CPU), strict=True):
        _report(f"per-group write, leaves {group.leaves} (chosen)", traced)
    (traced,) = trace_writes(every_leaf, CPU)
    _report("whole-layer write, called per layer", traced)
    _report(
        "one program: a fori_loop per group",
        jax.jit(lambda keys: tuple(build_in_trace(plan, keys))).trace(keys),
    )
    _report(
        "one program: a fori_loop over whole layers",
        jax.jit(lambda keys: tuple(build_in_trace(every_leaf, keys))).trace(keys),
    )


if __name__ == "__main__":
    main()
