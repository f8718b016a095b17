"""Memory-lean construction of stacked layers: one layer at a time into preallocated buffers."""

import concurrent.futures
import ctypes
import functools
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, Sharding
from jaxtyping import Array, PRNGKeyArray

from . import _threefry
from ._policy import (
    DtypePolicy,
    ShardingPolicy,
    check_dtype_policy,
    has_explicit_axes,
    is_floating,
    leaf_dtype,
    resolve_shardings,
    stacked_sharding,
)


M = TypeVar("M")

_Leaves = tuple[Array, ...]


def _is_array_like(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=getattr(x, "weak_type", False))


class _Layout(NamedTuple):
    """How one layer splits into array leaves (stacked) and everything else (kept as is)."""

    paths: tuple[Any, ...]
    structs: tuple[jax.ShapeDtypeStruct, ...]
    treedef: Any
    static: Any

    @classmethod
    def of(cls, layer: Any) -> "_Layout":
        dynamic, static = eqx.partition(layer, _is_array_like)
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path(dynamic)
        paths = tuple(path for path, _ in path_leaves)
        structs = tuple(_struct(leaf) for _, leaf in path_leaves)
        return cls(paths, structs, treedef, static)

    def combine(self, leaves: Sequence[Any]) -> Any:
        return eqx.combine(jax.tree.unflatten(self.treedef, leaves), self.static)


class _StaticSignature:
    """Hashable stand-in for a layer's non-array part, so traces can check they all agree.

    Equality is by value (falling back to identity for objects that cannot be compared), so the
    compiled writes are reused across `build_stacked` calls that build the same kind of layer.
    """

    def __init__(self, layer: Any):
        self.treedef = jax.tree.structure(layer, is_leaf=_is_array_like)
        self.leaves = tuple(
            None if _is_array_like(x) else x for x in jax.tree.leaves(layer, is_leaf=_is_array_like)
        )

    def __hash__(self) -> int:
        return hash(self.treedef)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _StaticSignature)
            and self.treedef == other.treedef
            and all(_same(a, b) for a, b in zip(self.leaves, other.leaves, strict=True))
        )


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def _static_mismatch_error(expected: _StaticSignature, found: _StaticSignature) -> ValueError:
    return ValueError(
        "`make_layer` must return layers whose static and non-array parts are the same for every "
        "key (whatever differs between layers must be an array leaf), but two calls disagreed: "
        f"{expected.treedef} with non-array leaves {expected.leaves} versus {found.treedef} with "
        f"{found.leaves}. Does `make_layer` depend on Python state that changes between calls?"
    )


def _num_layers_of_keys(keys: Any) -> int:
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


def _abstract_layer(make_layer: Callable[[PRNGKeyArray], M], keys: Any) -> M:
    """One layer as `ShapeDtypeStruct`s, from tracing `make_layer` on an abstract key."""
    key_struct = jax.ShapeDtypeStruct(keys.shape[1:], keys.dtype)
    static_box = []

    def dynamic_part(key):
        dynamic, static = eqx.partition(make_layer(key), eqx.is_array)
        static_box.append(static)
        return dynamic

    try:
        dynamic = jax.eval_shape(dynamic_part, key_struct)
    except Exception as e:
        raise TypeError(
            f"`make_layer` failed when called on a traced key ({type(e).__name__}: {e}). "
            "`make_layer` must be traceable: it is called under `jax.jit` with an abstract key, so "
            "it must build the layer with JAX operations only (no `int(key)`, `np.asarray(key)`, "
            "or Python control flow on the key's values)."
        ) from e
    return eqx.combine(dynamic, static_box[0])


def _target_structs(
    layout: _Layout, num_layers: int, dtype: DtypePolicy
) -> tuple[jax.ShapeDtypeStruct, ...]:
    structs = []
    for path, leaf in zip(layout.paths, layout.structs, strict=True):
        target, weak = leaf_dtype(dtype, path, leaf)
        structs.append(jax.ShapeDtypeStruct((num_layers, *leaf.shape), target, weak_type=weak))
    return tuple(structs)


def _zeros_like_struct(struct: jax.ShapeDtypeStruct) -> Array:
    if struct.weak_type:
        # Python scalars are the one public way to make a weakly typed array.
        zero = jax.dtypes.scalar_type_of(jnp.zeros((), struct.dtype))(0)
        filled = lax.full(struct.shape, zero)
        if filled.dtype == struct.dtype:
            return filled
    return jnp.zeros(struct.shape, struct.dtype)


