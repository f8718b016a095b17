"""Streaming checkpoint I/O: models with stacked layers to and from safetensors files.

Files are read through read-only memory maps (their pages are page cache, never a private
copy) and written one tensor at a time, so neither direction holds a second copy of the model.
Tensor names follow a template per leaf, such as Hugging Face's
`"model.layers.{i}.self_attn.q_proj.weight"`, where `{i}` is the layer index.
"""

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import json
import math
import mmap
import os
import shutil
import struct
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from ._build import _allocate, _delete, _Layout, as_bits, update_rows
from ._policy import DtypePolicy, KeyPath, check_dtype_policy, is_floating, leaf_dtype


M = TypeVar("M")

LAYER = "{i}"
"""The placeholder for the layer index in a tensor-name template."""

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_MAX_HEADER_BYTES = 100_000_000  # the limit of the reference `safetensors` implementation
_CHUNK_BYTES = 64 * 2**20  # rows of a plain (non-stacked) tensor are copied in pieces this big
_ALIGN = 64  # JAX on CPU uses host arrays aligned to this in place (no copy)

# safetensors' dtype codes; byte order is always little-endian.
_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(jnp.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(jnp.float8_e4m3fn),
    "F8_E5M2": np.dtype(jnp.float8_e5m2),
}
_DTYPE_CODES: dict[np.dtype, str] = {dtype: code for code, dtype in _DTYPES.items()}


# ---------------------------------------------------------------------------------------------
# Tensor names


