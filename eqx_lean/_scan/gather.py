"""ZeRO-3 for `fold` and `scan`: each layer's parameters gathered just before the layer runs.

A stack sharded within each layer (for example by `build_stacked(..., sharding=fsdp(mesh))`)
keeps only its shard on each device. Inside the loop, the layer sliced out of the stack is
constrained to the sharding its computation needs (by default, replicated over the mesh), so
the layer's own code runs unchanged on Explicit and Auto meshes alike, and per-device memory is
the stack's shard plus about one gathered layer. Under differentiation, the transpose of that
constraint brings each layer's gradient back to the stack's own sharding (a reduce-scatter).
"""

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax
from jax import lax
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding, PartitionSpec, Sharding

# The package's one sharding resolver: `build_stacked(sharding=...)` means the same.
from .. import _platform
from .._compat import shard_alike
from .._core import ShardingPolicy, resolve_shardings
from .._core.layout import layer_struct
from .._core.sharding import (
    aval_mesh,
    constrain,
    describe_mesh,
    explicit_type_sharding,
    same_mesh,
)
from .remat import checkpointed


Gather: TypeAlias = bool | ShardingPolicy
_Step: TypeAlias = Callable[[Any, Any, Any], tuple[Any, Any]]
_GatherShardings: TypeAlias = tuple[NamedSharding | None, ...]

_GATHER_FORMS = (
    "`gather` must be True (gather each layer's parameters, replicated over their mesh), False "
    "(keep them as they are), or a sharding policy as for `build_stacked`'s `sharding=`: one "
    "Sharding or PartitionSpec, a pytree prefix of the layer, or a rule `(path, leaf) -> "
    "sharding`, per layer (without the layer axis)"
)


def _concrete_mesh(leaves: Sequence[Any]) -> Any:
    """The concrete mesh of the stack's leaves, when any is a concrete named-sharded array."""
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer):
            if isinstance(leaf.sharding, NamedSharding):
                return leaf.sharding.mesh
    return None


def _check_gather(gather: Any) -> None:
    if gather is None or (not isinstance(gather, bool) and isinstance(gather, int | float | str)):
        raise TypeError(f"{_GATHER_FORMS}; got {gather!r}.")


def _resolve_policy(
    gather: ShardingPolicy, paths: Sequence[Any], leaves: Sequence[Any], treedef: Any
) -> _GatherShardings:
    meshes = [aval_mesh(leaf) for leaf in leaves]
    on_mesh = [(path, m) for path, m in zip(paths, meshes, strict=True) if m is not None]
    if not on_mesh:
        raise ValueError(
            f"`gather` is a sharding policy ({gather!r}), but no array leaf of `stacked` lies on "
            "a device mesh (none has a NamedSharding): there is nothing to gather. Pass "
            "`gather=True` or `gather=False`, or shard the stack first."
        )
    first_path, mesh = on_mesh[0]
    for path, other in on_mesh[1:]:
        if not same_mesh(other, mesh):
            raise ValueError(
                f"`gather` is a sharding policy, which names one mesh, but the leaves of "
                f"`stacked` lie on different meshes: {jax.tree_util.keystr(first_path)} on "
                f"{describe_mesh(mesh)}, {jax.tree_util.keystr(path)} on {describe_mesh(other)}."
            )
    # Per layer, as the rule sees them in `build_stacked`: shapes without the layer axis.
    structs = [layer_struct(leaf) for leaf in leaves]
    resolved = resolve_shardings(
        gather,
        _concrete_mesh(leaves) or mesh,
        paths,
        structs,
        treedef,
        argument="gather",
        placement=False,
    )
    shardings = []
    for path, leaf_mesh, chosen in zip(paths, meshes, resolved, strict=True):
        shardings.append(_gather_sharding(path, leaf_mesh, chosen))
    return tuple(shardings)


def _gather_sharding(path: Any, leaf_mesh: Any, chosen: Sharding | None) -> NamedSharding | None:
    """The sharding one layer's leaf is gathered to, on the mesh the stack's leaf lies on."""
    if chosen is None:
        return None
    where = f"leaf {jax.tree_util.keystr(path)}"
    if leaf_mesh is None:
        raise ValueError(
            f"`gather` gives {where} the sharding {chosen}, but that leaf of `stacked` lies on "
            "no device mesh; give it None, or shard the stack first."
        )
    if not isinstance(chosen, NamedSharding):  # a fully replicated Sharding, as resolved
        return NamedSharding(leaf_mesh, PartitionSpec())
    if not same_mesh(chosen.mesh, leaf_mesh):
        raise ValueError(
            f"`gather` gives {where} a sharding on the mesh {describe_mesh(chosen.mesh)}, but the "
            f"leaf lies on the mesh {describe_mesh(leaf_mesh)}: gather within the stack's own mesh."
        )
    # The spec on the leaf's own (abstract) mesh: its axis types decide reshard or constraint.
    return NamedSharding(leaf_mesh, chosen.spec)