_Structs = tuple[jax.ShapeDtypeStruct, ...]
_Shardings = tuple[Sharding | None, ...]


@functools.cache
def _zeros(structs: _Structs, shardings: _Shardings) -> Callable[[], _Leaves]:
    # Created under `jit` with its output shardings, each device allocates only its shards.
    return jax.jit(
        lambda: tuple(_zeros_like_struct(s) for s in structs),
        out_shardings=tuple(stacked_sharding(s) for s in shardings),
    )


def _allocate(structs: _Structs, shardings: _Shardings) -> _Leaves:
    """Zero-filled stacked buffers; `shardings` are per layer (the layer axis is replicated)."""
    return _zeros(structs, shardings)()


def _constrain(x: Array, sharding: Sharding | None, *, inside_auto_axes: bool = False) -> Array:
    """Constrains a traced array to `sharding`, whichever kind of mesh axes it names."""
    if sharding is None:
        return x
    if inside_auto_axes and isinstance(sharding, NamedSharding):
        return lax.with_sharding_constraint(x, sharding.spec)
    if has_explicit_axes(sharding):
        return jax.sharding.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)


def _resolve_shardings(layout: _Layout, sharding: ShardingPolicy, mesh: Any) -> _Shardings:
    return resolve_shardings(sharding, mesh, layout.paths, layout.structs, layout.treedef)