@dataclasses.dataclass(frozen=True)
class TensorName:
    """Where a leaf is stored in a checkpoint: a tensor name, and the order of its axes.

    A plain `str` in `names` is shorthand for `TensorName(name)`.

    **Arguments:**

    - `name`: the tensor's name in the checkpoint. For a stacked leaf (one with a leading layer
        axis) it is a template in which `{i}` stands for the layer index, such as
        `"model.layers.{i}.mlp.up_proj.weight"`; each layer is then its own tensor. A name
        without `{i}` is one tensor holding the whole leaf.
    - `transpose`: how the stored axes map to the leaf's axes (per layer, for a stacked leaf):
        the leaf is `stored.transpose(transpose)`, and saving stores the inverse permutation.
        `None` means the same order. (Hugging Face stores a linear weight as `[out, in]`, as
        `eqx.nn.Linear` does, so that needs none; a kernel kept as `[in, out]` needs `(1, 0)`.)
    """

    name: str
    transpose: tuple[int, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"`TensorName.name` must be a non-empty string; got {self.name!r}.")
        if self.transpose is not None:
            axes = tuple(int(a) for a in self.transpose)
            if sorted(axes) != list(range(len(axes))):
                raise ValueError(
                    "`TensorName.transpose` must be a permutation of the axes 0..n-1, such as "
                    f"(1, 0); got {self.transpose!r} for {self.name!r}."
                )
            object.__setattr__(self, "transpose", axes)

    @property
    def stacked(self) -> bool:
        return LAYER in self.name

    def at(self, layer: int | None) -> str:
        return self.name if layer is None else self.name.replace(LAYER, str(layer))

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape a tensor of (per-layer) leaf shape `shape` has in the file."""
        if self.transpose is None:
            return shape
        stored = [0] * len(shape)
        for axis, size in zip(self.transpose, shape, strict=True):
            stored[axis] = size
        return tuple(stored)


def _is_name_leaf(x: Any) -> bool:
    return x is None or isinstance(x, str | TensorName)


def _as_name(value: Any, path: KeyPath, where: str) -> TensorName | None:
    if value is None or isinstance(value, TensorName):
        return value
    if isinstance(value, str):
        return TensorName(value)
    raise TypeError(
        f"{where} must be a str, an `eqx_lean.TensorName` or None for leaf "
        f"{jax.tree_util.keystr(path)}; got {type(value).__name__} ({value!r:.80})."
    )


def _resolve_names(names: Any, layout: _Layout) -> list[TensorName | None]:
    """One name (or None: not stored) per array leaf of `layout`."""
    if callable(names) and not isinstance(names, eqx.Module):
        return [
            _as_name(names(path, leaf), path, "The `names` rule's result")
            for path, leaf in zip(layout.paths, layout.structs, strict=True)
        ]
    flat = dict(jax.tree_util.tree_flatten_with_path(names, is_leaf=_is_name_leaf)[0])
    resolved = []
    for path in layout.paths:
        if path not in flat:
            raise ValueError(
                "`names` must give a name (a str, an `eqx_lean.TensorName`, or None for a leaf "
                "that is not stored) at every array leaf of the model, in a pytree of the same "
                f"structure (e.g. built with `eqx.tree_at`), but it has none at leaf "
                f"{jax.tree_util.keystr(path)}. A function `(path, leaf) -> name` works too."
            )
        resolved.append(_as_name(flat[path], path, "`names`"))
    return resolved


def _layer_count(layout: _Layout, tensor_names: Sequence[TensorName | None]) -> int | None:
    """The length of the layer axis shared by every stacked leaf (None if there is none)."""
    lengths: dict[int, KeyPath] = {}
    for path, leaf, name in zip(layout.paths, layout.structs, tensor_names, strict=True):
        if name is None or not name.stacked:
            continue
        if len(leaf.shape) == 0:
            raise ValueError(
                f"Leaf {jax.tree_util.keystr(path)} is a scalar, so it has no layer axis, but its "
                f"name {name.name!r} contains {LAYER}: a stacked leaf must have a leading layer "
                "axis."
            )
        lengths.setdefault(leaf.shape[0], path)
    if len(lengths) > 1:
        found = ", ".join(f"{n} at {jax.tree_util.keystr(p)}" for n, p in lengths.items())
        raise ValueError(
            f"Every leaf whose name contains {LAYER} must have the same leading layer axis, "
            f"but found several lengths: {found}."
        )
    return next(iter(lengths), None)


def _require_all_stacked(layout: _Layout, tensor_names: Sequence[TensorName | None], fn: str):
    for path, name in zip(layout.paths, tensor_names, strict=True):
        if name is not None and not name.stacked:
            raise ValueError(
                f"`{fn}` needs every name to be a template with {LAYER} for the layer index, but "
                f"leaf {jax.tree_util.keystr(path)} is named {name.name!r}. For a model with "
                "plain tensors too (embedding, final norm, head), use "
                f"`{fn.replace('stacked', 'tensors')}`, which takes both kinds of name."
            )


def _check_transpose_rank(path: KeyPath, name: TensorName, shape: tuple[int, ...]) -> None:
    if name.transpose is not None and len(name.transpose) != len(shape):
        raise ValueError(
            f"`TensorName.transpose` for {name.name!r} (leaf {jax.tree_util.keystr(path)}) must "
            f"permute all {len(shape)} axes of the leaf's shape {list(shape)}"
            f"{' per layer' if name.stacked else ''}; got {name.transpose}."
        )


# ---------------------------------------------------------------------------------------------
# Reading safetensors files


class _Tensor(NamedTuple):
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in `file`
    stop: int


class _Checkpoint(NamedTuple):
    files: tuple[Path, ...]
    tensors: dict[str, _Tensor]

    def describe(self) -> str:
        if len(self.files) == 1:
            return str(self.files[0])
        return f"{len(self.files)} files in {self.files[0].parent}"


def _pickle_error(path: Path) -> ValueError:
    return ValueError(
        f"{path} is a PyTorch pickle checkpoint. eqx_lean never unpickles (unpickling can run "
        "arbitrary code); convert it to safetensors first, e.g. with transformers: "
        "`AutoModelForCausalLM.from_pretrained(src).save_pretrained(dst, safe_serialization=True)`,"
        " or with torch: `safetensors.torch.save_file(torch.load(src, weights_only=True), dst)`."
    )


def _looks_like_pickle(first_bytes: bytes) -> bool:
    # A zip archive (torch.save since 1.6) or a raw pickle stream (protocol 2 and above).
    return first_bytes[:4] == b"PK\x03\x04" or first_bytes[:1] == b"\x80"


def _bad_file(path: Path, problem: str) -> ValueError:
    return ValueError(
        f"{path} is not a valid safetensors file: {problem}. Was it truncated or written by "
        "something other than a safetensors writer?"
    )


def _int_list(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def _parse_entry(path: Path, name: str, entry: Any, data_start: int) -> _Tensor:
    if not isinstance(entry, dict):
        raise _bad_file(path, f"the header entry of tensor {name!r} is not an object")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if code not in _DTYPES:
        raise _bad_file(
            path, f"tensor {name!r} has dtype {code!r}; known dtypes are {', '.join(_DTYPES)}"
        )
    if not (_int_list(shape) and _int_list(offsets) and len(offsets) == 2):
        raise _bad_file(
            path,
            f"tensor {name!r} needs a `shape` of non-negative integers and `data_offsets` "
            f"[begin, end]; got shape={shape!r}, data_offsets={offsets!r}",
        )
    dtype = _DTYPES[code]
    begin, end = offsets
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise _bad_file(
            path,
            f"tensor {name!r} ({code}{shape}) needs {expected} bytes but its data_offsets "
            f"[{begin}, {end}] span {end - begin}",
        )
    return _Tensor(path, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_coverage(path: Path, tensors: Sequence[tuple[str, _Tensor]], data_start: int) -> None:
    """The data section must be covered exactly: contiguous, no overlap, nothing left over."""
    size = path.stat().st_size
    position = data_start
    for name, tensor in sorted(tensors, key=lambda item: (item[1].start, item[1].stop)):
        if tensor.start != position:
            raise _bad_file(
                path,
                f"tensor {name!r} starts at data offset {tensor.start - data_start} where "
                f"{position - data_start} was expected (tensors must be contiguous, without gaps "
                "or overlaps)",
            )
        position = tensor.stop
    if position > size:
        raise _bad_file(
            path,
            f"its header describes {position} bytes but the file holds only {size} "
            f"({position - size} missing)",
        )
    if position < size:
        raise _bad_file(
            path,
            f"the file holds {size} bytes but its header describes only {position} "
            f"({size - position} unexpected trailing bytes)",
        )


def _read_header(path: Path) -> dict[str, _Tensor]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad_file(path, f"it holds {size} bytes, fewer than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            if _looks_like_pickle(head):
                raise _pickle_error(path)
            raise _bad_file(
                path,
                f"its header length field says {header_len} bytes but the file holds {size} "
                f"(and headers are limited to {_MAX_HEADER_BYTES} bytes)",
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad_file(path, f"its header is not valid UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad_file(path, "its header is not a JSON object")
    data_start = 8 + header_len
    entries = [
        (name, _parse_entry(path, name, entry, data_start))
        for name, entry in header.items()
        if name != "__metadata__"
    ]
    _check_coverage(path, entries, data_start)
    return dict(entries)


def _files_of_index(index_path: Path) -> tuple[list[Path], dict[str, Path]]:
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("`weight_map` is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{index_path} must be a JSON object with a `weight_map` object from tensor names to "
            f"file names, as Hugging Face writes it; reading it failed: {e!r}"
        ) from None
    expected = {name: index_path.parent / file for name, file in weight_map.items()}
    files = sorted(set(expected.values()))
    for file in files:
        if not file.is_file():
            raise ValueError(f"{index_path} refers to {file.name}, which does not exist.")
    return files, expected


def _files_of_directory(directory: Path) -> tuple[list[Path], dict[str, Path]]:
    index = directory / INDEX_FILE
    if index.is_file():
        return _files_of_index(index)
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files, {}
    pickles = sorted(p for p in directory.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise _pickle_error(pickles[0])
    raise ValueError(
        f"`path` must hold safetensors weights, but the directory {directory} has no "
        f"{INDEX_FILE} and no *.safetensors file."
    )


def _is_path_list(path: Any) -> bool:
    return (
        isinstance(path, Sequence)
        and len(path) > 0
        and all(isinstance(p, str | os.PathLike) for p in path)
    )


def _checkpoint_files(path: Any) -> tuple[list[Path], dict[str, Path]]:
    if isinstance(path, str | os.PathLike):
        paths = [Path(path)]
    elif _is_path_list(path):
        paths = [Path(p) for p in path]
    else:
        raise TypeError(
            "`path` must be a safetensors file, a list of them, or a directory (with "
            f"{INDEX_FILE} or *.safetensors files); got {path!r}."
        )
    if len(paths) == 1 and paths[0].is_dir():
        return _files_of_directory(paths[0])
    if len(paths) == 1 and paths[0].name.endswith(".index.json"):
        return _files_of_index(paths[0])
    for p in paths:
        if p.suffix in _PICKLE_SUFFIXES:
            raise _pickle_error(p)
        if not p.is_file():
            raise FileNotFoundError(f"`path` must name existing files; {p} does not exist.")
    return paths, {}


def _open_checkpoint(path: Any) -> _Checkpoint:
    if sys.byteorder != "little":  # pragma: no cover
        raise NotImplementedError("Reading safetensors files needs a little-endian host.")
    files, expected = _checkpoint_files(path)
    tensors: dict[str, _Tensor] = {}
    for file in files:
        for name, tensor in _read_header(file).items():
            if name in tensors:
                raise ValueError(
                    f"Tensor {name!r} is stored twice, in {tensors[name].file} and in {file}; "
                    "a checkpoint must name each tensor once."
                )
            tensors[name] = tensor
    for name, file in expected.items():
        if name not in tensors or tensors[name].file != file:
            raise ValueError(
                f"The index names {file} as the file holding tensor {name!r}, but that file has "
                "no such tensor."
            )
    return _Checkpoint(tuple(files), tensors)


class _Maps:
    """Read-only memory maps of a checkpoint's files, opened on first use."""

    def __init__(self):
        self._maps: dict[Path, mmap.mmap] = {}

    def view(self, tensor: _Tensor) -> np.ndarray:
        if tensor.stop == tensor.start:
            return np.zeros(tensor.shape, tensor.dtype)
        if tensor.file not in self._maps:
            with open(tensor.file, "rb") as f:
                self._maps[tensor.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        count = math.prod(tensor.shape)
        flat = np.frombuffer(self._maps[tensor.file], tensor.dtype, count, tensor.start)
        return flat.reshape(tensor.shape)

    def release(self, tensor: _Tensor) -> None:
        """Unmaps a tensor's pages from this process; they stay in the page cache.

        Without this, every page read would count in the process's resident memory until the
        end of the load, looking like a second copy of the model (it is not one: the kernel can
        drop those pages at any time). Pages re-read later fault back in from the cache.
        """
        m = self._maps.get(tensor.file)
        if m is None or tensor.stop <= tensor.start or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = tensor.start - tensor.start % mmap.PAGESIZE
        m.madvise(mmap.MADV_DONTNEED, start, tensor.stop - start)

    def close(self) -> None:
        for m in self._maps.values():
            # Fails while an array still views the map (JAX may keep zero-copy inputs alive a
            # little longer); the map is then closed when the last view is collected.
            with contextlib.suppress(BufferError):
                m.close()
        self._maps.clear()


# ---------------------------------------------------------------------------------------------
# Loading


class _LoadLeaf(NamedTuple):
    path: KeyPath
    target: jax.ShapeDtypeStruct  # the loaded leaf: full shape, target dtype
    name: TensorName | None  # None: not stored, `source` is returned as is
    source: Any
    sharding: jax.sharding.Sharding | None


def _describe_leaf(leaf: _LoadLeaf) -> str:
    return jax.tree_util.keystr(leaf.path)


def _resolve_shardings(sharding: Any, layout: _Layout) -> list[jax.sharding.Sharding | None]:
    # Kept separate so that the package-wide sharding policy can replace it once it exists.
    if isinstance(sharding, jax.sharding.Sharding):
        return [sharding] * len(layout.paths)
    if sharding is None:
        return [getattr(s, "sharding", None) for s in layout.structs]
    flat = dict(
        jax.tree_util.tree_flatten_with_path(
            sharding, is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding)
        )[0]
    )
    for path, value in flat.items():
        placed_elsewhere = value is not None and path not in layout.paths
        if placed_elsewhere or not isinstance(value, jax.sharding.Sharding | None):
            raise TypeError(
                "`sharding` must be one `jax.sharding.Sharding`, or a pytree of the model's "
                "structure with a Sharding (or None) at each array leaf; at "
                f"{jax.tree_util.keystr(path) or 'its root'} it has {type(value).__name__}."
            )
    return [flat.get(path) for path in layout.paths]


