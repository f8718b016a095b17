"""Loading: checkpoint tensors streamed into preallocated (and possibly sharded) buffers."""

import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array

from .._core import (
    DtypePolicy,
    KeyPath,
    LayerAxis,
    Layout,
    ShardingPolicy,
    allocate,
    check_dtype_policy,
    check_layer_axis,
    compile_row_writes,
    current_mesh,
    delete_arrays,
    is_floating,
    per_layer_sharding,
    resolve_dtypes,
    resolve_shardings,
    stacked_shardings,
    write_layer,
    write_rows,
)
from .names import (
    LAYER,
    TensorName,
    check_transpose_rank,
    layer_count,
    require_all_stacked,
    resolve_names,
)
from .safetensors import ALIGN, Checkpoint, Maps, Tensor, open_checkpoint


M = TypeVar("M")

_CHUNK_BYTES = 64 * 2**20  # rows of a plain (non-stacked) tensor are copied in pieces this big


class _LoadLeaf(NamedTuple):
    path: KeyPath
    target: jax.ShapeDtypeStruct  # the loaded leaf: full shape, target dtype
    name: TensorName | None  # None: not stored, `source` is returned as is
    source: Any
    sharding: jax.sharding.Sharding | None


def _describe_leaf(leaf: _LoadLeaf) -> str:
    return jax.tree_util.keystr(leaf.path)


def _resolve_shardings(
    sharding: Any,
    mesh: Any,
    layer_axis: Any,
    layout: Layout,
    tensor_names: Sequence[TensorName | None],
    num_layers: int | None,
) -> list[jax.sharding.Sharding | None]:
    """Each leaf's full sharding: `sharding` per layer (stacked leaves) or per tensor (plain).

    The one meaning of `sharding=` (see `eqx_lean._core.policy`): for a leaf named with `{i}` it
    is one layer's sharding, the layer axis replicated unless `layer_axis` names mesh axes; for
    any other leaf, the whole tensor's. Without `sharding`, shardings that `like`'s
    `ShapeDtypeStruct`s carry are used, and must replicate the layer axis.
    """
    stacked = [name is not None and name.stacked for name in tensor_names]
    seen = tuple(
        jax.ShapeDtypeStruct(s.shape[1:] if is_stacked else s.shape, s.dtype)
        for s, is_stacked in zip(layout.structs, stacked, strict=True)
    )
    if sharding is None:
        carried = [getattr(s, "sharding", None) for s in layout.structs]
        per_leaf = tuple(
            per_layer_sharding(path, s, "like") if is_stacked else s
            for path, s, is_stacked in zip(layout.paths, carried, stacked, strict=True)
        )
        if any(s is not None for s in per_leaf):
            sharding = jax.tree.unflatten(layout.treedef, list(per_leaf))
    shardings = resolve_shardings(
        sharding, mesh, layout.paths, seen, layout.treedef, per_layer=stacked
    )
    mesh = current_mesh(mesh) or next(
        (s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding)), None
    )
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


def _targets(
    layout: Layout, tensor_names: Sequence[TensorName | None], dtype: DtypePolicy
) -> list[jax.ShapeDtypeStruct]:
    # A dtype rule sees one layer of a stacked leaf, as in `build_stacked`, and rules by module
    # type are resolved against `like`.
    seen = [
        jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
        if name is not None and name.stacked
        else leaf
        for leaf, name in zip(layout.structs, tensor_names, strict=True)
    ]
    chosen = resolve_dtypes(dtype, layout.combine(layout.structs), layout.paths, seen)
    return [
        jax.ShapeDtypeStruct(leaf.shape, target)
        for leaf, (target, _) in zip(layout.structs, chosen, strict=True)
    ]


def _plan_leaves(
    like: Any, names: Any, dtype: DtypePolicy, sharding: Any, mesh: Any, layer_axis: Any, fn: str
) -> tuple[Layout, list[_LoadLeaf], int | None]:
    layout = Layout.of(like)
    tensor_names = resolve_names(names, layout, fn)
    if fn == "load_stacked":
        require_all_stacked(layout, tensor_names, fn)
    num_layers = layer_count(layout, tensor_names)
    shardings = _resolve_shardings(sharding, mesh, layer_axis, layout, tensor_names, num_layers)
    concrete = {
        path: x
        for path, x in jax.tree_util.tree_flatten_with_path(eqx.filter(like, eqx.is_array))[0]
    }
    targets = _targets(layout, tensor_names, dtype)
    leaves = []
    for path, leaf, name, leaf_sharding, target in zip(
        layout.paths, layout.structs, tensor_names, shardings, targets, strict=True
    ):
        if name is None and path not in concrete:
            raise ValueError(
                f"`names` gives no tensor for leaf {jax.tree_util.keystr(path)}, so it is not "
                "loaded and must be kept from `like`, but `like` holds only its shape there. "
                "Name its tensor, or pass the array itself in `like`."
            )
        if name is not None:
            check_transpose_rank(path, name, leaf.shape[1:] if name.stacked else leaf.shape)
        leaves.append(_LoadLeaf(path, target, name, concrete.get(path), leaf_sharding))
    return layout, leaves, num_layers


