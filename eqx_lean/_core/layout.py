"""How a layer splits into stacked array leaves and everything else, and what stacking it needs."""

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Sharding
from jaxtyping import Array

from .dtypes import DtypePolicy, resolve_dtypes


Structs = tuple[jax.ShapeDtypeStruct, ...]


def is_array_like(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def struct_of(x: Any, sharding: Sharding | None = None) -> jax.ShapeDtypeStruct:
    """The `jax.ShapeDtypeStruct` of a value: its shape, dtype and weak type.

    **Arguments:**

    - `x`: an array (JAX or NumPy), a `jax.ShapeDtypeStruct` or an abstract value of a jaxpr.
    - `sharding`: the struct's sharding. Without one, a `ShapeDtypeStruct` is returned as is
        (its own sharding kept) and any other value's struct has no sharding; with one, it
        replaces whatever `x` carries.

    **Returns:**

    A `jax.ShapeDtypeStruct` of `x`'s shape, dtype and weak type, placed on `sharding`.
    """
    if sharding is None and isinstance(x, jax.ShapeDtypeStruct):
        return x
    weak = bool(getattr(x, "weak_type", False))
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=weak, sharding=sharding)


def struct_bytes(x: Any) -> int:
    """The bytes of one array: its size times its dtype's item size.

    **Arguments:**

    - `x`: anything with a `shape` and a `dtype`: an array (JAX or NumPy), a
        `jax.ShapeDtypeStruct`, an abstract value of a jaxpr. Key dtypes count their key data
        (8 bytes a key for Threefry).

    **Returns:**

    The bytes of all of `x`, whatever its sharding (see `shard_bytes` for one device's share).
    """
    return math.prod(np.shape(x)) * x.dtype.itemsize


def layer_struct(stacked: Any) -> jax.ShapeDtypeStruct:
    """One layer's struct of a stacked leaf: its shape without the leading layer axis.

    What a dtype or sharding rule sees of a stacked leaf, as it sees a layer in
    `build_stacked`; also one layer's key of a key array.

    **Arguments:**

    - `stacked`: an array or a `jax.ShapeDtypeStruct` with a leading layer axis.

    **Returns:**

    A `jax.ShapeDtypeStruct` of shape `stacked.shape[1:]` and `stacked`'s dtype; no weak type
    and no sharding (a stacked leaf's sharding is not one layer's).
    """
    return jax.ShapeDtypeStruct(np.shape(stacked)[1:], stacked.dtype)


def shard_bytes(x: Any, sharding: Sharding | None = None) -> int:
    """The bytes of one device's shard of an array.

    **Arguments:**

    - `x`: an array or a `jax.ShapeDtypeStruct` (anything `struct_bytes` takes).
    - `sharding`: how `x` is split; `None` takes `x`'s own `sharding` attribute.

    **Returns:**

    The bytes of the shard `sharding.shard_shape(x.shape)`; all of `x`'s bytes where there is
    no sharding at all (replicated leaves count in full).
    """
    if sharding is None:
        sharding = getattr(x, "sharding", None)
    if sharding is None:
        return struct_bytes(x)
    return math.prod(sharding.shard_shape(np.shape(x))) * x.dtype.itemsize


def tree_bytes(tree: Any) -> int:
    """The bytes of every array leaf of a pytree.

    **Arguments:**

    - `tree`: a pytree (a model, a sequence of structs, `None`). Its arrays (JAX or NumPy) and
        `jax.ShapeDtypeStruct`s count; any other leaf (a Python number, a function, a string)
        is not an array and counts nothing.

    **Returns:**

    The sum of `struct_bytes` over those leaves: their logical bytes, whatever their sharding.
    """
    return sum(struct_bytes(x) for x in jax.tree.leaves(tree) if is_array_like(x))


class Layout(NamedTuple):
    """How one layer splits into array leaves (stacked) and everything else (kept as is)."""

    paths: tuple[Any, ...]
    structs: Structs
    treedef: Any
    static: Any

    @classmethod
    def of(cls, layer: Any) -> "Layout":
        dynamic, static = eqx.partition(layer, is_array_like)
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path(dynamic)
        paths = tuple(path for path, _ in path_leaves)
        structs = tuple(struct_of(leaf) for _, leaf in path_leaves)
        return cls(paths, structs, treedef, static)

    def combine(self, leaves: Sequence[Any]) -> Any:
        return eqx.combine(jax.tree.unflatten(self.treedef, leaves), self.static)

    def describe(self, index: int) -> str:
        return jax.tree_util.keystr(self.paths[index])


def num_layers_of_keys(keys: Any) -> int:
    """The number of layers `keys` makes (its leading axis), after checking it is a key array."""
    if not isinstance(keys, jax.Array | np.ndarray):
        raise TypeError(
            "`keys` must be a key array with a leading layer axis, e.g. "
            f"`jax.random.split(key, num_layers)`; got {type(keys).__name__}."
        )
    if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        expected_ndim = 1
    else:
        raw_shape = jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape
        if keys.dtype != jnp.uint32 or keys.shape[1:] != raw_shape:
            raise ValueError(
                "`keys` must be a typed key array of shape (num_layers,) or raw uint32 keys of "
                f"shape (num_layers, {', '.join(map(str, raw_shape))}) for the configured PRNG "
                f"implementation; got {keys.dtype}{list(keys.shape)}."
            )
        expected_ndim = 1 + len(raw_shape)
    if keys.ndim != expected_ndim:
        raise ValueError(
            "`keys` must have exactly one leading layer axis (one key per layer), e.g. "
            f"`jax.random.split(key, num_layers)`; got {keys.dtype}{list(keys.shape)}."
        )
    if keys.shape[0] == 0:
        raise ValueError("`keys` must hold at least one key (one per layer); got an empty array.")
    return keys.shape[0]