def gather_shardings(dynamic: Any, gather: Gather) -> _GatherShardings:
    """Each stacked leaf's per-layer sharding inside the loop; `None` leaves it as it is.

    **Arguments:**

    - `dynamic`: the stack's array part, every leaf with a leading layer axis.
    - `gather`: `True`, `False` or a sharding policy, as `fold`'s and `scan`'s `gather=`.

    **Returns:**

    One `NamedSharding` (on the leaf's abstract mesh, without the layer axis) or `None` per
    array leaf, in `jax.tree.leaves` order.
    """
    _check_gather(gather)
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(dynamic)
    paths = [path for path, _ in path_leaves]
    leaves = [leaf for _, leaf in path_leaves]
    if gather is False:
        return (None,) * len(leaves)
    if gather is True:
        meshes = [aval_mesh(leaf) for leaf in leaves]
        return tuple(None if m is None else NamedSharding(m, PartitionSpec()) for m in meshes)
    return _resolve_policy(gather, paths, leaves, treedef)


def gathered_step(step: _Step, shardings: _GatherShardings) -> _Step:
    """Wraps the per-layer step: the sliced layer's leaves are constrained to `shardings` first.

    The gathered parameters are never saved for the backward pass, whatever the `remat` policy:
    like ZeRO-3, the backward pass gathers each layer again from its shard.
    """
    if all(s is None for s in shardings):
        return step

    def gather_leaves(leaves: list[Any]) -> list[Any]:
        # Without the barrier, on Auto axes XLA:CPU gathers the slice with its layer axis still
        # attached and gives the whole stack a new layout to suit it: a copy of the stack's
        # shard before the loop (52 MiB per device beside a 26 MiB layer on 8 devices in
        # `benchmarks/sharded_forward.py`). After the barrier the slice is a layer of its own.
        # On TPUs it pays too (`_platform.GATHER_BARRIER_PLATFORMS`); on GPUs it changes nothing.
        leaves = _platform.gather_barrier(leaves)
        return [x if s is None else constrain(x, s) for x, s in zip(leaves, shardings, strict=True)]

    # Saved as residuals, the gathered layers of a whole stack would be held at once.
    gather_leaves = checkpointed(gather_leaves, jax.checkpoint_policies.nothing_saveable)

    def step_on_gathered(layer: Any, carry: Any, x: Any) -> tuple[Any, Any]:
        leaves, treedef = jax.tree.flatten(layer)
        return step(jax.tree.unflatten(treedef, gather_leaves(leaves)), carry, x)

    return step_on_gathered


def _auto_mesh_leaves(leaves: Sequence[Any], shardings: _GatherShardings) -> list[bool]:
    """The leaves gathered over a mesh with Auto axes (all of them Auto, or some)."""
    return [
        s is not None and s.mesh.size > 1 and AxisType.Auto in s.mesh.axis_types
        for leaf, s in zip(leaves, shardings, strict=True)
    ]


def _tie_to(cotangent: Any, primal: Any) -> Any:
    explicit = explicit_type_sharding(primal)
    if explicit is not None:
        # A mesh mixing both kinds: the type says how the Explicit axes shard the gradient
        # (JAX's own transpose of a scan under `vmap` loses that), `shard_alike` the rest.
        cotangent = jax.sharding.reshard(cotangent, explicit)
    elif isinstance(primal, jax.Array) and not isinstance(primal, Tracer):
        return lax.with_sharding_constraint(cotangent, primal.sharding)
    return shard_alike(cotangent, primal)[0]


def tie_gradient_shardings(dynamic: Any, shardings: _GatherShardings) -> Any:
    """The stack unchanged; its gradient placed as the stack is, on Auto meshes.

    With Explicit axes, `reshard`'s transpose already returns each layer's gradient to the
    stack's sharding. With Auto axes, a tracer does not carry its sharding and the transpose of
    `with_sharding_constraint` is the same (gathered) constraint, which would leave the gradient
    replicated: `shard_alike` makes the partitioner give it the stack's own sharding instead.
    """
    leaves, treedef = jax.tree.flatten(dynamic)
    tied = _auto_mesh_leaves(leaves, shardings)
    if not any(tied):
        return dynamic

    @jax.custom_vjp
    def tie(leaves: list[Any]) -> list[Any]:
        return leaves

    def tie_fwd(leaves: list[Any]) -> tuple[list[Any], list[Any]]:
        return leaves, leaves

    def tie_bwd(primals: list[Any], cotangents: list[Any]) -> tuple[list[Any]]:
        return (
            [
                _tie_to(c, p) if is_tied else c
                for c, p, is_tied in zip(cotangents, primals, tied, strict=True)
            ],
        )

    tie.defvjp(tie_fwd, tie_bwd)
    return jax.tree.unflatten(treedef, tie(leaves))
