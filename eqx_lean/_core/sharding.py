"""The sharding each array leaf of a layer is stored with: the one resolver of `sharding=`,
`mesh=` and `layer_axis=`, its checks and error format, and `fsdp`."""

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, cast

import equinox as eqx
import jax
import numpy as np
from jax import lax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec, Sharding
from jaxtyping import Array, PyTree

from .rules import (
    PATH_CONVENTION as PATH_CONVENTION,
    DtypeRule as DtypeRule,
    KeyPath as KeyPath,
    TreeDtypeRule as TreeDtypeRule,
    describe_raised as describe_raised,
    rule_error as rule_error,
)


# --- sharding ---------------------------------------------------------------------------------
#
# One meaning everywhere: `sharding=` is how each leaf of ONE LAYER is sharded; the layer axis of
# a stacked leaf is replicated, or sharded over the mesh axes of the separate `layer_axis=`
# option where a function offers it. Every function that takes `sharding=`/`mesh=` resolves them
# here, and every error names the argument, the leaf's path, its shape and the spec.

ShardingLike: TypeAlias = Sharding | PartitionSpec | None
ShardingRule: TypeAlias = Callable[[KeyPath, jax.ShapeDtypeStruct], ShardingLike]
ShardingPolicy: TypeAlias = ShardingLike | ShardingRule | PyTree[ShardingLike]
LayerAxis: TypeAlias = str | tuple[str, ...] | None


def _is_sharding_leaf(x: Any) -> bool:
    # A PartitionSpec is a tuple, and so a pytree node, unless it is named a leaf.
    return x is None or isinstance(x, Sharding | PartitionSpec)


def is_sharding_rule(sharding: Any) -> bool:
    return callable(sharding) and not isinstance(sharding, eqx.Module | Sharding | PartitionSpec)


def _per_leaf(
    sharding: ShardingPolicy,
    paths: Sequence[KeyPath],
    structs: Sequence[jax.ShapeDtypeStruct],
    treedef: Any,
    argument: str,
) -> list[Any]:
    if _is_sharding_leaf(sharding):
        return [sharding] * len(structs)
    if is_sharding_rule(sharding):
        rule = cast(ShardingRule, sharding)
        return [
            _call_sharding_rule(rule, path, struct, argument)
            for path, struct in zip(paths, structs, strict=True)
        ]
    layer_of_structs = jax.tree.unflatten(treedef, structs)
    chosen: list[Any] = []

    def repeat_for_each_leaf(leaf_sharding: Any, subtree: Any) -> None:
        # A prefix leaf over a subtree without arrays (such as `bias=None`) stands for nothing.
        chosen.extend([leaf_sharding] * len(jax.tree.leaves(subtree)))

    try:
        jax.tree.map(repeat_for_each_leaf, sharding, layer_of_structs, is_leaf=_is_sharding_leaf)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"`{argument}` must be one Sharding or PartitionSpec, a rule `(path, leaf) -> "
            "sharding`, or a pytree prefix of the layer's array leaves whose leaves are "
            f"Shardings, PartitionSpecs or None; it does not match the layer: {e}"
        ) from e
    return chosen


def _call_sharding_rule(
    rule: ShardingRule, path: KeyPath, struct: jax.ShapeDtypeStruct, argument: str
) -> Any:
    try:
        return rule(path, struct)
    except Exception as e:
        raise rule_error(
            e,
            f"The `{argument}` rule raised {describe_raised(e)} for leaf "
            f"{jax.tree_util.keystr(path)} ({struct.dtype}{list(struct.shape)}). "
            f"{PATH_CONVENTION} A `{argument}` rule sees one layer's ShapeDtypeStruct for a "
            "stacked leaf.",
        ) from e


