"""Memory-lean construction of stacked layers: one layer at a time into preallocated buffers."""

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, PRNGKeyArray

from . import _arguments as arguments, _core, _platform
from ._core import DtypePolicy, LayerAxis, ShardingPolicy
from .quant._sharding import check_layer_shardings


M = TypeVar("M")


def allocate_stacked(
    abstract_layer: M,
    num_layers: int,
    dtype: DtypePolicy = None,
    sharding: ShardingPolicy = None,
    *,
    mesh: Mesh | None = None,
    layer_axis: LayerAxis = None,
) -> M:
    """Allocates zero-filled stacked buffers for `num_layers` copies of a layer.

    This is the allocation step of [`eqx_lean.build_stacked`][]: buffers are created directly in
    their target dtype, so no full-precision copy of the stack ever exists. Loading a checkpoint
    and estimating memory start from here too.

    **Arguments:**

    - `abstract_layer`: one layer, whose array leaves may be `jax.ShapeDtypeStruct`s (for example
        from `eqx.filter_eval_shape(make_layer, key)`) or concrete arrays (only their shapes and
        dtypes are used).
    - `num_layers`: the length `L` of the new leading layer axis.
    - `dtype`: as for [`eqx_lean.build_stacked`][]; rules are given paths relative to
        `abstract_layer` (see [paths](../getting-started.md#paths-in-rules-and-name-functions)).
        Integer, boolean, complex and key-typed leaves are never cast.
    - `sharding`: each leaf's sharding within one layer, as for [`eqx_lean.build_stacked`][];
        each device allocates only its shards.
    - `mesh`: the mesh that `PartitionSpec`s in `sharding` refer to (default: the one set by
        `jax.set_mesh`, if any).
    - `layer_axis`: the mesh axis (or axes) to shard the layer axis itself over, for pipeline
        stages; `None` (the default) replicates it, as `fold` and `scan` expect.

    **Returns:**

    A pytree of the same structure as `abstract_layer`, each array leaf replaced by zeros of shape
    `(num_layers, *leaf.shape)`; non-array leaves and static fields are kept.
    """
    num_layers = arguments.integer(num_layers, "`num_layers`", minimum=1)
    layout = _core.Layout.of(abstract_layer)
    structs = _core.stacked_structs(layout, num_layers, _core.check_dtype_policy(dtype))
    per_layer = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in layout.structs)
    shardings = _core.resolve_shardings(sharding, mesh, layout.paths, per_layer, layout.treedef)
    found = _core.mesh_of(mesh, shardings)
    axes = _core.check_layer_axis(layer_axis, found, num_layers)
    stacked = _core.stacked_shardings(layout.paths, shardings, axes, found)
    return layout.combine(_core.allocate(structs, stacked))


# Test seam: tests/test_build.py interrupts a build between runs.
def _runs(num_layers: int, per_call: int, progress: bool) -> Iterator[tuple[int, int]]:
    """`(start, stop)` of each run of layers one call writes, advancing a progress bar."""
    bar = _progress_bar(num_layers) if progress else None
    for start in range(0, num_layers, per_call):
        stop = min(start + per_call, num_layers)
        yield start, stop
        if bar is not None:
            bar.update(stop - start)
    if bar is not None:
        bar.close()