def _tensor_problems(
    leaf: _LoadLeaf, checkpoint: Checkpoint, num_layers: int | None
) -> tuple[list[str], list[str]]:
    """The missing tensor names and the mismatch messages for one leaf."""
    assert leaf.name is not None
    stacked = leaf.name.stacked
    per_layer_shape = leaf.target.shape[1:] if stacked else leaf.target.shape
    expected_shape = leaf.name.stored_shape(per_layer_shape)
    layers: Sequence[int | None] = range(num_layers or 0) if stacked else [None]
    missing, mismatched = [], []
    for layer in layers:
        tensor_name = leaf.name.at(layer)
        tensor = checkpoint.tensors.get(tensor_name)
        if tensor is None:
            missing.append(tensor_name)
            continue
        where = f"Tensor {tensor_name!r} (for leaf {_describe_leaf(leaf)}) in {tensor.file}"
        if tensor.shape != expected_shape:
            transposed = f", stored transposed by {leaf.name.transpose}" * bool(leaf.name.transpose)
            mismatched.append(
                f"{where} has shape {list(tensor.shape)}; expected {list(expected_shape)} "
                f"(the leaf's shape{' per layer' if stacked else ''}{transposed})."
            )
        target = leaf.target.dtype
        if is_floating(target) and not is_floating(tensor.dtype):
            mismatched.append(
                f"{where} has dtype {tensor.dtype}; expected a floating dtype, cast to {target}."
            )
        elif not is_floating(target) and tensor.dtype != target:
            mismatched.append(
                f"{where} has dtype {tensor.dtype}; expected {target} (only floating tensors are "
                "cast)."
            )
    return missing, mismatched


def _check_tensors(leaves: Sequence[_LoadLeaf], checkpoint: Checkpoint, num_layers: int | None):
    missing, mismatched = [], []
    for leaf in leaves:
        if leaf.name is not None:
            m, mm = _tensor_problems(leaf, checkpoint, num_layers)
            missing += m
            mismatched += mm
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise KeyError(
            f"The checkpoint ({checkpoint.describe()}) must hold every tensor that `names` "
            f"refers to, but {len(missing)} are missing: {shown}{more}."
        )
    if mismatched:
        more = f" ({len(mismatched) - 1} more mismatches follow it)" if len(mismatched) > 1 else ""
        raise ValueError(mismatched[0] + more)


class _Shard(NamedTuple):
    device: Any  # a `jax.Device`; None: the default device, uncommitted (no sharding asked for)
    region: tuple[slice, ...]  # of the full (stacked) leaf, with explicit bounds


def _shards_of(leaf: _LoadLeaf) -> list[_Shard]:
    shape = leaf.target.shape
    if leaf.sharding is None:
        return [_Shard(None, tuple(slice(0, n) for n in shape))]
    indices = leaf.sharding.addressable_devices_indices_map(shape)
    return [_Shard(device, bounded(index, shape)) for device, index in indices.items()]


def bounded(index: Any, shape: tuple[int, ...]) -> tuple[slice, ...]:
    index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def _shard_struct(target: jax.ShapeDtypeStruct, shard: _Shard) -> jax.ShapeDtypeStruct:
    shape = tuple(s.stop - s.start for s in shard.region)
    return _struct_on(shape, target.dtype, shard.device)


def _struct_on(shape: tuple[int, ...], dtype: Any, device: Any) -> jax.ShapeDtypeStruct:
    sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


@functools.cache
def _zeros_on(device: Any) -> Callable[[tuple[jax.ShapeDtypeStruct, ...]], tuple[Array, ...]]:
    def zeros(structs: tuple[jax.ShapeDtypeStruct, ...]) -> tuple[Array, ...]:
        return tuple(jnp.zeros(x.shape, x.dtype) for x in structs)

    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(zeros, static_argnums=0, out_shardings=sharding)