def _target_of(
    path: KeyPath, leaf: jax.ShapeDtypeStruct, name: TensorName | None, dtype: DtypePolicy
) -> jax.ShapeDtypeStruct:
    # A dtype rule sees one layer of a stacked leaf, as in `build_stacked`.
    per_layer = name is not None and name.stacked
    seen = jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype) if per_layer else leaf
    target_dtype, _ = leaf_dtype(dtype, path, seen)
    return jax.ShapeDtypeStruct(leaf.shape, target_dtype)


def _plan_leaves(
    like: Any, names: Any, dtype: DtypePolicy, sharding: Any, fn: str
) -> tuple[_Layout, list[_LoadLeaf], int | None]:
    layout = _Layout.of(like)
    tensor_names = _resolve_names(names, layout)
    if fn == "load_stacked":
        _require_all_stacked(layout, tensor_names, fn)
    num_layers = _layer_count(layout, tensor_names)
    shardings = _resolve_shardings(sharding, layout)
    concrete = {
        path: x
        for path, x in jax.tree_util.tree_flatten_with_path(eqx.filter(like, eqx.is_array))[0]
    }
    leaves = []
    for path, leaf, name, leaf_sharding in zip(
        layout.paths, layout.structs, tensor_names, shardings, strict=True
    ):
        if name is None and path not in concrete:
            raise ValueError(
                f"`names` gives no tensor for leaf {jax.tree_util.keystr(path)}, so it is not "
                "loaded and must be kept from `like`, but `like` holds only its shape there. "
                "Name its tensor, or pass the array itself in `like`."
            )
        if name is not None:
            _check_transpose_rank(path, name, leaf.shape[1:] if name.stacked else leaf.shape)
        target = _target_of(path, leaf, name, dtype)
        if leaf_sharding is not None and name is not None:
            _check_sharding(path, leaf_sharding, target.shape)
        leaves.append(_LoadLeaf(path, target, name, concrete.get(path), leaf_sharding))
    return layout, leaves, num_layers