def allocate_stacked(
    abstract_layer: M,
    num_layers: int,
    dtype: DtypePolicy = None,
    sharding: ShardingPolicy = None,
    *,
    mesh: Mesh | None = None,
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
    - `dtype`: `None` keeps each leaf's dtype; a floating dtype casts every floating leaf; a
        callable `(path, leaf) -> dtype | None` chooses per floating leaf. Integer, boolean,
        complex and key-typed leaves are never cast.
    - `sharding`: each leaf's sharding within one layer, as for [`eqx_lean.build_stacked`][];
        the layer axis is replicated. Each device allocates only its shards.
    - `mesh`: the mesh that `PartitionSpec`s in `sharding` refer to.

    **Returns:**

    A pytree of the same structure as `abstract_layer`, each array leaf replaced by zeros of shape
    `(num_layers, *leaf.shape)`; non-array leaves and static fields are kept.
    """
    if not isinstance(num_layers, int | np.integer) or num_layers < 1:
        raise ValueError(f"`num_layers` must be a positive integer; got {num_layers!r}.")
    layout = _Layout.of(abstract_layer)
    structs = _target_structs(layout, int(num_layers), check_dtype_policy(dtype))
    return layout.combine(_allocate(structs, _resolve_shardings(layout, sharding, mesh)))


def _leaf_groups(structs: Sequence[jax.ShapeDtypeStruct]) -> tuple[tuple[int, ...], ...]:
    """Groups leaf indices so that no group builds more than the largest leaf does.

    XLA removes whatever a compiled function does not return, so a write that returns one group
    of leaves creates (and draws random numbers for) only those leaves: the group bounds the
    temporaries. Small leaves share a group to keep the number of compiled functions low.
    """
    if not structs:
        return ()
    sizes = [int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in structs]
    budget = max(sizes)
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


def _layer_leaves(
    make_layer: Callable[[PRNGKeyArray], Any], key: Any, signature: _StaticSignature
) -> list[Array]:
    layer = make_layer(key)
    found = _StaticSignature(layer)
    if found != signature:
        raise _static_mismatch_error(signature, found)
    return [jnp.asarray(x) for x in jax.tree.leaves(eqx.filter(layer, eqx.is_array))]


class _Group(NamedTuple):
    """Which leaves one compiled write builds, and their per-layer shardings."""

    leaves: tuple[int, ...]
    shardings: _Shardings


def _write_layer(
    buffers: _Leaves,
    keys: Any,
    index: Any,
    make_layer: Callable[[PRNGKeyArray], Any],
    signature: _StaticSignature,
    group: _Group,
) -> _Leaves:
    explicit = any(has_explicit_axes(s) for s in group.shardings)

    def write(buffers, keys, index):
        leaves = _layer_leaves(make_layer, keys[index], signature)
        return tuple(
            # Constraining the fresh leaf makes each device build only its shard of it.
            _write_slice_traced(buffer, _constrain(leaves[j], s, inside_auto_axes=explicit), index)
            for buffer, j, s in zip(buffers, group.leaves, group.shardings, strict=True)
        )

    if not explicit:
        return write(buffers, keys, index)
    # With Explicit mesh axes, a layer built outside `auto_axes` would be replicated first.
    out_sharding = tuple(stacked_sharding(s) for s in group.shardings)
    write_auto = cast(Any, jax.sharding.auto_axes(write, out_sharding=out_sharding))
    return write_auto(buffers, keys, index)


def _write_slice_traced(buffer: Array, value: Array, index: Any) -> Array:
    """`buffer` with slice `index` of its leading axis set to `value` cast to its dtype."""
    if buffer.weak_type:
        # dynamic_update_slice always returns a strong type; a select of weak operands keeps
        # the weak type (weakly typed leaves are small: scalars broadcast from Python numbers).
        is_slice = lax.broadcasted_iota(jnp.int32, buffer.shape, 0) == index
        return jnp.where(is_slice, value[None], buffer)
    return update_rows(buffer, value[None], index)


def as_bits(x: Array) -> Array:
    """`x` reinterpreted as unsigned integers of the same width (a free bitcast)."""
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def update_rows(buffer: Array, value: Array, start: Any) -> Array:
    """`buffer` with rows `start : start + len(value)` of its leading axis set to `value`, cast."""
    value = value.astype(buffer.dtype)
    if not is_floating(buffer.dtype):
        return lax.dynamic_update_slice_in_dim(buffer, value, start, 0)
    # XLA:CPU updates bfloat16 in place several times slower than unsigned integers of the same
    # width (about 20 % of a fused draw-and-write, 8x of a plain copy), so the update moves bits;
    # the bitcasts are free and keep a donated buffer aliased.
    updated = lax.dynamic_update_slice_in_dim(as_bits(buffer), as_bits(value), start, 0)
    return lax.bitcast_convert_type(updated, buffer.dtype)


def _write_layers(
    buffers: _Leaves,
    keys: Any,
    start: Any,
    stop: Any,
    make_layer: Callable[[PRNGKeyArray], Any],
    signature: _StaticSignature,
    group: _Group,
) -> _Leaves:
    """Writes layers `start, ..., stop - 1` of one group, one after another, in a loop."""

    def body(i: Any, buffers: _Leaves) -> _Leaves:
        return _write_layer(buffers, keys, i, make_layer, signature, group)

    return lax.fori_loop(start, stop, body, buffers)


# The bounds are traced, so each group compiles once whatever the number of layers per call.
# Loop-invariant code motion would hoist the layer's loop-invariant values (Threefry's counters,
# as large as the leaf) out of the loop and materialise them: with the draws fused, 28 MiB
# instead of 2 KiB for the default bench's MLP writes, 448 MiB instead of 1 KiB for Mistral-7B's.
_write_layers_donated = jax.jit(
    _write_layers,
    static_argnums=(4, 5, 6),
    donate_argnums=0,
    compiler_options={"xla_disable_hlo_passes": "while-loop-invariant-code-motion"},
)


def _fill_traced(
    buffers: list[Array],
    keys: Any,
    make_layer: Callable[[PRNGKeyArray], Any],
    signature: _StaticSignature,
    groups: tuple[_Group, ...],
) -> None:
    """Fills the buffers with one `fori_loop` per group, for use inside an outer trace."""
    for group in groups:
        filled = _write_layers(
            tuple(buffers[j] for j in group.leaves),
            keys,
            0,
            keys.shape[0],
            make_layer,
            signature,
            group,
        )
        for j, buffer in zip(group.leaves, filled, strict=True):
            buffers[j] = buffer


def _fill_eager(
    buffers: list[Array],
    keys: Any,
    writes: Sequence[jax.stages.Compiled],
    groups: tuple[_Group, ...],
    layers: Iterator[int],
    layers_per_call: int,
) -> None:
    """Fills the buffers by calling each group's compiled, donating write on runs of layers.

    A call allocates its temporaries once for all the layers it writes. Each call's
    temporaries are fresh pages that the kernel must zero, so writing a run of small layers per
    call instead of one saves that system time (about a fifth of the build on XLA:CPU).
    """
    while run := list(itertools.islice(layers, layers_per_call)):
        start, stop = run[0], run[-1] + 1
        for group, write in zip(groups, writes, strict=True):
            filled = write(tuple(buffers[j] for j in group.leaves), keys, start, stop)
            for j, buffer in zip(group.leaves, filled, strict=True):
                buffers[j] = buffer
            # Dispatch is asynchronous and the groups are independent: without waiting, several
            # writes run at once and their temporaries add up.
            jax.block_until_ready(filled)
            release_freed_host_memory()


# Runs of layers are cut so that one call writes about this many bytes of the stack.
_BYTES_PER_CALL = 256 * 2**20


def _layers_per_call(plan: "_Plan", num_layers: int) -> int:
    stack_bytes = sum(s.size * np.dtype(s.dtype).itemsize for s in plan.structs)
    return max(1, min(num_layers, _BYTES_PER_CALL * num_layers // max(stack_bytes, 1)))


class _Plan(NamedTuple):
    """Everything `build_stacked` derives from its arguments before it allocates."""

    layout: _Layout
    signature: _StaticSignature
    structs: _Structs
    shardings: _Shardings
    groups: tuple[_Group, ...]

    @classmethod
    def make(
        cls,
        make_layer: Callable[[PRNGKeyArray], Any],
        keys: Any,
        dtype: DtypePolicy,
        sharding: ShardingPolicy,
        mesh: Mesh | None,
    ) -> "_Plan":
        num_layers = _num_layers_of_keys(keys)
        dtype = check_dtype_policy(dtype)
        abstract = _abstract_layer(make_layer, keys)
        layout = _Layout.of(abstract)
        shardings = _resolve_shardings(layout, sharding, mesh)
        groups = tuple(
            _Group(leaves, tuple(shardings[j] for j in leaves))
            for leaves in _leaf_groups(layout.structs)
        )
        structs = _target_structs(layout, num_layers, dtype)
        return cls(layout, _StaticSignature(abstract), structs, shardings, groups)

    def buffer_structs(self, group: _Group) -> _Structs:
        return tuple(
            jax.ShapeDtypeStruct(
                self.structs[j].shape,
                self.structs[j].dtype,
                weak_type=self.structs[j].weak_type,
                sharding=stacked_sharding(self.shardings[j]),
            )
            for j in group.leaves
        )


def _compile_writes(plan: _Plan, keys: Any, make_layer: Callable[[PRNGKeyArray], Any]) -> list[Any]:
    """Compiles the write of every group (a cache hit when built before) and returns them.

    Threefry is lowered unrolled, so that each draw fuses into the write of its leaf instead of
    materialising the random bits (see `_threefry`).
    """
    index = jax.ShapeDtypeStruct((), jnp.int32, weak_type=True)
    lowered = [
        _threefry.lower(
            _write_layers_donated.trace(
                plan.buffer_structs(group), keys, index, index, make_layer, plan.signature, group
            )
        )
        for group in plan.groups
    ]
    # XLA compiles without the GIL, so the groups' writes compile side by side.
    workers = max(1, min(len(lowered), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda x: x.compile(), lowered))


def write_temp_bytes(
    make_layer: Callable[[PRNGKeyArray], Any],
    keys: PRNGKeyArray,
    dtype: DtypePolicy = None,
    sharding: ShardingPolicy = None,
    *,
    mesh: Mesh | None = None,
) -> list[int]:
    """XLA temporary bytes (per device) of each compiled per-layer write, largest first."""
    plan = _Plan.make(make_layer, keys, dtype, sharding, mesh)
    compiled = _compile_writes(plan, keys, make_layer)
    return sorted((c.memory_analysis().temp_size_in_bytes for c in compiled), reverse=True)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_host_memory() -> None:
    """Returns memory that glibc's allocator holds but no longer uses to the operating system.

    XLA's CPU temporaries are freed after every write, but glibc keeps freed heap chunks (and
    raises its mmap threshold after the first large free), so without this the resident size
    creeps up by one write's temporaries every few layers. A no-op off glibc.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _inside_trace() -> bool:
    try:
        from jax._src.core import trace_state_clean
    except ImportError:  # pragma: no cover - depends on JAX internals
        return False
    return not trace_state_clean()


