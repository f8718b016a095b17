"""The safetensors format: headers, checkpoint directories and indexes, read-only maps.

Files are read through read-only memory maps (their pages are page cache, never a private
copy). Headers are checked completely (dtypes, shapes, offsets covering the data exactly)
before any tensor is read, and pickles are refused, never unpickled.
"""

import contextlib
import json
import math
import mmap
import os
import struct
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

import jax.numpy as jnp
import numpy as np

from .._platform import ZERO_COPY_ALIGNMENT


INDEX_FILE = "model.safetensors.index.json"

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_MAX_HEADER_BYTES = 100_000_000  # the limit of the reference `safetensors` implementation
ALIGN = ZERO_COPY_ALIGNMENT  # tensor data so aligned is used in place by JAX on CPU (no copy)

# safetensors' dtype codes; byte order is always little-endian.
DTYPES: dict[str, np.dtype] = {
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
DTYPE_CODES: dict[np.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}


class Tensor(NamedTuple):
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in `file`
    stop: int


class Checkpoint(NamedTuple):
    files: tuple[Path, ...]
    tensors: dict[str, Tensor]

    def describe(self) -> str:
        if len(self.files) == 1:
            return str(self.files[0])
        return f"{len(self.files)} files in {self.files[0].parent}"


def pickle_error(path: Path) -> ValueError:
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


def _parse_entry(path: Path, name: str, entry: Any, data_start: int) -> Tensor:
    if not isinstance(entry, dict):
        raise _bad_file(path, f"the header entry of tensor {name!r} is not an object")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if code not in DTYPES:
        raise _bad_file(
            path, f"tensor {name!r} has dtype {code!r}; known dtypes are {', '.join(DTYPES)}"
        )
    if not (_int_list(shape) and _int_list(offsets) and len(offsets) == 2):
        raise _bad_file(
            path,
            f"tensor {name!r} needs a `shape` of non-negative integers and `data_offsets` "
            f"[begin, end]; got shape={shape!r}, data_offsets={offsets!r}",
        )
    dtype = DTYPES[code]
    begin, end = offsets
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise _bad_file(
            path,
            f"tensor {name!r} ({code}{shape}) needs {expected} bytes but its data_offsets "
            f"[{begin}, {end}] span {end - begin}",
        )
    return Tensor(path, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_coverage(path: Path, tensors: Sequence[tuple[str, Tensor]], data_start: int) -> None:
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


def _read_header(path: Path) -> dict[str, Tensor]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad_file(path, f"it holds {size} bytes, fewer than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8 and _looks_like_pickle(head):
            raise pickle_error(path)
        if header_len > size - 8:
            raise _bad_file(
                path,
                f"its header length field says {header_len} bytes, but only {size - 8} bytes "
                f"follow the 8-byte length field (the file holds {size} bytes in all)",
            )
        if header_len > _MAX_HEADER_BYTES:
            raise _bad_file(
                path,
                f"its header length field says {header_len} bytes, more than the "
                f"{_MAX_HEADER_BYTES} bytes a safetensors header may have",
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


def _plain_file_name(index_path: Path, tensor: str, file: Any) -> str:
    """An index entry, which must name a file in the index's own directory.

    The file itself may be a symbolic link (as in the Hugging Face cache, where
    `snapshots/<revision>/model-00001-of-00002.safetensors` links to `../../blobs/<hash>`):
    the entry is what must stay inside, not the link's target.
    """
    plain = (
        isinstance(file, str)
        and file not in ("", ".", "..")
        and "/" not in file
        and "\\" not in file
        and Path(file).name == file
    )
    if not plain:
        raise ValueError(
            f"{index_path} names {file!r} as the file of tensor {tensor!r}, but index entries "
            f"must be plain file names in the checkpoint's directory {index_path.parent} (no "
            "directory, no absolute path, no '..')."
        )
    return file


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
    expected = {
        name: index_path.parent / _plain_file_name(index_path, name, file)
        for name, file in weight_map.items()
    }
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
    pickles = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise pickle_error(pickles[0])
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
        if p.suffix in PICKLE_SUFFIXES:
            raise pickle_error(p)
        if not p.is_file():
            raise FileNotFoundError(f"`path` must name existing files; {p} does not exist.")
    return paths, {}


def open_checkpoint(path: Any) -> Checkpoint:
    if sys.byteorder != "little":  # pragma: no cover
        raise NotImplementedError("Reading safetensors files needs a little-endian host.")
    files, expected = _checkpoint_files(path)
    tensors: dict[str, Tensor] = {}
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
    return Checkpoint(tuple(files), tensors)


class Maps:
    """Read-only memory maps of a checkpoint's files, opened on first use (thread-safe)."""

    def __init__(self):
        self._maps: dict[Path, mmap.mmap] = {}
        self._lock = threading.Lock()

    def _map(self, file: Path) -> mmap.mmap:
        with self._lock:
            if file not in self._maps:
                with open(file, "rb") as f:
                    self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            return self._maps[file]

    def view(self, tensor: Tensor) -> np.ndarray:
        if tensor.stop == tensor.start:
            return np.zeros(tensor.shape, tensor.dtype)
        count = math.prod(tensor.shape)
        flat = np.frombuffer(self._map(tensor.file), tensor.dtype, count, tensor.start)
        return flat.reshape(tensor.shape)

    def release(self, tensor: Tensor) -> None:
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