def _check_sharding(path: KeyPath, sharding: jax.sharding.Sharding, shape: tuple[int, ...]):
    try:
        sharding.shard_shape(shape)
    except Exception as e:
        raise ValueError(
            f"The sharding for leaf {jax.tree_util.keystr(path)} must fit its shape "
            f"{list(shape)}: {e}"
        ) from None


def _tensor_problems(
    leaf: _LoadLeaf, checkpoint: _Checkpoint, num_layers: int | None
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


def _check_tensors(leaves: Sequence[_LoadLeaf], checkpoint: _Checkpoint, num_layers: int | None):
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
    return [_Shard(device, _bounded(index, shape)) for device, index in indices.items()]


def _bounded(index: Any, shape: tuple[int, ...]) -> tuple[slice, ...]:
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
            made = _allocate(structs, (None,) * len(structs))
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
        return {(_write_layer, buffer, _struct_on(buffer.shape[1:], stored, shard.device))}
    if not shard.region:  # a scalar: cast and placed without a compiled write
        return set()
    rest = buffer.shape[1:]
    return {
        (_write_rows, buffer, _struct_on((p.stop - p.start, *rest), stored, shard.device))
        for p in _row_pieces(shard, stored.itemsize)
    }


def _compile_writes(signatures: set[tuple[Any, ...]]) -> None:
    # Compiling before the buffers exist keeps the compiler's transient memory out of the
    # peak; compiling in threads overlaps the compilations (one per shape and device).
    index = jax.ShapeDtypeStruct((), jnp.int32, weak_type=True)

    def compile_one(signature: tuple[Any, ...]) -> None:
        write, buffer, value = signature
        write.lower(buffer, value, index).compile()

    workers = min(len(signatures), os.cpu_count() or 1)
    if workers <= 1:
        for signature in signatures:
            compile_one(signature)
        return
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(compile_one, signatures))