def _progress_bar(num_layers: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError as e:
        raise ImportError(
            "`progress=True` needs tqdm: from the root of the eqx_lean checkout, `pip install "
            '".[progress]"`, or `pip install tqdm`.'
        ) from e
    return tqdm(total=num_layers, desc="build_stacked", unit="layer")


def build_stacked(
    make_layer: Callable[[PRNGKeyArray], M],
    keys: PRNGKeyArray,
    dtype: DtypePolicy = None,
    sharding: ShardingPolicy = None,
    *,
    mesh: Mesh | None = None,
    progress: bool = False,
) -> M:
    """Builds `L` layers stacked on a leading axis, one layer at a time.

    The result is bitwise equal to `eqx.filter_jit(eqx.filter_vmap(make_layer))(keys)` followed
    by casting its floating leaves to `dtype` (and to the eager `eqx.filter_vmap` too, unless
    `make_layer` does arithmetic on drawn values that compiled code fuses into a multiply-add),
    but it never holds more than the final stack plus the temporaries of one layer's largest
    leaf: buffers are preallocated in the target dtype, and each layer is built by a compiled
    write (the layer index is traced, so it compiles once whatever `L` is) that donates the
    stacked buffers and updates them in place. On CPU the writes lower JAX's Threefry hash
    unrolled (as JAX does on GPU and TPU), so each random draw fuses into the write of its rows
    and needs no temporaries at all; only what cannot fuse (a QR, a reduction over a leaf)
    costs the temporaries of one group of leaves, no larger than the largest leaf (or than
    4 MiB, where every leaf is smaller: a small layer is one compiled write).

    ```python
    keys = jax.random.split(jax.random.key(0), 32)
    blocks = eqx_lean.build_stacked(lambda k: Block(config, key=k), keys, jnp.bfloat16)
    ```

    **Compiled writes are reused by content.** `make_layer` is traced afresh on every call,
    and the compiled writes are looked up by what it traced to (its equations, the Python values
    it read, the shapes, dtypes and shardings) and by the settings that change random values
    (`jax_threefry_partitionable`, x64, the PRNG implementation, the matmul precision): a new
    `lambda k: Block(config, key=k)` of the same content compiles nothing, and a changed Python
    value gives a new program. Arrays `make_layer` closes over are passed to the writes as
    arguments, so their current values are used and nothing keeps them alive after the call.
    `eqx_lean.clear_caches()` forgets the compiled writes.

    Inside an outer trace (`jax.jit`, `eqx.filter_eval_shape`, or `vmap`/`grad` when `keys` or
    the arrays `make_layer` closes over are traced) the layers are written by a
    `lax.fori_loop`, so the trace holds one copy of `make_layer` whatever `L` is. There the
    outer `jit` lowers the draws, with JAX's own Threefry: on CPU the loops then carry its
    temporaries, several times the largest leaf, where the writes of an eager call need a few
    KiB ([benchmarks](../benchmarks.md#build_stacked-inside-an-outer-jit)).

    **Arguments:**

    - `make_layer`: builds one layer from a key, e.g. `lambda k: eqx.nn.MLP(..., key=k)`. It is
        traced with an abstract key, so it must use JAX operations on the key only. Its output
        may be any Equinox module or pytree; whatever differs between layers must be an array
        leaf.
    - `keys`: one key per layer: a typed key array of shape `(L,)` or raw `uint32` keys of shape
        `(L, 2)` (for the default Threefry implementation).
    - `dtype`: `None` keeps the dtypes `make_layer` produces; a floating dtype (such as
        `jnp.bfloat16`) casts every floating leaf; a rule chooses per floating leaf: a ready-made
        one such as `eqx_lean.dtypes.for_modules(eqx.nn.LayerNorm, jnp.float32,
        otherwise=jnp.bfloat16)` (see [`eqx_lean.dtypes.for_modules`][]), or a function
        `(path, leaf) -> dtype | None` given each leaf's key path in one layer and its
        per-layer `ShapeDtypeStruct` (see
        [paths](../getting-started.md#paths-in-rules-and-name-functions)).
        [`eqx_lean.memory.describe`][] shows what every leaf gets. Integer, boolean, complex and
        key leaves are never cast.
    - `sharding`: how each leaf of one layer is sharded (the layer axis is always replicated,
        so that `lax.scan` can slice it): `None`, JAX's default placement (replicated over the
        mesh of `mesh=` or `jax.set_mesh`, as JAX places an array created under
        `jax.set_mesh`; else the default device); one `Sharding` or
        `PartitionSpec` for every leaf; a pytree prefix of the layer with `Sharding`s,
        `PartitionSpec`s or `None`s; or a rule `(path, leaf) -> Sharding | PartitionSpec | None`
        given each leaf's key path and per-layer `ShapeDtypeStruct`, such as
        [`eqx_lean.fsdp`][]. A `None` beside `NamedSharding`s replicates that leaf over their
        mesh. Buffers are allocated directly sharded and each layer is built sharded, so no
        device holds more than its shards of the stack plus its shard of one layer. Meshes with
        `Auto` or `Explicit` axes both work; with `Explicit` axes, call `build_stacked` inside
        an outer `jax.jit` only within `jax.set_mesh(mesh)`, as JAX requires. `sharding=` has
        this meaning in every function of eqx_lean that takes it.
    - `mesh`: the `jax.sharding.Mesh` that `PartitionSpec`s in `sharding` refer to (default:
        the mesh set by `jax.set_mesh`, if any).
    - `progress`: show a tqdm progress bar over the layers (needs `tqdm`).

    **Returns:**

    A layer of the same type as `make_layer`'s output, each array leaf stacked on a new leading
    axis of length `L`, static fields intact.
    """
    plan = _core.plan_build(make_layer, keys, dtype, sharding, mesh)
    if any(s is not None for s in plan.shardings):
        layout = plan.layout
        check_layer_shardings(
            layout.combine(layout.structs), dict(zip(layout.paths, plan.shardings, strict=True))
        )
    if _core.is_traced(plan, keys):
        return plan.layout.combine(_core.build_in_trace(plan, keys))

    # Compiling before the buffers exist keeps the compiler's own transient memory from
    # stacking on top of the final model in the peak.
    writes = _core.compile_writes(plan)
    _platform.release_freed_host_memory(_platform.Tricks.for_platform(plan.platform))
    buffers = list(_core.allocate(plan.structs, plan.stacked_shardings()))
    try:
        runs = _runs(plan.num_layers, _core.layers_per_call(plan), progress)
        _core.run_writes(plan, buffers, keys, writes, runs)
    except BaseException:
        _core.delete_arrays(buffers)
        raise
    return plan.layout.combine(buffers)


def _first_difference(a: Any, b: Any) -> str:
    """Where two layers' structures or static parts first differ, as a sentence."""
    a_leaves = jax.tree_util.tree_flatten_with_path(a, is_leaf=_core.is_array_like)[0]
    b_leaves = jax.tree_util.tree_flatten_with_path(b, is_leaf=_core.is_array_like)[0]
    a_paths = [p for p, _ in a_leaves]
    b_paths = [p for p, _ in b_leaves]
    for path in a_paths:
        if path not in b_paths:
            return f"it has no leaf at {jax.tree_util.keystr(path)}"
    for path in b_paths:
        if path not in a_paths:
            return f"it has an extra leaf at {jax.tree_util.keystr(path)}"
    for (path, x), (_, y) in zip(a_leaves, b_leaves, strict=True):
        if _core.is_array_like(x) != _core.is_array_like(y):
            kinds = [("an array" if _core.is_array_like(v) else repr(v)) for v in (x, y)]
            return (
                f"at {jax.tree_util.keystr(path)} it has {kinds[1]} where the first has {kinds[0]}"
            )
        if not _core.is_array_like(x) and not _same(x, y):
            return f"at {jax.tree_util.keystr(path)} it has {y!r} where the first has {x!r}"
    return (
        f"their pytree nodes differ ({jax.tree.structure(a, is_leaf=_core.is_array_like)} versus "
        f"{jax.tree.structure(b, is_leaf=_core.is_array_like)})"
    )


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def _check_same_layout(layers: Sequence[Any], layouts: Sequence[_core.Layout]) -> None:
    first = layouts[0]
    for i, (layer, layout) in enumerate(zip(layers, layouts, strict=True)):
        structure_differs = layout.treedef != first.treedef or not _same_static(layout, first)
        if structure_differs:
            raise ValueError(
                f"`layers` must all have the same structure and static parts, but `layers[{i}]` "
                f"differs from `layers[0]`: {_first_difference(layers[0], layer)}."
            )
        for path, a, b in zip(layout.paths, layout.structs, first.structs, strict=True):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"`layers` must have leaves of equal shape and dtype, but leaf "
                    f"{jax.tree_util.keystr(path)} of `layers[{i}]` is {a.dtype}{list(a.shape)} "
                    f"while `layers[0]` has {b.dtype}{list(b.shape)}."
                )