def _allocate_shards(
    targets: Mapping[int, jax.ShapeDtypeStruct], shards: Mapping[int, Sequence[_Shard]]
) -> dict[int, list[Array]]:
    """Zero-filled buffers for every shard, made by one computation per device."""
    by_device: dict[Any, list[tuple[int, int]]] = {}
    for j in targets:
        for s, shard in enumerate(shards[j]):
            by_device.setdefault(shard.device, []).append((j, s))
    buffers: dict[int, list[Any]] = {j: [None] * len(shards[j]) for j in targets}
    for device, where in by_device.items():
        structs = tuple(
            jax.ShapeDtypeStruct(
                tuple(r.stop - r.start for r in shards[j][s].region), targets[j].dtype
            )
            for j, s in where
        )
        if device is None:
            made = allocate(structs, (None,) * len(structs))
        else:
            made = _zeros_on(device)(structs)
        for (j, s), buffer in zip(where, made, strict=True):
            buffers[j][s] = buffer
    return buffers


def _row_pieces(shard: _Shard, itemsize: int) -> list[slice]:
    """Rows of a plain leaf's shard, in pieces of at most `_CHUNK_BYTES` (stored dtype)."""
    rows, rest = shard.region[0], shard.region[1:]
    row_bytes = max(1, math.prod(s.stop - s.start for s in rest) * itemsize)
    step = max(1, _CHUNK_BYTES // row_bytes)
    return [slice(a, min(a + step, rows.stop)) for a in range(rows.start, rows.stop, step)]


def _write_signatures(leaf: _LoadLeaf, shard: _Shard, stored: np.dtype) -> set[tuple[Any, ...]]:
    """The compiled writes that filling `shard` of `leaf` calls: (function, buffer, value)."""
    assert leaf.name is not None
    buffer = _shard_struct(leaf.target, shard)
    if leaf.name.stacked:
        return {(buffer, _struct_on(buffer.shape[1:], stored, shard.device), True)}
    if not shard.region:  # a scalar: cast and placed without a compiled write
        return set()
    rest = buffer.shape[1:]
    return {
        (buffer, _struct_on((p.stop - p.start, *rest), stored, shard.device), False)
        for p in _row_pieces(shard, stored.itemsize)
    }


def _host_slice(stored: np.ndarray, name: TensorName, index: tuple[slice, ...]) -> np.ndarray:
    """The part `index` (in the leaf's axis order) of a stored tensor, as a view when possible."""
    view = stored if name.transpose is None else stored.transpose(name.transpose)
    # A layer of a stacked scalar leaf indexes to a NumPy scalar, which is not an array.
    return np.asarray(view[index])


def _put(value: np.ndarray, device: Any) -> Array:
    platform = jax.default_backend() if device is None else device.platform
    if platform == "cpu" and not _is_aligned(value):
        # JAX on CPU uses a contiguous, 64-byte aligned host array in place (so every tensor that
        # `save_stacked` writes is read straight from the page cache); anything else it copies,
        # several times slower than NumPy copies into an aligned array.
        value = _aligned_copy(value)
    return jax.device_put(value, device)


def _is_aligned(value: np.ndarray) -> bool:
    return value.flags.c_contiguous and value.ctypes.data % ALIGN == 0


def _aligned_copy(value: np.ndarray) -> np.ndarray:
    raw = np.empty(value.nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    aligned = raw[start : start + value.nbytes].view(value.dtype).reshape(value.shape)
    np.copyto(aligned, value)
    return aligned


def _fill_plain(leaf: _LoadLeaf, shard: _Shard, buffer: Array, stored: np.ndarray) -> Array:
    assert leaf.name is not None
    if not shard.region:  # a scalar
        value = jnp.asarray(_host_slice(stored, leaf.name, ()))
        return jax.device_put(value.astype(leaf.target.dtype), shard.device)
    for piece in _row_pieces(shard, stored.dtype.itemsize):
        value = _put(_host_slice(stored, leaf.name, (piece, *shard.region[1:])), shard.device)
        buffer = write_rows(buffer, value, piece.start - shard.region[0].start)
        buffer.block_until_ready()
    return buffer


def _fill_layer(
    leaf: _LoadLeaf, shard: _Shard, buffer: Array, stored: np.ndarray, layer: int
) -> Array:
    assert leaf.name is not None
    value = _put(_host_slice(stored, leaf.name, shard.region[1:]), shard.device)
    buffer = write_layer(buffer, value, layer - shard.region[0].start)
    # One write in flight at a time: queued writes would each hold their input alive.
    buffer.block_until_ready()
    return buffer


def _fill_tensor(
    leaf: _LoadLeaf,
    shards: Sequence[_Shard],
    buffers: list[Array],
    tensor: Tensor,
    maps: Maps,
    layer: int | None,
) -> None:
    """Copies one stored tensor (a whole plain leaf, or one layer) into every shard needing it."""
    stored = maps.view(tensor)
    for s, shard in enumerate(shards):
        if layer is None:
            buffers[s] = _fill_plain(leaf, shard, buffers[s], stored)
        elif shard.region[0].start <= layer < shard.region[0].stop:
            buffers[s] = _fill_layer(leaf, shard, buffers[s], stored, layer)
    del stored
    maps.release(tensor)


def _assemble(leaf: _LoadLeaf, buffers: list[Array]) -> Array:
    if leaf.sharding is None:
        return buffers[0]
    return jax.make_array_from_single_device_arrays(leaf.target.shape, leaf.sharding, buffers)


def _load_into(
    leaves: Sequence[_LoadLeaf], checkpoint: Checkpoint, num_layers: int | None, maps: Maps
) -> list[Any]:
    named = {j: leaf.name for j, leaf in enumerate(leaves) if leaf.name is not None}
    shards = {j: _shards_of(leaves[j]) for j in named}
    compile_row_writes(
        {
            signature
            for j, name in named.items()
            for shard in shards[j]
            for signature in _write_signatures(
                leaves[j], shard, checkpoint.tensors[name.at(0 if name.stacked else None)].dtype
            )
        }
    )
    buffers = _allocate_shards({j: leaves[j].target for j in named}, shards)
    try:
        for j, name in named.items():
            if not name.stacked:
                tensor = checkpoint.tensors[name.at(None)]
                _fill_tensor(leaves[j], shards[j], buffers[j], tensor, maps, None)
        # Layer by layer, in the order the files hold them.
        for layer in range(num_layers or 0):
            for j, name in named.items():
                if name.stacked:
                    tensor = checkpoint.tensors[name.at(layer)]
                    _fill_tensor(leaves[j], shards[j], buffers[j], tensor, maps, layer)
    except BaseException:
        delete_arrays([b for bs in buffers.values() for b in bs])
        raise
    return [
        _assemble(leaf, buffers[j]) if j in named else leaf.source for j, leaf in enumerate(leaves)
    ]


def _load(
    path: Any,
    like: Any,
    names: Any,
    dtype: DtypePolicy,
    sharding: Any,
    mesh: Any,
    layer_axis: Any,
    fn: str,
) -> Any:
    dtype = check_dtype_policy(dtype)
    layout, leaves, num_layers = _plan_leaves(like, names, dtype, sharding, mesh, layer_axis, fn)
    checkpoint = open_checkpoint(path)
    _check_tensors(leaves, checkpoint, num_layers)
    maps = Maps()
    try:
        loaded = _load_into(leaves, checkpoint, num_layers, maps)
    finally:
        maps.close()
    return layout.combine(loaded)


def load_tensors(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    like: M,
    names: Any,
    *,
    dtype: DtypePolicy = None,
    sharding: ShardingPolicy = None,
    mesh: Mesh | None = None,
    layer_axis: LayerAxis = None,
) -> M:
    """Loads a model from safetensors files, straight into its final buffers.

    Like [`eqx_lean.load_stacked`][], but for any model: a leaf whose name contains `{i}` is
    stacked (its leading axis is the layer axis, one tensor per layer), any other name is one
    tensor holding the whole leaf (an embedding, a final norm, a head). So a whole Hugging Face
    checkpoint loads in one call:

    ```python
    HF = {".embed.weight": "model.embed_tokens.weight", ".norm.weight": "model.norm.weight",
          ".head.weight": "lm_head.weight", ".blocks.attn.q.weight":
          "model.layers.{i}.self_attn.q_proj.weight", ...}
    like = eqx.filter_eval_shape(Mistral, config, key=jax.random.key(0))
    model = eqx_lean.load_tensors(
        "Mistral-7B-v0.1/", like, lambda path, _: HF[jax.tree_util.keystr(path)],
        dtype=jnp.bfloat16,
    )
    ```

    Plain tensors are copied in pieces of at most 64 MiB (in the stored dtype), so a large
    embedding stored in float32 never exists on the device in float32 as a whole.

    **Arguments:** as for [`eqx_lean.load_stacked`][]; `like` is the whole model, and `names`
    may mix templates with `{i}` and plain names. Paths given to `names`, `dtype` and `sharding`
    rules are the whole model's (such as `.blocks.mlp.weight`): a name map written for
    `load_stacked` needs its prefix (see
    [paths](../getting-started.md#paths-in-rules-and-name-functions)). `sharding` has its one
    meaning: for a leaf named with `{i}` it is one layer's sharding (the layer axis is
    replicated, unless `layer_axis` names mesh axes for it); for a plain leaf it is the whole
    tensor's. A rule `(path, leaf)` sees one layer's `ShapeDtypeStruct` for the first and the
    tensor's for the second.

    **Returns:**

    The model with the structure of `like`, its array leaves loaded.
    """
    return _load(path, like, names, dtype, sharding, mesh, layer_axis, "load_tensors")


def load_stacked(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    like: M,
    names: Any,
    *,
    dtype: DtypePolicy = None,
    sharding: ShardingPolicy = None,
    mesh: Mesh | None = None,
    layer_axis: LayerAxis = None,
) -> M:
    """Loads stacked layers from safetensors files that store one tensor per layer.

    Every stacked buffer is allocated once, in its target dtype (no random initialisation), and
    filled one layer at a time by a compiled write that donates the buffer, casting on the
    way. Each layer's tensor is read from a read-only memory map of the file, so its pages are
    page cache rather than a private copy: the process holds the loaded model plus one tensor,
    never a second copy of the stack and never a float32 copy of a bfloat16 model.

    Every file header, tensor name, shape and dtype is checked before anything is allocated, so a
    bad checkpoint fails with a clear message and writes nothing. Pickle checkpoints (`.bin`,
    `.pt`) are refused: they can run code when loaded.

    ```python
    like = eqx.filter_eval_shape(eqx_lean.build_stacked, make_block, keys, jnp.bfloat16)
    names = lambda path, _: "model.layers.{i}." + HF_BLOCK[jax.tree_util.keystr(path)]
    blocks = eqx_lean.load_stacked("Mistral-7B-v0.1/", like, names)
    ```

    **Arguments:**

    - `path`: a directory holding `model.safetensors.index.json` (as Hugging Face writes
        sharded checkpoints) or `*.safetensors` files, one safetensors file, a list of them, or
        an index file.
    - `like`: the stacked model to load into; its array leaves may be `jax.ShapeDtypeStruct`s
        (for example from `eqx.filter_eval_shape(eqx_lean.build_stacked, ...)`) or arrays, of
        which only the shape and dtype are used (they are never modified). Non-array leaves and
        static fields are kept.
    - `names`: the tensor name of every array leaf, for one layer: a pytree of the structure of
        `like` (built with `eqx.tree_at`, say) whose leaves are templates such as
        `"model.layers.{i}.mlp.up_proj.weight"` or [`eqx_lean.TensorName`][]s (with a
        transpose), or a function `(path, leaf) -> name` given each leaf's key path relative to
        `like` (one layer's paths, such as `.mlp.weight`; see
        [paths](../getting-started.md#paths-in-rules-and-name-functions)) and the leaf as it is
        in `like`. Every name must contain `{i}`, the layer index. A leaf named `None` is not
        loaded: `like` must hold its array, which is returned as is.
    - `dtype`: the dtype to store each floating leaf in: `None` keeps the dtypes of `like`; a
        floating dtype casts every floating leaf; a rule chooses per leaf, as for
        [`eqx_lean.build_stacked`][] (resolved against `like`; a function is given one layer's
        `ShapeDtypeStruct`). Tensors are cast from whatever
        floating dtype the file has; integer and boolean tensors must match exactly.
    - `sharding`: how each leaf of one layer is sharded, exactly as for
        [`eqx_lean.build_stacked`][]: `None`, one `Sharding` or `PartitionSpec`, a pytree prefix
        of the layer, or a rule `(path, leaf) -> sharding` such as [`eqx_lean.fsdp`][]; the
        layer axis is replicated. (Before eqx_lean 0.2.0 it was the sharding of the whole
        stacked leaf: a spec with one more entry than a layer's leaf has dimensions is now an
        error that says so.) With `sharding=None`, shardings carried by the
        `ShapeDtypeStruct`s of `like` are used; they must replicate the layer axis. Each device
        reads and receives only its own slice of each layer.
    - `mesh`: the `jax.sharding.Mesh` that `PartitionSpec`s refer to (default: the mesh set
        by `jax.set_mesh`, if any).
    - `layer_axis`: the mesh axis (or axes) to shard the layer axis itself over, for pipeline
        stages; `None` (the default) replicates it, as `fold` and `scan` expect.

    **Returns:**

    The stacked model, with the structure of `like`.
    """
    return _load(path, like, names, dtype, sharding, mesh, layer_axis, "load_stacked")