def _host_slice(stored: np.ndarray, name: TensorName, index: tuple[slice, ...]) -> np.ndarray:
    """The part `index` (in the leaf's axis order) of a stored tensor, as a view when possible."""
    view = stored if name.transpose is None else stored.transpose(name.transpose)
    return view[index]


def _put(value: np.ndarray, device: Any) -> Array:
    platform = jax.default_backend() if device is None else device.platform
    if platform == "cpu" and not _is_aligned(value):
        # JAX on CPU uses a contiguous, 64-byte aligned host array in place (so every tensor that
        # `save_stacked` writes is read straight from the page cache); anything else it copies,
        # several times slower than NumPy copies into an aligned array.
        value = _aligned_copy(value)
    return jax.device_put(value, device)


def _is_aligned(value: np.ndarray) -> bool:
    return value.flags.c_contiguous and value.ctypes.data % _ALIGN == 0


def _aligned_copy(value: np.ndarray) -> np.ndarray:
    raw = np.empty(value.nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    aligned = raw[start : start + value.nbytes].view(value.dtype).reshape(value.shape)
    np.copyto(aligned, value)
    return aligned


@functools.partial(jax.jit, donate_argnums=0)
def _write_rows(buffer: Array, value: Array, start: Any) -> Array:
    return update_rows(buffer, value, start)


@functools.partial(jax.jit, donate_argnums=0)
def _write_layer(buffer: Array, value: Array, layer: Any) -> Array:
    return update_rows(buffer, value[None], layer)


def _fill_plain(leaf: _LoadLeaf, shard: _Shard, buffer: Array, stored: np.ndarray) -> Array:
    assert leaf.name is not None
    if not shard.region:  # a scalar
        value = jnp.asarray(_host_slice(stored, leaf.name, ()))
        return jax.device_put(value.astype(leaf.target.dtype), shard.device)
    for piece in _row_pieces(shard, stored.dtype.itemsize):
        value = _put(_host_slice(stored, leaf.name, (piece, *shard.region[1:])), shard.device)
        buffer = _write_rows(buffer, value, piece.start - shard.region[0].start)
        buffer.block_until_ready()
    return buffer


def _fill_layer(
    leaf: _LoadLeaf, shard: _Shard, buffer: Array, stored: np.ndarray, layer: int
) -> Array:
    assert leaf.name is not None
    value = _put(_host_slice(stored, leaf.name, shard.region[1:]), shard.device)
    buffer = _write_layer(buffer, value, layer - shard.region[0].start)
    # One write in flight at a time: queued writes would each hold their input alive.
    buffer.block_until_ready()
    return buffer


def _fill_tensor(
    leaf: _LoadLeaf,
    shards: Sequence[_Shard],
    buffers: list[Array],
    tensor: _Tensor,
    maps: _Maps,
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
    leaves: Sequence[_LoadLeaf], checkpoint: _Checkpoint, num_layers: int | None, maps: _Maps
) -> list[Any]:
    named = {j: leaf.name for j, leaf in enumerate(leaves) if leaf.name is not None}
    shards = {j: _shards_of(leaves[j]) for j in named}
    _compile_writes(
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
        _delete([b for bs in buffers.values() for b in bs])
        raise
    return [
        _assemble(leaf, buffers[j]) if j in named else leaf.source for j, leaf in enumerate(leaves)
    ]


def _load(path: Any, like: Any, names: Any, dtype: DtypePolicy, sharding: Any, fn: str) -> Any:
    dtype = check_dtype_policy(dtype)
    layout, leaves, num_layers = _plan_leaves(like, names, dtype, sharding, fn)
    checkpoint = _open_checkpoint(path)
    _check_tensors(leaves, checkpoint, num_layers)
    maps = _Maps()
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
    sharding: Any = None,
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
    may mix templates with `{i}` and plain names.

    **Returns:**

    The model with the structure of `like`, its array leaves loaded.
    """
    return _load(path, like, names, dtype, sharding, "load_tensors")


def load_stacked(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    like: M,
    names: Any,
    *,
    dtype: DtypePolicy = None,
    sharding: Any = None,
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
        transpose), or a function `(path, leaf) -> name`. Every name must contain `{i}`, the
        layer index. A leaf named `None` is not loaded: `like` must hold its array, which is
        returned as is.
    - `dtype`: the dtype to store each floating leaf in: `None` keeps the dtypes of `like`; a
        floating dtype casts every floating leaf; a callable `(path, leaf) -> dtype | None`
        chooses per leaf, given one layer's `ShapeDtypeStruct`. Tensors are cast from whatever
        floating dtype the file has; integer and boolean tensors must match exactly.
    - `sharding`: `None` puts each leaf on the default device, unless its `ShapeDtypeStruct`
        in `like` carries a sharding; a `jax.sharding.Sharding` for every leaf; or a pytree of
        the structure of `like` with a `Sharding` (or `None`) per array leaf. Each device reads
        and receives only its own slice of each layer.

    **Returns:**

    The stacked model, with the structure of `like`.
    """
    return _load(path, like, names, dtype, sharding, "load_stacked")


# ---------------------------------------------------------------------------------------------
# Saving


class _Record(NamedTuple):
    name: str
    leaf: int
    layer: int | None
    inverse: tuple[int, ...] | None  # the transpose taking the leaf's axes to the stored ones
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _inverse(axes: tuple[int, ...] | None) -> tuple[int, ...] | None:
    return None if axes is None else tuple(int(a) for a in np.argsort(axes))


def _plan_records(tree: Any, names: Any, fn: str) -> tuple[list[Any], list[_Record]]:
    layout = _Layout.of(tree)
    arrays = [x for _, x in jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]]
    if len(arrays) != len(layout.paths):
        raise TypeError(
            f"`{fn}` needs arrays to write, but the model has `jax.ShapeDtypeStruct` leaves."
        )
    tensor_names = _resolve_names(names, layout)
    if fn == "save_stacked":
        _require_all_stacked(layout, tensor_names, fn)
    num_layers = _layer_count(layout, tensor_names)
    plain: list[_Record] = []
    per_layer: list[list[_Record]] = [[] for _ in range(num_layers or 0)]
    for j, (path, leaf, name) in enumerate(
        zip(layout.paths, layout.structs, tensor_names, strict=True)
    ):
        if name is None:
            continue
        dtype = np.dtype(leaf.dtype)
        if dtype not in _DTYPE_CODES:
            raise TypeError(
                f"safetensors cannot store leaf {jax.tree_util.keystr(path)} of dtype {dtype}; "
                f"it stores {', '.join(str(d) for d in _DTYPE_CODES)}."
            )
        shape = leaf.shape[1:] if name.stacked else leaf.shape
        _check_transpose_rank(path, name, shape)
        stored = name.stored_shape(shape)
        inverse = _inverse(name.transpose)
        if name.stacked:
            for layer in range(num_layers or 0):
                per_layer[layer].append(_Record(name.at(layer), j, layer, inverse, dtype, stored))
        else:
            plain.append(_Record(name.at(None), j, None, inverse, dtype, stored))
    records = plain + [r for layer in per_layer for r in layer]
    seen: dict[str, _Record] = {}
    for r in records:
        if r.name in seen:
            raise ValueError(
                "`names` must give every tensor its own name, but leaves "
                f"{jax.tree_util.keystr(layout.paths[seen[r.name].leaf])} and "
                f"{jax.tree_util.keystr(layout.paths[r.leaf])} are both named {r.name!r}."
            )
        seen[r.name] = r
    return arrays, records


def _split_files(records: Sequence[_Record], max_shard_bytes: int) -> list[list[_Record]]:
    files: list[list[_Record]] = [[]]
    size = 0
    for r in records:
        if files[-1] and size + r.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(r)
        size += r.nbytes
    return files


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def _header_bytes(records: Sequence[_Record], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for r in records:
        header[r.name] = {
            "dtype": _DTYPE_CODES[r.dtype],
            "shape": list(r.shape),
            "data_offsets": [offset, offset + r.nbytes],
        }
        offset += r.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    # Trailing spaces are allowed in the header; they make the data section start 64-byte
    # aligned, so that loading can use the file's pages in place (see `_aligned_first`).
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def _aligned_first(records: Sequence[_Record]) -> list[_Record]:
    """Puts the tensors whose sizes are multiples of 64 bytes first, so all of them start aligned.

    Tensors must be contiguous in a safetensors file (no padding between them), so order is the
    only way to keep their offsets aligned.
    """
    return sorted(records, key=lambda r: r.nbytes % _ALIGN != 0)


@jax.jit
def _layer_bits(array: Array, layer: Any) -> Array:
    # As bits, for the reason given in `update_rows`; the bitcast fuses into the slice.
    bits = as_bits(array) if is_floating(array.dtype) else array
    return lax.dynamic_index_in_dim(bits, layer, 0, keepdims=False)


def _host_layer(array: jax.Array, layer: int, dtype: np.dtype) -> np.ndarray:
    """One layer of a stacked array, gathered on the host from the shards holding it.

    Only that layer moves, whatever the sharding: slicing a layer out of an array sharded
    on its layer axis could otherwise make XLA gather the whole array.
    """
    if len(array.sharding.device_set) == 1:
        return np.asarray(_layer_bits(array, layer)).view(dtype)
    value = np.empty(array.shape[1:], dtype)
    done = set()
    for shard in array.addressable_shards:
        region = _bounded(shard.index, array.shape)
        key = tuple((r.start, r.stop) for r in region[1:])
        if region[0].start <= layer < region[0].stop and key not in done:
            part = _layer_bits(shard.data, layer - region[0].start)
            value[region[1:]] = np.asarray(part).view(dtype)
            done.add(key)
    return value


def _host_tensor(array: Any, record: _Record) -> np.ndarray:
    if record.layer is None:
        value = np.asarray(array)
    elif isinstance(array, jax.Array):
        value = _host_layer(array, record.layer, record.dtype)
    else:
        value = np.asarray(array[record.layer])
    if record.inverse is not None:
        value = value.transpose(record.inverse)
    return np.ascontiguousarray(value)


def _write_array(f: Any, value: np.ndarray) -> None:
    f.write(value.reshape(-1).view(np.uint8).data)


def _write_file(path: Path, records: Sequence[_Record], arrays: Sequence[Any], metadata) -> None:
    with open(path, "wb") as f:
        f.write(_header_bytes(records, metadata))
        for r in records:
            _write_array(f, _host_tensor(arrays[r.leaf], r))
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors") or name.endswith(".safetensors.index.json")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry_over(old: Path, new: Path) -> None:
    """Keeps what else the old directory holds (config, tokenizer, ...) in the new one."""
    for entry in old.iterdir():
        if _is_weight_file(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry), new / entry.name)
        else:
            _link_or_copy(str(entry), str(new / entry.name))


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two directories atomically with Linux's `renameat2`; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return result == 0


def _replace_directory(new: Path, path: Path) -> None:
    if not path.exists():
        os.rename(new, path)
        _fsync_directory(path.parent)
        return
    if _exchange(new, path):
        _fsync_directory(path.parent)
        shutil.rmtree(new)  # now the old checkpoint
        return
    # Without an atomic exchange, the old checkpoint survives under `old` until the new one is
    # in place.
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(path, old)
    os.rename(new, path)
    _fsync_directory(path.parent)
    shutil.rmtree(old)


def _check_save_arguments(path: Path, max_shard_bytes: Any, metadata: Any) -> dict[str, str]:
    if path.exists() and not path.is_dir():
        raise ValueError(f"`path` must be a directory (or not exist yet); {path} is a file.")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"`max_shard_bytes` must be a positive integer; got {max_shard_bytes!r}.")
    merged = {"format": "pt"}  # transformers refuses safetensors files without it
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise TypeError(f"`metadata` must map strings to strings; got {metadata!r}.")
        merged.update(metadata)
    return merged