def _same_static(a: _core.Layout, b: _core.Layout) -> bool:
    a_leaves = jax.tree.leaves(a.static)
    b_leaves = jax.tree.leaves(b.static)
    if jax.tree.structure(a.static) != jax.tree.structure(b.static):
        return False
    return all(_same(x, y) for x, y in zip(a_leaves, b_leaves, strict=True))


def stack(layers: Sequence[M], dtype: DtypePolicy = None, *, consume: bool = False) -> M:
    """Stacks existing layers on a new leading axis without doubling memory.

    Unlike `jax.tree.map(lambda *xs: jnp.stack(xs), *layers)`, each stacked leaf is allocated in
    its target dtype and filled slice by slice, one leaf at a time. With `consume=True` every
    source array is deleted as soon as it has been copied, so the peak is about the size of the
    layers plus the largest stacked leaf rather than twice the model.

    **Arguments:**

    - `layers`: a non-empty sequence of layers with the same structure, static parts, and leaf
        shapes and dtypes.
    - `dtype`: as for [`eqx_lean.build_stacked`][], rules given paths relative to one layer.
    - `consume`: delete the source arrays as they are copied. The arrays in `layers` (and any
        other reference to them) are unusable afterwards.

    **Returns:**

    One layer whose array leaves are stacked on a new leading axis of length `len(layers)`.
    """
    if isinstance(layers, eqx.Module) or not isinstance(layers, Sequence) or len(layers) == 0:
        raise ValueError("`layers` must be a non-empty list or tuple of layers.")
    dtype = _core.check_dtype_policy(dtype)
    layouts = [_core.Layout.of(layer) for layer in layers]
    _check_same_layout(layers, layouts)
    layout = layouts[0]
    structs = _core.stacked_structs(layout, len(layers), dtype)
    sources = [jax.tree.leaves(eqx.filter(layer, eqx.is_array)) for layer in layers]
    last_use = {id(x): (i, j) for i, leaves in enumerate(sources) for j, x in enumerate(leaves)}

    stacked = []
    for j, struct in enumerate(structs):
        buffer = _core.allocate((struct,), (None,))[0]
        for i, leaves in enumerate(sources):
            buffer = _core.write_layer(buffer, leaves[j], i)
            if consume and last_use[id(leaves[j])] == (i, j):
                _core.delete_arrays([leaves[j]])
        stacked.append(buffer)
    return layout.combine(stacked)


