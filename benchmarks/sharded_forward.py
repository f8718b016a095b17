"""Per-device memory of a jitted forward through an `fsdp`-sharded stack (issue #14's bar).

A 16-layer stack of Mistral-shaped blocks (d=1024, hidden 3584, 8 heads, 2 KV heads) in
bfloat16 with float32 norms, sharded by `eqx_lean.fsdp(mesh)`, runs through
`eqx_lean.fold` with its default `gather=True`: each layer is gathered just before it runs
(ZeRO-3). The input, `[8, 32, 1024]` in float32, is sharded over the same mesh axis on its
batch dimension (data parallel + fsdp). For 1, 2, 4 and 8 forced CPU devices and both mesh
axis types, prints per device, from `memory_analysis()` of the compiled forward: argument,
output, temporary and aliased bytes, their total (argument + output + temp - alias) and the
bar, stack / devices + 3 layers + 4 MiB. Compiles only: nothing is allocated.

    python benchmarks/sharded_forward.py
"""

import os


os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqx_lean
from eqx_lean.internal import PRESETS, Block, BlockConfig, tree_bytes


MiB = 2**20
NUM_LAYERS = 16
BATCH, SEQ = 8, 32
CONFIG = PRESETS["default"]


def norms_in_float32(path: Any, leaf: jax.ShapeDtypeStruct) -> Any:
    return None if "norm" in jax.tree_util.keystr(path) else jnp.bfloat16


def stack_structs(config: BlockConfig, num_layers: int, mesh: Any) -> Any:
    """The stack `build_stacked(..., norms_in_float32, eqx_lean.fsdp(mesh))` would return, as
    `ShapeDtypeStruct`s carrying their shardings (nothing is allocated)."""
    layer = eqx.filter_eval_shape(Block, config, key=jax.random.key(0))
    rule = eqx_lean.fsdp(mesh)

    def stacked(path: Any, leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        dtype = norms_in_float32(path, leaf) or leaf.dtype
        spec = cast(NamedSharding, rule(path, leaf)).spec
        sharding = NamedSharding(mesh, P(None, *spec))
        return jax.ShapeDtypeStruct((num_layers, *leaf.shape), dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(stacked, layer)


def forward_memory(devices: int, axis_type: AxisType, config: BlockConfig = CONFIG) -> dict:
    """Per-device bytes of the compiled forward, and the bar they must stay under."""
    mesh = jax.make_mesh((devices,), ("data",), (axis_type,), devices=jax.devices()[:devices])
    stack = stack_structs(config, NUM_LAYERS, mesh)
    dynamic, static = eqx.partition(stack, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    x = jax.ShapeDtypeStruct(
        (BATCH, SEQ, config.dim), jnp.float32, sharding=NamedSharding(mesh, P("data"))
    )

    def forward(dynamic: Any, x: Any) -> Any:
        return eqx_lean.fold(eqx.combine(dynamic, static), x)

    analysis = jax.jit(forward).lower(dynamic, x).compile().memory_analysis()
    assert analysis is not None  # XLA:CPU always reports it
    stack_bytes = tree_bytes(dynamic)
    layer_bytes = stack_bytes // NUM_LAYERS
    total = (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
    )
    return {
        "devices": devices,
        "axes": axis_type.name,
        "stack": stack_bytes,
        "layer": layer_bytes,
        "argument": analysis.argument_size_in_bytes,
        "output": analysis.output_size_in_bytes,
        "temp": analysis.temp_size_in_bytes,
        "alias": analysis.alias_size_in_bytes,
        "total": total,
        "bar": stack_bytes / devices + 3 * layer_bytes + 4 * MiB,
    }


def main() -> None:
    print(
        "| devices | axes | stack / devices | argument | output | temp | alias "
        "| total | bar | met |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for devices in (1, 2, 4, 8):
        for axis_type in (AxisType.Explicit, AxisType.Auto):
            m = forward_memory(devices, axis_type)
            cells = [m["stack"] / devices] + [m[k] for k in ("argument", "output", "temp")]
            cells += [m["alias"], m["total"], m["bar"]]
            print(
                f"| {devices} | {m['axes']} | "
                + " | ".join(f"{c / MiB:.2f} MiB" for c in cells)
                + f" | {'yes' if m['total'] <= m['bar'] else 'NO'} |"
            )
    m = forward_memory(8, AxisType.Explicit)
    print(
        f"\nOne layer: {m['layer'] / MiB:.2f} MiB; the stack: {m['stack'] / MiB:.2f} MiB "
        f"({NUM_LAYERS} layers, bfloat16 with float32 norms); input "
        f"{BATCH * SEQ * CONFIG.dim * 4 / MiB:.2f} MiB (float32)."
    )


if __name__ == "__main__":
    main()
