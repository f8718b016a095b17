"""Per-device memory of `build_stacked`'s writes on a mesh of forced CPU devices (issue #4's bar).

For each layer, device count and mesh axis type, compiles the per-layer writes of
`build_stacked(make_layer, keys, jnp.bfloat16, eqx_lean.fsdp(mesh))` and prints, per device, from
`memory_analysis()`: the stacked shard the write must update in place, the aliased and output
bytes (equal to it when nothing is copied), and the XLA temporaries against the bar of
3 x (one layer at construction precision / devices) + 1 MiB. The last column is the same write
lowered with JAX's own Threefry (a rolled loop on CPU), for comparison. Compiles only: nothing
is allocated.

    python benchmarks/sharded_writes.py
"""

import dataclasses
import os


os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

import eqx_lean
from eqx_lean.internal import (
    PRESETS,
    Block,
    BuildPlan,
    Tricks,
    compile_writes,
    lower_writes,
    memory_analysis,
    plan_build,
    shard_bytes,
    tree_bytes,
    wide_layer,
)


KiB = 2**10
MiB = 2**20


def make_block(key):
    return Block(PRESETS["default"], key=key)


def _bytes(n: float) -> str:
    return f"{n / MiB:.2f} MiB" if n >= MiB else f"{n / KiB:.1f} KiB"


def _temps_with_jax_lowering(plan: BuildPlan) -> list[int]:
    tricks = dataclasses.replace(Tricks.for_platform("cpu"), fused_threefry=False)
    lowered = lower_writes(plan, tricks=tricks)
    return [memory_analysis(x.compile()).temp_size_in_bytes for x in lowered]


def report(name: str, make_layer, devices: int, axis_type: AxisType) -> None:
    keys = jax.random.split(jax.random.key(0), 4)
    mesh = jax.make_mesh((devices,), ("data",), (axis_type,), devices=jax.devices()[:devices])
    plan = plan_build(make_layer, keys, jnp.bfloat16, eqx_lean.fsdp(mesh))
    layer_bytes = tree_bytes(plan.layout.structs)
    bound = 3 * layer_bytes / devices + MiB
    compiled = compile_writes(plan)
    jax_temps = _temps_with_jax_lowering(plan)
    for group, executable, jax_temp in zip(plan.groups, compiled, jax_temps, strict=True):
        analysis = memory_analysis(executable)
        shard = sum(shard_bytes(s) for s in plan.buffer_structs(group))
        met = analysis.alias_size_in_bytes == shard and analysis.temp_size_in_bytes <= bound
        print(
            f"| {name} | {devices} | {axis_type.name} | {len(group.leaves)} | {_bytes(shard)} "
            f"| {_bytes(analysis.alias_size_in_bytes)} | {_bytes(analysis.output_size_in_bytes)} "
            f"| {_bytes(analysis.temp_size_in_bytes)} | {_bytes(bound)} | {'yes' if met else 'NO'} "
            f"| {_bytes(jax_temp)} |"
        )


def main() -> None:
    print(
        "| layer | devices | axes | leaves | stacked shard | alias | output | XLA temp | bar "
        "| met | temp, JAX's Threefry |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, make_layer in (("wide", wide_layer), ("block", make_block)):
        for devices in (1, 2, 4, 8):
            for axis_type in (AxisType.Auto, AxisType.Explicit):
                report(name, make_layer, devices, axis_type)


if __name__ == "__main__":
    main()
