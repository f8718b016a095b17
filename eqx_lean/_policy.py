"""Per-leaf policies: the dtype and the sharding each array leaf of a layer is stored with."""

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, TypeGuard, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec, Sharding
from jaxtyping import PyTree


DtypeLike: TypeAlias = Any
KeyPath: TypeAlias = tuple[Any, ...]
DtypeRule: TypeAlias = Callable[[KeyPath, jax.ShapeDtypeStruct], DtypeLike | None]
DtypePolicy: TypeAlias = DtypeLike | DtypeRule | None


def is_floating(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _as_floating_dtype(value: Any, what: str) -> np.dtype:
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(
            f"{what} must be a floating dtype such as jnp.bfloat16; got {value!r}."
        ) from e
    if not is_floating(dtype):
        raise ValueError(
            f"{what} must be a floating dtype such as jnp.bfloat16 (integer, boolean, complex and "
            f"key-typed leaves are never cast); got {dtype}."
        )
    return dtype


def check_dtype_policy(dtype: DtypePolicy) -> DtypePolicy:
    """Validates a `dtype` argument eagerly, so a bad one fails before anything is built."""
    if dtype is None or _is_rule(dtype):
        return dtype
    return _as_floating_dtype(dtype, "`dtype`")


def _is_rule(dtype: DtypePolicy) -> TypeGuard[DtypeRule]:
    # Dtype-likes such as `jnp.bfloat16` are callable too, so "callable" alone is not the test.
    if not callable(dtype):
        return False
    try:
        jnp.dtype(cast(Any, dtype))
    except TypeError:
        return True
    return False


def leaf_dtype(dtype: DtypePolicy, path: KeyPath, leaf: jax.ShapeDtypeStruct) -> tuple[Any, bool]:
    """The dtype and weak type that `leaf` is stored with under the policy `dtype`.

    Only floating leaves are ever cast; a cast drops the weak type, exactly as `x.astype(dtype)`.
    """
    weak = bool(getattr(leaf, "weak_type", False))
    if dtype is None or not is_floating(leaf.dtype):
        return jnp.dtype(leaf.dtype), weak
    if _is_rule(dtype):
        chosen = dtype(path, leaf)
        if chosen is None:
            return leaf.dtype, weak
        where = f"the `dtype` rule's result for leaf {jax.tree_util.keystr(path)}"
        return _as_floating_dtype(chosen, where), False
    return jnp.dtype(cast(Any, dtype)), False


# --- sharding ---------------------------------------------------------------------------------

ShardingLike: TypeAlias = Sharding | PartitionSpec | None
ShardingRule: TypeAlias = Callable[[KeyPath, jax.ShapeDtypeStruct], ShardingLike]
ShardingPolicy: TypeAlias = ShardingLike | ShardingRule | PyTree[ShardingLike]


def _is_sharding_leaf(x: Any) -> bool:
    # A PartitionSpec is a tuple, and so a pytree node, unless it is named a leaf.
    return x is None or isinstance(x, Sharding | PartitionSpec)


def _per_leaf(
    sharding: ShardingPolicy,
    paths: Sequence[KeyPath],
    structs: Sequence[jax.ShapeDtypeStruct],
    treedef: Any,
) -> list[Any]:
    if _is_sharding_leaf(sharding):
        return [sharding] * len(structs)
    if callable(sharding) and not isinstance(sharding, eqx.Module):
        return [sharding(path, struct) for path, struct in zip(paths, structs, strict=True)]
    layer_of_structs = jax.tree.unflatten(treedef, structs)
    chosen: list[Any] = []

    def repeat_for_each_leaf(leaf_sharding: Any, subtree: Any) -> None:
        # A prefix leaf over a subtree without arrays (such as `bias=None`) stands for nothing.
        chosen.extend([leaf_sharding] * len(jax.tree.leaves(subtree)))

    try:
        jax.tree.map(repeat_for_each_leaf, sharding, layer_of_structs, is_leaf=_is_sharding_leaf)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "`sharding` must be one Sharding or PartitionSpec, a rule `(path, leaf) -> sharding`, "
            "or a pytree prefix of the layer's array leaves whose leaves are Shardings, "
            f"PartitionSpecs or None; it does not match the layer: {e}"
        ) from e
    return chosen


def _mesh_axis_size(mesh: Any, axes: Any) -> int:
    names = axes if isinstance(axes, tuple) else (axes,)
    return int(np.prod([mesh.shape[name] for name in names]))


def _check_spec(
    path: KeyPath, struct: jax.ShapeDtypeStruct, spec: PartitionSpec, mesh: Any
) -> None:
    where = f"leaf {jax.tree_util.keystr(path)} of shape {tuple(struct.shape)} with spec {spec}"
    if len(spec) > len(struct.shape):
        raise ValueError(f"`sharding`: {where} names more dimensions than the leaf has.")
    for size, axes in zip(struct.shape, spec, strict=False):
        if axes is None:
            continue
        for name in axes if isinstance(axes, tuple) else (axes,):
            if name not in mesh.shape:
                raise ValueError(
                    f"`sharding`: {where} names mesh axis {name!r}, which is not one of the "
                    f"mesh's axes {tuple(mesh.axis_names)}."
                )
        if size % _mesh_axis_size(mesh, axes) != 0:
            raise ValueError(
                f"`sharding`: {where}: dimension of size {size} is not divisible by the "
                f"{_mesh_axis_size(mesh, axes)} devices of mesh axes {axes!r}."
            )