def _progress(num_layers: int, enabled: bool) -> Iterator[int]:
    if not enabled:
        return iter(range(num_layers))
    try:
        from tqdm.auto import tqdm
    except ImportError as e:
        raise ImportError(
            "`progress=True` needs tqdm: `pip install tqdm` (or `pip install eqx_lean[progress]`)."
        ) from e
    return iter(tqdm(range(num_layers), desc="build_stacked", unit="layer"))


def _delete(arrays: Sequence[Any]) -> None:
    for x in arrays:
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


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
    stacked buffers and updates them in place. The writes lower JAX's Threefry hash unrolled
    (as JAX does on GPU and TPU, not on CPU), so each random draw fuses into the write of its
    rows and needs no temporaries at all; only what cannot fuse (a QR, a reduction over a
    leaf) costs the temporaries of one group of leaves, no larger than the largest leaf.

    ```python
    keys = jax.random.split(jax.random.key(0), 32)
    blocks = eqx_lean.build_stacked(lambda k: Block(config, key=k), keys, jnp.bfloat16)
    ```

    Inside an outer trace (`jax.jit`, `eqx.filter_eval_shape`, ...) the layers are written by a
    `lax.fori_loop`, so the trace holds one copy of `make_layer` whatever `L` is. There the
    outer `jit` lowers the draws, with JAX's own Threefry: on CPU the loops then carry its
    temporaries (96 MiB for four layers of one 16 MiB float32 matrix, against 18 KiB for the
    writes of an eager call).

    **Arguments:**

    - `make_layer`: builds one layer from a key, e.g. `lambda k: eqx.nn.MLP(..., key=k)`. It is
        traced with an abstract key, so it must use JAX operations on the key only. Its output
        may be any Equinox module or pytree; whatever differs between layers must be an array
        leaf, and the static and non-array parts must be the same for every key.
    - `keys`: one key per layer: a typed key array of shape `(L,)` or raw `uint32` keys of shape
        `(L, 2)` (for the default Threefry implementation).
    - `dtype`: `None` keeps the dtypes `make_layer` produces; a floating dtype (such as
        `jnp.bfloat16`) casts every floating leaf; a callable `(path, leaf) -> dtype | None`
        chooses per floating leaf, given its key path and its per-layer `ShapeDtypeStruct` (for
        example, to keep norms in float32). Integer, boolean, complex and key leaves are never
        cast.
    - `sharding`: how each leaf of one layer is sharded (the layer axis is always replicated,
        so that `lax.scan` can slice it): `None` (default placement); one `Sharding` or
        `PartitionSpec` for every leaf; a pytree prefix of the layer with `Sharding`s,
        `PartitionSpec`s or `None`s; or a rule `(path, leaf) -> Sharding | PartitionSpec | None`
        given each leaf's key path and per-layer `ShapeDtypeStruct`, such as
        [`eqx_lean.fsdp`][]. A `None` beside `NamedSharding`s replicates that leaf over their
        mesh. Buffers are allocated directly sharded and each layer is built sharded, so no
        device holds more than its shards of the stack plus its shard of one layer. Meshes with
        `Auto` or `Explicit` axes both work; with `Explicit` axes, call `build_stacked` inside
        an outer `jax.jit` only within `jax.set_mesh(mesh)`, as JAX requires.
    - `mesh`: the `jax.sharding.Mesh` that `PartitionSpec`s in `sharding` refer to.
    - `progress`: show a tqdm progress bar over the layers (needs `tqdm`).

    **Returns:**

    A layer of the same type as `make_layer`'s output, each array leaf stacked on a new leading
    axis of length `L`, static fields intact.
    """
    plan = _Plan.make(make_layer, keys, dtype, sharding, mesh)
    if _inside_trace():
        buffers = [
            _constrain(_zeros_like_struct(struct), stacked_sharding(s))
            for struct, s in zip(plan.structs, plan.shardings, strict=True)
        ]
        _fill_traced(buffers, keys, make_layer, plan.signature, plan.groups)
        return plan.layout.combine(buffers)

    # Compiling before the buffers exist keeps the compiler's own transient memory from
    # stacking on top of the final model in the peak.
    writes = _compile_writes(plan, keys, make_layer)
    release_freed_host_memory()
    buffers = list(_allocate(plan.structs, plan.shardings))
    layers = _progress(len(keys), progress)
    try:
        per_call = _layers_per_call(plan, len(keys))
        _fill_eager(buffers, keys, writes, plan.groups, layers, per_call)
    except BaseException:
        _delete(buffers)
        raise
    return plan.layout.combine(buffers)


def _check_same_layout(layers: Sequence[Any], layouts: Sequence[_Layout]) -> None:
    first_signature = _StaticSignature(layers[0])
    for i, (layer, layout) in enumerate(zip(layers, layouts, strict=True)):
        if _StaticSignature(layer) != first_signature:
            raise ValueError(
                f"`layers` must all have the same structure and static parts, but `layers[{i}]` "
                f"differs from `layers[0]`: {jax.tree.structure(layer)} versus "
                f"{jax.tree.structure(layers[0])}."
            )
        for path, a, b in zip(layout.paths, layout.structs, layouts[0].structs, strict=True):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"`layers` must have leaves of equal shape and dtype, but leaf "
                    f"{jax.tree_util.keystr(path)} of `layers[{i}]` is {a.dtype}{list(a.shape)} "
                    f"while `layers[0]` has {b.dtype}{list(b.shape)}."
                )


_write_slice = jax.jit(_write_slice_traced, donate_argnums=0)


def stack(layers: Sequence[M], dtype: DtypePolicy = None, *, consume: bool = False) -> M:
    """Stacks existing layers on a new leading axis without doubling memory.

    Unlike `jax.tree.map(lambda *xs: jnp.stack(xs), *layers)`, each stacked leaf is allocated in
    its target dtype and filled slice by slice, one leaf at a time. With `consume=True` every
    source array is deleted as soon as it has been copied, so the peak is about the size of the
    layers plus the largest stacked leaf rather than twice the model.

    **Arguments:**

    - `layers`: a non-empty sequence of layers with the same structure, static parts, and leaf
        shapes and dtypes.
    - `dtype`: as for [`eqx_lean.build_stacked`][].
    - `consume`: delete the source arrays as they are copied. The arrays in `layers` (and any
        other reference to them) are unusable afterwards.

    **Returns:**

    One layer whose array leaves are stacked on a new leading axis of length `len(layers)`.
    """
    if isinstance(layers, eqx.Module) or not isinstance(layers, Sequence) or len(layers) == 0:
        raise ValueError("`layers` must be a non-empty list or tuple of layers.")
    dtype = check_dtype_policy(dtype)
    layouts = [_Layout.of(layer) for layer in layers]
    _check_same_layout(layers, layouts)
    layout = layouts[0]
    structs = _target_structs(layout, len(layers), dtype)
    sources = [jax.tree.leaves(eqx.filter(layer, eqx.is_array)) for layer in layers]
    last_use = {id(x): (i, j) for i, leaves in enumerate(sources) for j, x in enumerate(leaves)}

    stacked = []
    for j, struct in enumerate(structs):
        buffer = _allocate((struct,), (None,))[0]
        for i, leaves in enumerate(sources):
            buffer = _write_slice(buffer, leaves[j], i)
            if consume and last_use[id(leaves[j])] == (i, j):
                _delete([leaves[j]])
        stacked.append(buffer)
    return layout.combine(stacked)


def _num_layers_of_stack(dynamic: Any) -> int:
    leaves = jax.tree.leaves(dynamic)
    if not leaves:
        raise ValueError("`stacked` has no array leaves, so it has no layer axis.")
    lengths = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    (length,) = lengths if len(lengths) == 1 else (None,)
    if length is None:
        raise ValueError(
            "`stacked` must have one leading layer axis of the same length on every array leaf; "
            f"found leading axes {sorted(str(n) for n in lengths)}."
        )
    return length


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
    num_layers = _num_layers_of_stack(dynamic)
    if isinstance(index, int | np.integer) and not -num_layers <= index < num_layers:
        raise IndexError(f"`index` must be in [{-num_layers}, {num_layers}); got {index}.")
    return eqx.combine(jax.tree.map(lambda x: x[index], dynamic), static)


def unstack(stacked: M) -> list[M]:
    """Splits a stacked module into its layers; the inverse of [`eqx_lean.stack`][].

    **Arguments:**

    - `stacked`: a module whose array leaves share a leading layer axis.

    **Returns:**

    A list of `L` layers, layer `i` holding slice `i` of every array leaf.
    """
    dynamic, _ = eqx.partition(stacked, eqx.is_array)
    return [layer_at(stacked, i) for i in range(_num_layers_of_stack(dynamic))]
