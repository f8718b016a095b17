"""What `fold` and `scan` check of their inputs before JAX sees them: the stack's layer axis
(its length, `num_layers=`, and that it is not sharded) and the per-layer inputs `xs`."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from .. import _arguments as arguments
from .._core import num_layers_of_stack
from .._core.layout import leaf_struct, stack_leaf_name
from .._core.sharding import axis_names, mesh_axis_size


def check_num_layers(num_layers: Any) -> None:
    """Refuses a `num_layers=` that is not `None` or a positive int."""
    arguments.optional_integer(num_layers, "`num_layers` (the number of stacked layers)", minimum=1)


def check_layer_axis_replicated(dynamic: Any) -> None:
    """Refuses a stacked leaf whose type shards the layer axis (over Explicit mesh axes), with
    how to reshard it; JAX would fail on slicing a layer out of it."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(dynamic)[0]:
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        if not isinstance(sharding, NamedSharding):
            continue
        spec = sharding.spec
        if not spec or spec[0] is None or mesh_axis_size(sharding.mesh, spec[0]) == 1:
            continue
        names = axis_names(spec[0])
        axes = f"mesh axis {names[0]!r}" if len(names) == 1 else f"mesh axes {names!r}"
        replicated = PartitionSpec(None, *spec[1:])
        raise ValueError(
            f"{stack_leaf_name(path)} ({leaf_struct(leaf)}, sharded {spec}) has its layer axis "
            f"(dimension 0) sharded over {axes}. `fold` and `scan` slice one layer at a time "
            "out of the stack and need its layer axis replicated (shard within each layer "
            "instead: each layer is gathered just before it runs). Reshard the stack first, for "
            "this leaf "
            f"`jax.device_put(leaf, NamedSharding(mesh, {replicated}))` "
            f"(inside `jax.jit`: `jax.sharding.reshard(leaf, {replicated})`), or restore or "
            "load it that way: a target whose specs start with None, or `load_stacked` "
            "without `layer_axis=`."
        )


def checked_stack(stacked: Any, num_layers: int | None) -> tuple[Any, Any, int]:
    """`stacked` split into its arrays and the rest, and its number of layers, once checked."""
    check_num_layers(num_layers)
    check_stacked(stacked)
    dynamic, static = eqx.partition(stacked, eqx.is_array)
    length = num_layers_of_stack(dynamic, num_layers)
    check_layer_axis_replicated(dynamic)
    return dynamic, static, length


def check_xs(xs: Any, num_layers: int) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(xs)[0]:
        where = f"xs{jax.tree_util.keystr(path)}"
        if not eqx.is_array_like(leaf):
            raise TypeError(
                f"`xs` must be a pytree of arrays with a leading layer axis; `{where}` is a "
                f"{type(leaf).__name__}."
            )
        shape = jnp.shape(leaf)
        if len(shape) == 0 or shape[0] != num_layers:
            raise ValueError(
                f"`xs` must have a leading layer axis of length L={num_layers} (the number of "
                f"stacked layers) on every leaf, one slice per layer; `{where}` has shape "
                f"{list(shape)}."
            )


def check_stacked(stacked: Any) -> None:
    """Refuses a Python sequence of separate layers, the usual mistake, with what to do."""
    if not (isinstance(stacked, list | tuple) and stacked):
        return
    if not all(isinstance(x, eqx.Module) for x in stacked):
        return
    if isinstance(stacked, tuple) and not _like_separate_layers(stacked):
        # A tuple of stacked modules of different kinds is a valid pytree.
        try:
            num_layers_of_stack(eqx.filter(stacked, eqx.is_array))
            return
        except ValueError:
            pass
    raise TypeError(
        f"`stacked` must be one module whose array leaves carry a leading layer axis (built by "
        "`eqx_lean.build_stacked` or `eqx.filter_vmap(make_layer)(keys)`); got a "
        f"{type(stacked).__name__} of {len(stacked)} separate layers. Stack them first with "
        "`eqx_lean.stack(layers)` (or build them with `eqx_lean.build_stacked`). To go through "
        "several stacks of one kind of layer together, pass them in a dict, "
        "`{'a': stack_a, 'b': stack_b}`."
    )


def _like_separate_layers(modules: tuple[Any, ...]) -> bool:
    """Whether `modules` look like layers made one by one: two or more distinct modules of one
    type, one structure and the same shapes and dtypes. Such a tuple reads as a stack whenever
    each layer's leaves share their first dimension (a square `eqx.nn.Linear` with its bias),
    and `fold` would then go through the rows of the weights as layers. Stacks of one kind can
    look the same: they are passed in a dict instead (the message says so). The same module
    twice is not layers made one by one, and stays a tuple of stacks."""
    if len(modules) < 2 or all(m is modules[0] for m in modules):
        return False
    if len({type(m) for m in modules}) != 1:
        return False

    def arrays(module: Any) -> tuple[Any, list[tuple[Any, Any]]]:
        leaves, treedef = jax.tree.flatten(eqx.filter(module, eqx.is_array))
        return treedef, [(leaf.shape, leaf.dtype) for leaf in leaves]

    first = arrays(modules[0])
    return all(arrays(m) == first for m in modules[1:])
