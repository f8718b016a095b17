"""Saving: models with stacked layers to safetensors files, one tensor at a time."""

import ctypes
import json
import math
import os
import shutil
import struct
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
from jax import lax
from jaxtyping import Array

from .._core import Layout, as_bits, is_floating
from .load import bounded
from .names import check_transpose_rank, layer_count, require_all_stacked, resolve_names
from .safetensors import ALIGN, DTYPE_CODES, INDEX_FILE, SINGLE_FILE


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
    layout = Layout.of(tree)
    arrays = [x for _, x in jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]]
    if len(arrays) != len(layout.paths):
        raise TypeError(
            f"`{fn}` needs arrays to write, but the model has `jax.ShapeDtypeStruct` leaves."
        )
    tensor_names = resolve_names(names, layout, fn)
    if fn == "save_stacked":
        require_all_stacked(layout, tensor_names, fn)
    num_layers = layer_count(layout, tensor_names)
    plain: list[_Record] = []
    per_layer: list[list[_Record]] = [[] for _ in range(num_layers or 0)]
    for j, (path, leaf, name) in enumerate(
        zip(layout.paths, layout.structs, tensor_names, strict=True)
    ):
        if name is None:
            continue
        dtype = np.dtype(leaf.dtype)
        if dtype not in DTYPE_CODES:
            raise TypeError(
                f"safetensors cannot store leaf {jax.tree_util.keystr(path)} of dtype {dtype}; "
                f"it stores {', '.join(str(d) for d in DTYPE_CODES)}."
            )
        shape = leaf.shape[1:] if name.stacked else leaf.shape
        check_transpose_rank(path, name, shape)
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
            "dtype": DTYPE_CODES[r.dtype],
            "shape": list(r.shape),
            "data_offsets": [offset, offset + r.nbytes],
        }
        offset += r.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    # Trailing spaces are allowed in the header; they make the data section start 64-byte
    # aligned, so that loading can use the file's pages in place (see `_aligned_first`).
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def _aligned_first(records: Sequence[_Record]) -> list[_Record]:
    """Puts the tensors whose sizes are multiples of 64 bytes first, so all of them start aligned.

    Tensors must be contiguous in a safetensors file (no padding between them), so order is the
    only way to keep their offsets aligned.
    """
    return sorted(records, key=lambda r: r.nbytes % ALIGN != 0)


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
        region = bounded(shard.index, array.shape)
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
    may mix templates with `{i}` and plain names; a `names` function is given the whole model's
    paths (see [paths](../getting-started.md#paths-in-rules-and-name-functions)).

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
        [`eqx_lean.load_stacked`][] (a function is given one layer's paths): every name must
        contain `{i}`; a leaf named `None` is not saved.
    - `max_shard_bytes`: the largest file to write, in bytes (a single tensor bigger than this
        gets a file of its own). Hugging Face's default is 5 GB.
    - `metadata`: strings to store in every file's header, added to `{"format": "pt"}` (which
        `transformers` requires).

    **Returns:**

    Nothing.
    """
    _save(path, stacked, names, max_shard_bytes, metadata, "save_stacked")