def axis_names(entry: Any) -> tuple[str, ...]:
    """The mesh axis names of one entry of a `PartitionSpec` (`None`, a name, or a tuple)."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def mesh_axis_size(mesh: Any, axes: Any) -> int:
    return int(np.prod([mesh.shape[name] for name in axis_names(axes)]))


def check_spec(
    path: KeyPath,
    shape: tuple[int, ...],
    spec: PartitionSpec,
    mesh: Any,
    *,
    argument: str = "sharding",
    per_layer: bool = True,
) -> None:
    """Checks that `spec` fits a leaf of `shape` on `mesh`; the one error format of the package.

    **Arguments:**

    - `path`: the leaf's key path, named in the error (`()` for a lone tensor).
    - `shape`: the shape the spec applies to (one layer's, for a stacked leaf).
    - `spec`: the `PartitionSpec`.
    - `mesh`: the mesh it refers to (a `Mesh` or `AbstractMesh`).
    - `argument`: the argument's name, for the message.
    - `per_layer`: whether `shape` is one layer of a stacked leaf (for the message about a spec
        that covers the layer axis too).
    """
    where = jax.tree_util.keystr(path)
    where = f"leaf {where} of shape {tuple(shape)}" if where else f"shape {tuple(shape)}"
    where = f"`{argument}`: {where} with spec {spec}"
    if len(spec) > len(shape):
        if per_layer and len(spec) == len(shape) + 1 and argument == "sharding":
            raise ValueError(
                f"{where} names one more dimension than the leaf has. Since eqx_lean 0.2.0 "
                "`sharding` is per layer everywhere (as in `build_stacked`): the spec describes "
                "one layer's leaf, and the layer axis is replicated. Drop the layer axis from "
                "the spec; to shard the layer axis itself (pipeline stages), pass `layer_axis=` "
                "to `allocate_stacked`, `load_stacked` or `load_tensors`."
            )
        layer = " (one layer's leaf, without the layer axis)" if per_layer else ""
        raise ValueError(f"{where} names more dimensions than the leaf{layer} has.")
    seen: set[str] = set()
    for size, axes in zip(shape, spec, strict=False):
        for name in axis_names(axes):
            if name not in mesh.shape:
                raise ValueError(
                    f"{where} names mesh axis {name!r}, which is not one of the mesh's axes "
                    f"{tuple(mesh.axis_names)}."
                )
            if name in seen:
                raise ValueError(
                    f"{where} names mesh axis {name!r} more than once; a mesh axis can shard "
                    "only one dimension."
                )
            seen.add(name)
        if axes is not None and size % mesh_axis_size(mesh, axes) != 0:
            raise ValueError(
                f"{where}: dimension of size {size} is not divisible by the "
                f"{mesh_axis_size(mesh, axes)} devices of mesh axes {axes!r}."
            )


def current_mesh(mesh: Any) -> Any:
    """`mesh`, or the mesh set by `jax.set_mesh` when `mesh` is `None` (else `None`)."""
    if mesh is not None:
        if not isinstance(mesh, Mesh | AbstractMesh):
            raise TypeError(f"`mesh` must be a `jax.sharding.Mesh` or None; got {mesh!r}.")
        return mesh
    try:
        found = jax.sharding.get_mesh()
    except ValueError:
        # Inside `jit` only the abstract mesh is available; NamedShardings accept it there.
        found = jax.sharding.get_abstract_mesh()
    return None if found.empty else found


def aval_mesh(x: Any) -> AbstractMesh | None:
    """The abstract mesh `x`'s type names (`jax.typeof(x).sharding.mesh`; under `jit`, the one
    a tracer carries), or `None` when it names none or an empty one."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty:
        return None
    return mesh


def same_mesh(a: Any, b: Any) -> bool:
    """Whether two meshes (concrete or abstract) have the same axis names and sizes."""
    a, b = a.abstract_mesh, b.abstract_mesh
    return a.axis_names == b.axis_names and a.axis_sizes == b.axis_sizes


def describe_mesh(mesh: Any) -> str:
    """`{'data': 4, 'model': 2}`: a mesh's axes, for error messages."""
    return "{" + ", ".join(f"{name!r}: {size}" for name, size in mesh.shape.items()) + "}"


def mesh_of(mesh: Any, shardings: Sequence[Sharding | None]) -> Any:
    """The mesh of a call: `current_mesh(mesh)`, else that of its first `NamedSharding` (else
    `None`); the mesh `layer_axis=` names its axes in."""
    return current_mesh(mesh) or next(
        (s.mesh for s in shardings if isinstance(s, NamedSharding)), None
    )