def _save(
    path: str | os.PathLike,
    tree: Any,
    names: Any,
    max_shard_bytes: int,
    metadata: Mapping[str, str] | None,
    fn: str,
) -> None:
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()  # replace the directory it points to, not the link
    merged = _check_save_arguments(path, max_shard_bytes, metadata)
    arrays, records = _plan_records(tree, names, fn)
    for x in arrays:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            raise ValueError(
                f"`{fn}` writes from one process, but the model has arrays spread over several "
                "processes; save it with Orbax instead (see the Orbax recipe)."
            )
    files = _split_files(records, max_shard_bytes)
    file_names = _file_names(len(files))
    path.parent.mkdir(parents=True, exist_ok=True)
    new = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    new.mkdir()
    try:
        for file_name, file_records in zip(file_names, files, strict=True):
            _write_file(new / file_name, _aligned_first(file_records), arrays, merged)
        if len(files) > 1:
            _write_index(new, files, file_names)
        if path.is_dir():
            _carry_over(path, new)
        _fsync_directory(new)
        _replace_directory(new, path)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise


def _write_index(directory: Path, files: Sequence[Sequence[_Record]], file_names: Sequence[str]):
    weight_map = {r.name: f for f, rs in zip(file_names, files, strict=True) for r in rs}
    index = {
        "metadata": {"total_size": sum(r.nbytes for rs in files for r in rs)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(directory / INDEX_FILE, "w") as f:
        json.dump(index, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def save_tensors(
    path: str | os.PathLike,
    tree: Any,
    names: Any,
    *,
    max_shard_bytes: int = 5 * 10**9,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Saves a model to safetensors files, one tensor at a time.

    Like [`eqx_lean.save_stacked`][], but for any model: a leaf whose name contains `{i}` is
    written as one tensor per layer, any other name as one tensor holding the whole leaf. The
    inverse of [`eqx_lean.load_tensors`][].

    **Arguments:** as for [`eqx_lean.save_stacked`][]; `tree` is the whole model, and `names`
    may mix templates with `{i}` and plain names.

    **Returns:**

    Nothing.
    """
    _save(path, tree, names, max_shard_bytes, metadata, "save_tensors")


def save_stacked(
    path: str | os.PathLike,
    stacked: Any,
    names: Any,
    *,
    max_shard_bytes: int = 5 * 10**9,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Saves stacked layers as a safetensors checkpoint with one tensor per layer.

    The files follow Hugging Face's layout: `model.safetensors`, or, past `max_shard_bytes`,
    `model-00001-of-0000N.safetensors` files with a `model.safetensors.index.json`. Each
    tensor is copied to the host and written on its own, so saving needs one layer's tensor of
    memory beyond the model.

    Saving never loses data: the checkpoint is written into a temporary directory beside `path`,
    flushed to disk, and only then swapped into place (atomically on Linux), so an interrupted
    save leaves any earlier checkpoint at `path` intact (and possibly a `.<name>.tmp-*`
    directory to delete). Other files already in `path`, such as `config.json`, are kept; its
    old `*.safetensors` files and index are replaced.

    **Arguments:**

    - `path`: the checkpoint directory, created if needed.
    - `stacked`: the stacked model, with arrays (on any devices, sharded or not) as leaves.
    - `names`: the tensor-name template of every array leaf, as for
        [`eqx_lean.load_stacked`][]: every name must contain `{i}`; a leaf named `None` is not
        saved.
    - `max_shard_bytes`: the largest file to write, in bytes (a single tensor bigger than this
        gets a file of its own). Hugging Face's default is 5 GB.
    - `metadata`: strings to store in every file's header, added to `{"format": "pt"}` (which
        `transformers` requires).

    **Returns:**

    Nothing.
    """
    _save(path, stacked, names, max_shard_bytes, metadata, "save_stacked")