def write_layer(stacked: M, layer: Any, index: int) -> M:
    """Writes one layer into stacked layers in place: `stacked` with layer `index` replaced.

    Every array leaf of `stacked` (leading axis: the layer) is donated and updated in place by
    a compiled write of its own, so the update holds no second copy of the stack, only the
    layer's values. Each value is cast to its leaf's dtype as it is written: the result is
    bitwise `value.astype(dtype)` in every floating dtype. On CPU, floating rows are moved as
    unsigned-integer bits (XLA:CPU updates bfloat16 in place several times slower than
    `uint16`); on other platforms they are written as they are.

    ```python
    blocks = eqx_lean.allocate_stacked(abstract_block, 32, jnp.bfloat16)
    for i in range(32):
        blocks = eqx_lean.write_layer(blocks, block_from_my_files(i), i)
    ```

    **Arguments:**

    - `stacked`: a pytree (a stacked module, or one stacked array) whose array leaves share a
        leading layer axis. Its arrays are consumed: neither `stacked` nor anything sharing its
        buffers may be used afterwards.
    - `layer`: one layer's values with the structure of `stacked`'s array leaves (a module of
        the same type, or an array for an array), each of shape `leaf.shape[1:]`, in any dtype;
        `None` in place of a leaf leaves that leaf unchanged (and not donated).
    - `index`: the layer to write, a Python int with `0 <= index < L`.

    **Returns:**

    The updated stack: the same structure, dtypes and shardings as `stacked`.
    """
    if not isinstance(index, int) or isinstance(index, bool):
        raise TypeError(f"`index` must be a Python int; got {type(index).__name__}.")
    dynamic, static = eqx.partition(stacked, eqx.is_array)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(dynamic)
    if not paths_leaves:
        raise ValueError("`stacked` must hold at least one array; it holds none.")
    try:
        values = treedef.flatten_up_to(eqx.filter(layer, eqx.is_array_like))
    except (ValueError, TypeError) as e:
        raise ValueError(
            "`layer` must have the structure of `stacked`'s array leaves (one layer of it, "
            f"with `None` for a leaf left unchanged); they differ: {e}"
        ) from None
    checked = []
    for (path, buffer), value in zip(paths_leaves, values, strict=True):
        name = jax.tree_util.keystr(path) or "`stacked`"
        if buffer.ndim == 0:
            raise ValueError(f"leaf {name} of `stacked` must have a leading layer axis.")
        if not 0 <= index < buffer.shape[0]:
            raise IndexError(
                f"`index` must be in [0, {buffer.shape[0]}) for leaf {name} of "
                f"{buffer.shape[0]} layers; got {index}."
            )
        if value is not None and tuple(jnp.shape(value)) != tuple(buffer.shape[1:]):
            raise ValueError(
                f"`layer`'s leaf {name} must have one layer's shape {list(buffer.shape[1:])}; "
                f"got {list(jnp.shape(value))}."
            )
        checked.append((buffer, value))
    # Checked first, written after: a bad leaf leaves every buffer of `stacked` untouched.
    written = [b if v is None else _core.write_layer(b, v, index) for b, v in checked]
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, written), static)