def _one_leaf_sharding(
    path: KeyPath, struct: Any, sharding: Any, mesh: Any, argument: str, per_layer: bool
) -> Sharding | None:
    if sharding is None:
        return None
    where = jax.tree_util.keystr(path) or "the tensor"
    if isinstance(sharding, PartitionSpec):
        if mesh is None:
            raise ValueError(
                f"`{argument}` gives leaf {where} a PartitionSpec, which needs a device mesh: "
                "pass `mesh=`, call inside `jax.set_mesh(mesh)`, or give NamedShardings."
            )
        # Checked first: NamedSharding's own error for an unknown axis names no leaf or shape.
        check_spec(path, struct.shape, sharding, mesh, argument=argument, per_layer=per_layer)
        return NamedSharding(mesh, sharding)
    if isinstance(sharding, NamedSharding):
        check_spec(
            path,
            struct.shape,
            sharding.spec,
            sharding.mesh,
            argument=argument,
            per_layer=per_layer,
        )
        return sharding
    if isinstance(sharding, Sharding) and sharding.is_fully_replicated:
        return sharding
    raise TypeError(
        f"`{argument}` for leaf {where} must be a NamedSharding, a PartitionSpec, a fully "
        f"replicated Sharding, or None; got {sharding!r}."
    )


def resolve_shardings(
    sharding: ShardingPolicy,
    mesh: Mesh | AbstractMesh | None,
    paths: Sequence[KeyPath],
    structs: Sequence[jax.ShapeDtypeStruct],
    treedef: Any,
    *,
    per_layer: Sequence[bool] | None = None,
    argument: str = "sharding",
    placement: bool = True,
) -> tuple[Sharding | None, ...]:
    """Each leaf's sharding under the policy `sharding`: the one resolver of the package.

    **Arguments:**

    - `sharding`: `None`; one `Sharding` or `PartitionSpec` for every leaf; a rule
        `(path, leaf) -> Sharding | PartitionSpec | None`; or a pytree prefix of the layer.
    - `mesh`: the `jax.sharding.Mesh` that `PartitionSpec`s refer to; `None` takes the mesh
        set by `jax.set_mesh`, if any.
    - `paths`, `structs`, `treedef`: the leaves, as flattened. For a stacked leaf, `structs`
        holds one layer's shape: that is what the sharding (and a rule) sees.
    - `per_layer`: for each leaf, whether it is one layer of a stacked leaf (default: all).
    - `argument`: the argument's name, for messages.
    - `placement`: whether the shardings place new arrays (`sharding=` of a build or a load),
        where no sharding at all means JAX's default placement: replicated over the mesh
        (`mesh`, or the one `jax.set_mesh` sets), as JAX places an array created under
        `jax.set_mesh`, else the default device. `False` for `gather=`, where `None` means
        "as it is".

    **Returns:**

    One sharding per leaf, for the shape in `structs`; `None` (the default device) only where
    no leaf is named-sharded and no concrete mesh is given or set.
    """
    if sharding is None:
        on = current_mesh(mesh) if placement else None
        if not isinstance(on, Mesh):
            return (None,) * len(structs)
        # A build or load under `jax.set_mesh` is traced under that mesh: its arrays must
        # live on it too (with Explicit axes JAX refuses to combine them with unplaced ones).
        return (NamedSharding(on, PartitionSpec()),) * len(structs)
    mesh = current_mesh(mesh)
    per_layer = [True] * len(structs) if per_layer is None else list(per_layer)
    chosen = _per_leaf(sharding, paths, structs, treedef, argument)
    resolved = tuple(
        _one_leaf_sharding(path, struct, leaf_sharding, mesh, argument, stacked)
        for path, struct, leaf_sharding, stacked in zip(
            paths, structs, chosen, per_layer, strict=True
        )
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


def check_layer_axis(layer_axis: LayerAxis, mesh: Any, num_layers: int) -> tuple[str, ...]:
    """The mesh axes `layer_axis=` names, after checking them against the mesh and `L`."""
    names = axis_names(layer_axis)
    if not names:
        return ()
    if mesh is None:
        raise ValueError(
            f"`layer_axis` {layer_axis!r} shards the layer axis over mesh axes, which needs a "
            "mesh: pass NamedShardings or `mesh=`, or call inside `jax.set_mesh(mesh)`."
        )
    for name in names:
        if name not in mesh.shape:
            raise ValueError(
                f"`layer_axis` names mesh axis {name!r}, which is not one of the mesh's axes "
                f"{tuple(mesh.axis_names)}."
            )
    if num_layers % mesh_axis_size(mesh, names):
        raise ValueError(
            f"`layer_axis` {layer_axis!r} splits the {num_layers} layers over "
            f"{mesh_axis_size(mesh, names)} devices, which does not divide them."
        )
    return names


def stacked_sharding(
    sharding: Sharding | None, layer_axis: tuple[str, ...] = (), mesh: Any = None
) -> Sharding | None:
    """The sharding of a stacked leaf: the per-layer one, with the layer axis in front.

    The layer axis is replicated unless `layer_axis` names mesh axes to shard it over.
    """
    entry = None if not layer_axis else (layer_axis[0] if len(layer_axis) == 1 else layer_axis)
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(entry, *sharding.spec))
    if entry is not None:
        return NamedSharding(mesh, PartitionSpec(entry))
    return sharding