def leaf_struct(leaf: Any) -> str:
    return f"{jnp.result_type(leaf)}{list(jnp.shape(leaf))}"


def stack_leaf_name(path: Any) -> str:
    return f"`stacked{jax.tree_util.keystr(path)}`"


def _scalar_leaf(path: Any, leaf: Any) -> ValueError:
    weak = bool(getattr(jax.typeof(leaf), "weak_type", False))
    typed = ", weakly typed" if weak else ""
    found = f"{stack_leaf_name(path)} is a 0-d array ({leaf_struct(leaf)}{typed})"
    return ValueError(
        f"Every array leaf of `stacked` must carry the leading layer axis, but {found}. A "
        "Python number field of a module (such as `alpha: float`) becomes one where `jax.grad`, "
        "`jax.jit` or `jax.vmap` trace the module. Mark the field static "
        "(`eqx.field(static=True)`), or transform with `eqx.filter_grad` / `eqx.filter_jit`, "
        "which leave non-arrays alone; to give each layer its own value, make it an array "
        "with the layer axis (shape `(L,)`)."
    )


def num_layers_of_stack(dynamic: Any, num_layers: int | None = None) -> int:
    """The length `L` of the leading layer axis shared by every array leaf of `dynamic` (the
    array part of `stacked`), after checking that every leaf carries it, of length
    `num_layers` where given; an error names the leaf that does not."""
    path_leaves = jax.tree_util.tree_flatten_with_path(dynamic)[0]
    if not path_leaves:
        raise ValueError("`stacked` has no array leaves, so it has no layer axis.")
    for path, leaf in path_leaves:
        if np.ndim(leaf) == 0:
            raise _scalar_leaf(path, leaf)
    if num_layers is not None:
        for path, leaf in path_leaves:
            if jnp.shape(leaf)[0] != num_layers:
                raise ValueError(
                    f"`num_layers={num_layers}`: every array leaf of `stacked` must have a "
                    f"leading layer axis of length {num_layers}, but {stack_leaf_name(path)} is "
                    f"{leaf_struct(leaf)}. Is `stacked` one layer rather than a stack of them? "
                    "Stack layers with `eqx_lean.build_stacked` or `eqx_lean.stack`."
                )
        return num_layers
    first_path, first = path_leaves[0]
    length = jnp.shape(first)[0]
    for path, leaf in path_leaves[1:]:
        if jnp.shape(leaf)[0] != length:
            raise ValueError(
                "`stacked` must have one leading layer axis of the same length on every array "
                f"leaf, but {stack_leaf_name(first_path)} is {leaf_struct(first)} and "
                f"{stack_leaf_name(path)} is {leaf_struct(leaf)}."
            )
    return length


def stacked_structs(layout: Layout, num_layers: int, dtype: DtypePolicy) -> Structs:
    """The stacked leaves `(num_layers, *leaf.shape)` in the dtypes `dtype` chooses.

    `dtype` is resolved against the layer itself (its module types), each leaf seen per layer.
    """
    layer = layout.combine(layout.structs)
    chosen = resolve_dtypes(dtype, layer, layout.paths, layout.structs)
    return tuple(
        jax.ShapeDtypeStruct((num_layers, *leaf.shape), chosen_dtype, weak_type=weak)
        for leaf, (chosen_dtype, weak) in zip(layout.structs, chosen, strict=True)
    )


def zeros_like_struct(struct: jax.ShapeDtypeStruct) -> Array:
    """Zeros of `struct`'s shape and dtype, weakly typed where `struct` is."""
    if struct.weak_type:
        # Python scalars are the one public way to make a weakly typed array.
        zero = jax.dtypes.scalar_type_of(jnp.zeros((), struct.dtype))(0)
        filled = lax.full(struct.shape, zero)
        if filled.dtype == struct.dtype:
            return filled
    return jnp.zeros(struct.shape, struct.dtype)


# Leaves this small together share one group whatever the largest leaf is: each group is a
# compiled program (0.3-0.7 s each on XLA:CPU), and a few MiB of temporaries cost nothing.
SMALL_GROUP_BYTES = 4 * 2**20


def leaf_groups(
    structs: Sequence[jax.ShapeDtypeStruct], small_group_bytes: int = SMALL_GROUP_BYTES
) -> tuple[tuple[int, ...], ...]:
    """Groups leaf indices so that no group builds more than the largest leaf does, or more
    than `small_group_bytes` where every leaf is smaller.

    XLA removes whatever a compiled function does not return, so a write that returns one group
    of leaves creates (and draws random numbers for) only those leaves: the group bounds the
    temporaries. Small leaves share a group to keep the number of compiled functions low.
    (`small_group_bytes=0` gives the grouping by the largest leaf alone, for comparison.)
    """
    if not structs:
        return ()
    sizes = [struct_bytes(s) for s in structs]
    budget = max(*sizes, small_group_bytes)
    groups: list[list[int]] = []
    totals: list[int] = []
    for index in sorted(range(len(structs)), key=lambda j: -sizes[j]):
        for g, total in enumerate(totals):
            if total + sizes[index] <= budget:
                groups[g].append(index)
                totals[g] += sizes[index]
                break
        else:
            groups.append([index])
            totals.append(sizes[index])
    return tuple(tuple(sorted(g)) for g in groups)