def layer_at(stacked: M, index: int | Array) -> M:
    """Returns layer `index` of a stacked module.

    **Arguments:**

    - `stacked`: a module whose array leaves share a leading layer axis, such as the output of
        [`eqx_lean.build_stacked`][].
    - `index`: the layer to take; a Python integer (negative counts from the end) or a traced
        integer inside `jax.jit`.

    **Returns:**

    The layer: every array leaf indexed at `index` on its leading axis, static fields intact.
    """
    dynamic, static = eqx.partition(stacked, eqx.is_array)
    num_layers = _core.num_layers_of_stack(dynamic)
    if isinstance(index, int | np.integer) and not -num_layers <= index < num_layers:
        raise IndexError(f"`index` must be in [{-num_layers}, {num_layers}); got {index}.")
    return _layer(dynamic, static, index)


def _layer(dynamic: Any, static: Any, index: int | Array) -> Any:
    return eqx.combine(jax.tree.map(lambda x: x[index], dynamic), static)


def unstack(stacked: M) -> list[M]:
    """Splits a stacked module into its layers; the inverse of [`eqx_lean.stack`][].

    **Arguments:**

    - `stacked`: a module whose array leaves share a leading layer axis.

    **Returns:**

    A list of `L` layers, layer `i` holding slice `i` of every array leaf.
    """
    dynamic, static = eqx.partition(stacked, eqx.is_array)
    return [_layer(dynamic, static, i) for i in range(_core.num_layers_of_stack(dynamic))]