def stacked_shardings(
    paths: Sequence[KeyPath],
    shardings: Sequence[Sharding | None],
    layer_axis: tuple[str, ...],
    mesh: Any,
) -> tuple[Sharding | None, ...]:
    """`stacked_sharding` of each leaf, checking that no mesh axis shards two dimensions."""
    for path, sharding in zip(paths, shardings, strict=True):
        if not (layer_axis and isinstance(sharding, NamedSharding)):
            continue
        used = {name for entry in sharding.spec for name in axis_names(entry)}
        if used & set(layer_axis):
            raise ValueError(
                f"`layer_axis` {layer_axis} shards the layer axis over mesh axes that the "
                f"sharding of leaf {jax.tree_util.keystr(path)} ({sharding.spec}) uses for one "
                "of its own dimensions; a mesh axis can shard only one dimension."
            )
    return tuple(stacked_sharding(s, layer_axis, mesh) for s in shardings)


def per_layer_sharding(path: KeyPath, sharding: Sharding | None, argument: str) -> Sharding | None:
    """The per-layer part of a stacked leaf's sharding, which must replicate the layer axis."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec)
    if spec and spec[0] is not None:
        # Passing `layer_axis=` alone gives this error again: the leaf still carries the spec.
        replicated = PartitionSpec(None, *spec[1:])
        raise ValueError(
            f"`{argument}`: leaf {jax.tree_util.keystr(path)} carries the stacked sharding "
            f"{sharding.spec}, which shards the layer axis over {spec[0]!r}. The shardings "
            f"`{argument}` carries must replicate the layer axis (their spec starts with None), "
            f"here {replicated}; the loaded stack then runs under `fold` and `scan`. To shard "
            f"the layer axis itself (pipeline stages), give that spec and also pass "
            f"`layer_axis={spec[0]!r}`. (Or pass the per-layer sharding as `sharding=`, here "
            f"{PartitionSpec(*spec[1:])} with `mesh=`, which overrides the shardings "
            f"`{argument}` carries.)"
        )
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]))


def has_explicit_axes(sharding: Sharding | None) -> bool:
    if not isinstance(sharding, NamedSharding):
        return False
    return any(t == AxisType.Explicit for t in sharding.mesh.axis_types)


def explicit_part(sharding: NamedSharding) -> NamedSharding:
    """`sharding` with its spec naming only the mesh's Explicit axes: what an array's type can
    say of it (on a mesh mixing Explicit and Auto axes, the Auto ones are the compiler's)."""
    explicit = {
        name
        for name, kind in zip(sharding.mesh.axis_names, sharding.mesh.axis_types, strict=True)
        if kind == AxisType.Explicit
    }

    def kept(entry: Any) -> Any:
        names = tuple(name for name in axis_names(entry) if name in explicit)
        return None if not names else names[0] if len(names) == 1 else names

    return sharding.update(spec=PartitionSpec(*(kept(entry) for entry in sharding.spec)))


def explicit_type_sharding(x: Any) -> NamedSharding | None:
    """The sharding `x`'s type carries, where it names Explicit mesh axes; else `None`.

    For an operation's `out_sharding=`: with Explicit axes JAX asks for it wherever the result's
    sharding is ambiguous (a product contracting a sharded dimension, a gather of sharded rows),
    and a gradient or an output shaped like `x` must be sharded as `x` is. With Auto axes (or
    none) `None` leaves the choice to XLA, as a plain operation would.
    """
    sharding = getattr(jax.typeof(x), "sharding", None)
    return sharding if has_explicit_axes(sharding) else None


def explicit_spec(x: Any) -> tuple[Any, ...] | None:
    """One entry per dimension of `x` (`None` for an unsharded one) of the sharding its type
    carries, where that names Explicit mesh axes; else `None`."""
    sharding = explicit_type_sharding(x)
    if sharding is None:
        return None
    return tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))