def _one_layer_sharding(
    path: KeyPath, struct: jax.ShapeDtypeStruct, sharding: ShardingLike, mesh: Any
) -> Sharding | None:
    if sharding is None:
        return None
    if isinstance(sharding, PartitionSpec):
        if mesh is None:
            raise ValueError(
                f"`sharding` gives leaf {jax.tree_util.keystr(path)} a PartitionSpec, which needs "
                "a device mesh: pass `mesh=` (or give NamedShardings)."
            )
        # Checked first: NamedSharding's own error for an unknown axis names no leaf or shape.
        _check_spec(path, struct, sharding, mesh)
        sharding = NamedSharding(mesh, sharding)
    if isinstance(sharding, NamedSharding):
        _check_spec(path, struct, sharding.spec, sharding.mesh)
        return sharding
    if isinstance(sharding, Sharding) and sharding.is_fully_replicated:
        return sharding
    raise TypeError(
        f"`sharding` for leaf {jax.tree_util.keystr(path)} must be a NamedSharding, a "
        f"PartitionSpec, a fully replicated Sharding, or None; got {sharding!r}."
    )


def resolve_shardings(
    sharding: ShardingPolicy,
    mesh: Any,
    paths: Sequence[KeyPath],
    structs: Sequence[jax.ShapeDtypeStruct],
    treedef: Any,
) -> tuple[Sharding | None, ...]:
    """Each leaf's per-layer sharding (no layer axis) under the policy `sharding`.

    **Arguments:**

    - `sharding`: `None`; one `Sharding` or `PartitionSpec` for every leaf; a rule
        `(path, leaf) -> Sharding | PartitionSpec | None`; or a pytree prefix of the layer.
    - `mesh`: the `jax.sharding.Mesh` that `PartitionSpec`s refer to.
    - `paths`, `structs`, `treedef`: the layer's array leaves, as flattened.

    **Returns:**

    One sharding per leaf; `None` (default placement) only where no leaf is named-sharded.
    """
    if sharding is None:
        return (None,) * len(structs)
    chosen = _per_leaf(sharding, paths, structs, treedef)
    resolved = tuple(
        _one_layer_sharding(path, struct, leaf_sharding, mesh)
        for path, struct, leaf_sharding in zip(paths, structs, chosen, strict=True)
    )
    return _replicate_unplaced(resolved)


def _replicate_unplaced(shardings: tuple[Sharding | None, ...]) -> tuple[Sharding | None, ...]:
    """Leaves left to default placement beside named-sharded ones: replicated on their mesh.

    Leaves of both kinds are allocated and written by the same compiled functions. With `Auto`
    mesh axes JAX replicates an unplaced leaf over the mesh anyway; with `Explicit` axes it
    cannot combine an unplaced leaf with sharded ones and fails.
    """
    named = [s for s in shardings if isinstance(s, NamedSharding)]
    if not named or None not in shardings:
        return shardings
    replicated = NamedSharding(named[0].mesh, PartitionSpec())
    return tuple(replicated if s is None else s for s in shardings)


def stacked_sharding(sharding: Sharding | None) -> Sharding | None:
    """The sharding of a stacked leaf: the per-layer one, with a replicated layer axis in front."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    return sharding


def has_explicit_axes(sharding: Sharding | None) -> bool:
    if not isinstance(sharding, NamedSharding):
        return False
    return any(t == AxisType.Explicit for t in sharding.mesh.axis_types)


def fsdp(mesh: Any, axis: str | tuple[str, ...] = "data") -> ShardingRule:
    """A sharding rule that shards each leaf's largest divisible dimension over `axis`.

    For `build_stacked(..., sharding=eqx_lean.fsdp(mesh))`: every leaf of one layer is split
    along its largest dimension whose size the mesh axis divides (the first such, on ties).
    Vectors are no exception: a norm's weight or a bias whose width the axis divides is
    sharded like any matrix (on 8 devices, a 1024-wide norm is split into 8 pieces of 128).
    A leaf is replicated only where no dimension divides: scalars, and vectors whose width the
    axis does not divide. With one device on `axis`, every leaf is replicated.

    [`eqx_lean.fold`][] and [`eqx_lean.scan`][] run such a stack as ZeRO-3 does, gathering
    each layer just before it runs.

    **Arguments:**

    - `mesh`: the `jax.sharding.Mesh` to shard over.
    - `axis`: the mesh axis name (or tuple of names) to shard over.

    **Returns:**

    A rule `(path, leaf) -> NamedSharding`.
    """
    names = axis if isinstance(axis, tuple) else (axis,)
    missing = [name for name in names if name not in mesh.shape]
    if missing:
        raise ValueError(f"`axis` {missing} is not an axis of the mesh {tuple(mesh.axis_names)}.")
    devices = _mesh_axis_size(mesh, axis)

    def rule(path: KeyPath, leaf: jax.ShapeDtypeStruct) -> NamedSharding:
        del path
        divisible = [d for d, size in enumerate(leaf.shape) if size % devices == 0 and size > 0]
        if not divisible or devices == 1:
            return NamedSharding(mesh, PartitionSpec())
        dim = max(divisible, key=lambda d: (leaf.shape[d], -d))
        spec: list[str | tuple[str, ...] | None] = [None] * len(leaf.shape)
        spec[dim] = axis
        return NamedSharding(mesh, PartitionSpec(*spec))

    return rule
