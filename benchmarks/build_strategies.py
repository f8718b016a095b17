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
import time

import jax
import jax.numpy as jnp

from eqx_lean import _build, _threefry
from eqx_lean.bench._models import PRESETS, Block


MiB = 2**20


def _compile(lowered) -> tuple[int, int, float]:
    start = time.perf_counter()
    analysis = lowered.compile().memory_analysis()
    seconds = time.perf_counter() - start
    return analysis.temp_size_in_bytes, analysis.alias_size_in_bytes, seconds


def _report(name: str, traced: jax.stages.Traced) -> None:
    rolled_temp, alias, rolled_seconds = _compile(traced.lower())
    unrolled_temp, _, unrolled_seconds = _compile(_threefry.lower(traced))
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

    plan = _build._Plan.make(make, keys, jnp.bfloat16, None, None)
    structs = plan.structs
    every_leaf = _build._Group(tuple(range(len(structs))), (None,) * len(structs))
    index = jax.ShapeDtypeStruct((), jnp.int32, weak_type=True)
    final = sum(s.size * s.dtype.itemsize for s in structs)
    print(f"{config}: final {final / MiB:.0f} MiB in bfloat16\n")
    print(
        "| strategy | XLA temp, JAX's Threefry | XLA temp, unrolled (used) | aliased "
        "| compile, JAX's | compile, unrolled |"
    )
    print("| --- | --- | --- | --- | --- | --- |")

    for group in plan.groups:
        traced = _build._write_layers_donated.trace(
            plan.buffer_structs(group), keys, index, index, make, plan.signature, group
        )
        _report(f"per-group write, leaves {group.leaves} (chosen)", traced)

    traced = _build._write_layers_donated.trace(
        structs, keys, index, index, make, plan.signature, every_leaf
    )
    _report("whole-layer write, called per layer", traced)

    def group_loops(buffers, keys):
        buffers = list(buffers)
        _build._fill_traced(buffers, keys, make, plan.signature, plan.groups)
        return tuple(buffers)

    _report(
        "one program: a fori_loop per group",
        jax.jit(group_loops, donate_argnums=0).trace(structs, keys),
    )

    def whole_layer_loop(buffers, keys):
        buffers = list(buffers)
        _build._fill_traced(buffers, keys, make, plan.signature, (every_leaf,))
        return tuple(buffers)

    _report(
        "one program: a fori_loop over whole layers",
        jax.jit(whole_layer_loop, donate_argnums=0).trace(structs, keys),
    )


if __name__ == "__main__":
    main()