def resharded_like(x: Array, reference: Array) -> Array:
    """`x` resharded as `reference` is, where both carry Explicit mesh axes and differ; else
    `x` as it is (with Auto axes XLA chooses)."""
    target = explicit_type_sharding(reference)
    if target is None or explicit_type_sharding(x) is None:
        return x
    return jax.sharding.reshard(x, target)


def like_last_axis(vector: Array, x: Array) -> Array:
    """`vector`, a vector as long as `x`'s last dimension, sharded as `x` shards it.

    For a bias or a norm's weight (which [`fsdp`][eqx_lean.fsdp] may split) broadcast against
    activations: with Explicit mesh axes JAX refuses a product whose result would shard one mesh
    axis twice (the batch over "data" and the vector over "data" too), so the vector is
    resharded (gathered, for activations whose last axis is whole) first; its gradient comes
    back sharded as it was. With Auto axes, or none, `vector` is returned as it is and XLA
    chooses.
    """
    spec = explicit_spec(x)
    if spec is None or explicit_type_sharding(vector) is None:
        return vector
    sharding = cast(NamedSharding, explicit_type_sharding(x))
    return jax.sharding.reshard(vector, sharding.update(spec=PartitionSpec(spec[-1])))


def constrain(x: Array, sharding: Sharding | None, *, inside_auto_axes: bool = False) -> Array:
    """Constrains a traced array to a sharding, whichever kind of mesh axes it names.

    **Arguments:**

    - `x`: an array being traced (inside `jax.jit` or a compiled write).
    - `sharding`: the sharding `x` must have; `None` leaves `x` as it is.
    - `inside_auto_axes`: whether the trace runs inside `jax.sharding.auto_axes`, where a
        `NamedSharding`'s mesh axes are all Auto: there it constrains by its `PartitionSpec`.

    **Returns:**

    `x` resharded (`jax.sharding.reshard`) where `sharding` names Explicit mesh axes, otherwise
    constrained with `lax.with_sharding_constraint`.
    """
    if sharding is None:
        return x
    if inside_auto_axes and isinstance(sharding, NamedSharding):
        return lax.with_sharding_constraint(x, sharding.spec)
    if has_explicit_axes(sharding):
        return jax.sharding.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)


def fsdp(mesh: Any, axis: str | tuple[str, ...] = "data") -> ShardingRule:
    """A sharding rule that shards each leaf's largest divisible dimension over `axis`.

    For `build_stacked(..., sharding=eqx_lean.fsdp(mesh))` and every other function that takes
    `sharding=`: every leaf of one layer is split along its largest dimension whose size the
    mesh axis divides (the first such, on ties). Vectors are no exception: a norm's weight or a
    bias whose width the axis divides is sharded like any matrix (on 8 devices, a 1024-wide norm
    is split into 8 pieces of 128). A leaf is replicated only where no dimension divides:
    scalars, and vectors whose width the axis does not divide. With one device on `axis`, every
    leaf is replicated.

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
    devices = mesh_axis_size(mesh, axis)

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
