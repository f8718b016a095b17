"""Where a load puts each leaf: `sharding=` resolved per layer or per tensor, and shardings that
`like` carries (on a concrete or an abstract mesh)."""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from .._core import (
    KeyPath,
    Layout,
    check_layer_axis,
    current_mesh,
    layer_struct,
    mesh_of,
    per_layer_sharding,
    resolve_shardings,
    stacked_shardings,
)
from .names import LAYER, TensorName


def _concrete_mesh(path: KeyPath, abstract: AbstractMesh, mesh: Any) -> Mesh:
    """The mesh to place a sharding of `like` that names an abstract mesh on.

    `eqx.filter_eval_shape` of a sharded build gives shardings on the `AbstractMesh` of the
    mesh it was built on, which names axes but no devices.
    """
    found = current_mesh(mesh)
    where = f"Leaf {jax.tree_util.keystr(path)} of `like` carries a sharding on {abstract}"
    if isinstance(found, Mesh):
        if (found.axis_names, found.axis_sizes) != (abstract.axis_names, abstract.axis_sizes):
            raise ValueError(
                f"{where}, which must match the mesh it is placed on (`mesh=` or the mesh set by "
                f"`jax.set_mesh`), but that mesh has axes {dict(found.shape)}."
            )
        return found
    if int(np.prod(abstract.axis_sizes)) != jax.device_count():
        raise ValueError(
            f"{where} ({int(np.prod(abstract.axis_sizes))} devices), as "
            "`eqx.filter_eval_shape` gives, but this process sees "
            f"{jax.device_count()} devices: pass `mesh=` (the mesh it was built on)."
        )
    return jax.make_mesh(abstract.axis_sizes, abstract.axis_names, axis_types=abstract.axis_types)


def _carried_sharding(path: KeyPath, struct: Any, mesh: Any) -> Any:
    sharding = getattr(struct, "sharding", None)
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
        return NamedSharding(_concrete_mesh(path, sharding.mesh, mesh), sharding.spec)
    return sharding


def resolve_load_shardings(
    sharding: Any,
    mesh: Any,
    layer_axis: Any,
    layout: Layout,
    tensor_names: Sequence[TensorName | None],
    num_layers: int | None,
) -> list[jax.sharding.Sharding | None]:
    """Each leaf's full sharding: `sharding` per layer (stacked leaves) or per tensor (plain).

    The one meaning of `sharding=` (see `eqx_lean._core.sharding`): for a leaf named with `{i}` it
    is one layer's sharding, the layer axis replicated unless `layer_axis` names mesh axes; for
    any other leaf, the whole tensor's. Without `sharding`, shardings that `like`'s
    `ShapeDtypeStruct`s carry are used, and must replicate the layer axis; those on an abstract
    mesh (from `eqx.filter_eval_shape`) are placed on `mesh`, the mesh set by `jax.set_mesh`,
    or else `jax.make_mesh` of the same axes over every device.
    """
    stacked = [name is not None and name.stacked for name in tensor_names]
    seen = tuple(
        layer_struct(s) if is_stacked else jax.ShapeDtypeStruct(s.shape, s.dtype)
        for s, is_stacked in zip(layout.structs, stacked, strict=True)
    )
    if sharding is None:
        carried = [
            _carried_sharding(p, s, mesh) for p, s in zip(layout.paths, layout.structs, strict=True)
        ]
        per_leaf = tuple(
            per_layer_sharding(path, s, "like") if is_stacked else s
            for path, s, is_stacked in zip(layout.paths, carried, stacked, strict=True)
        )
        if any(s is not None for s in per_leaf):
            sharding = jax.tree.unflatten(layout.treedef, list(per_leaf))
    shardings = resolve_shardings(
        sharding, mesh, layout.paths, seen, layout.treedef, per_layer=stacked
    )
    mesh = mesh_of(mesh, shardings)
    axes = check_layer_axis(layer_axis, mesh, num_layers) if num_layers else ()
    if layer_axis is not None and num_layers is None:
        raise ValueError(
            "`layer_axis` shards the layer axis of stacked leaves, but no leaf is named with "
            f"{LAYER}: there is no layer axis to shard."
        )
    stacked_only = [
        s if is_stacked else None for s, is_stacked in zip(shardings, stacked, strict=True)
    ]
    with_layer_axis = stacked_shardings(layout.paths, stacked_only, axes, mesh)
    return [
        with_axis if is_stacked else s
        for s, with_axis, is_stacked in zip(shardings, with_layer_axis, stacked, strict=True)
    ]
