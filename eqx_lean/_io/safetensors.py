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
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

import jax.numpy as jnp
import numpy as np

from .._platform import ZERO_COPY_ALIGNMENT


WEIGHTS_FILE = "model.safetensors"
"""A checkpoint's weights in one file, as Hugging Face names them."""

INDEX_SUFFIX = ".index.json"


def index_name(weights_name: str) -> str:
    """The index of the weight files a save names after `weights_name`.

    **Arguments:**

    - `weights_name`: the name of the weights in one file, such as `"model.safetensors"` or
        PEFT's `"adapter_model.safetensors"`.

    **Returns:**

    The index's file name, `weights_name` followed by `.index.json`.
    """
    return weights_name + INDEX_SUFFIX


INDEX_FILE = index_name(WEIGHTS_FILE)
"""Hugging Face's index of a checkpoint's weight files, `model.safetensors.index.json`."""

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Test seam: tests/test_safetensors.py lowers it to test the refusal on a small file.
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


def _check_coverage(
    path: Path, size: int, tensors: Sequence[tuple[str, Tensor]], data_start: int
) -> None:
    """The data section must be covered exactly: contiguous, no overlap, nothing left over."""
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


def _pread_exactly(fd: int, count: int, offset: int) -> bytes:
    chunks = []
    while count > 0:
        chunk = os.pread(fd, count, offset)
        if not chunk:
            break
        chunks.append(chunk)
        count -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _no_duplicates(path: Path) -> Any:
    """A `json.loads` hook refusing an object that names a key twice (JSON allows it; the last
    would silently win)."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in items:
            if key in result:
                raise _bad_file(
                    path,
                    f"its header gives {key!r} twice in one object (each tensor, and each field "
                    "of a tensor's entry, must appear once)",
                )
            result[key] = value
        return result

    return pairs


def read_header(path: Path, fd: int) -> dict[str, Tensor]:
    """The tensors of the safetensors file open as `fd` (`path` names it in messages), checked
    completely. Everything is read from `fd`, so header and data come from one file."""
    size = os.fstat(fd).st_size
    head = _pread_exactly(fd, 8, 0)
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
    raw = _pread_exactly(fd, header_len, 8)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(path))
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
    _check_coverage(path, size, entries, data_start)
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
        and "\x00" not in file  # which no file system allows in a name
        and "/" not in file
        and "\\" not in file
        and Path(file).name == file
    )
    if not plain:
        raise ValueError(
            f"{index_path} names {file!r} as the file of tensor {tensor!r}, but index entries "
            f"must be plain file names in the checkpoint's directory {index_path.parent} (no "
            "directory, no absolute path, no '..', no NUL byte)."
        )
    return file


def parse_index(index_path: Path, raw: bytes) -> dict[str, str]:
    """The `weight_map` of an index file's content: tensor name to a plain file name."""
    try:
        index = json.loads(raw.decode("utf-8"))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("`weight_map` is not an object")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{index_path} must be a JSON object with a `weight_map` object from tensor names to "
            f"file names, as Hugging Face writes it; reading it failed: {e!r}"
        ) from None
    for name in weight_map:
        # No model names a tensor so: the index is damaged (or hostile), and the name would
        # otherwise reach the file system or a C string in a later message's place.
        if "\x00" in name:
            raise ValueError(
                f"{index_path} has an entry whose tensor name {name!r} holds a NUL byte; the "
                "tensor names of an index must not (the file is damaged)."
            )
    return {name: _plain_file_name(index_path, name, file) for name, file in weight_map.items()}


class Maps:
    """Memory maps of a checkpoint's open files, made on first use (thread-safe).

    **Arguments:**

    - `fds`: the open file descriptor of each file, by path; maps are made from these
        descriptors, never by opening a path again (a map duplicates its descriptor, so it
        outlives the checkpoint's own).
    - `access`: `mmap.ACCESS_READ` (read-only, the default) or `mmap.ACCESS_COPY` (private
        copy-on-write: writes into the map never reach the file).
    """

    def __init__(self, fds: Mapping[Path, int], access: int = mmap.ACCESS_READ):
        self._fds = fds
        self._access = access
        self._maps: dict[Path, mmap.mmap] = {}
        self._lock = threading.Lock()

    def _map(self, file: Path) -> mmap.mmap:
        with self._lock:
            if file not in self._maps:
                self._maps[file] = mmap.mmap(self._fds[file], 0, access=self._access)
            return self._maps[file]

    def region(self, file: Path, dtype: np.dtype, count: int, start: int) -> np.ndarray:
        """`count` values of `dtype` from byte `start` of `file`, as a flat view of its map."""
        return np.frombuffer(self._map(file), dtype, count, start)

    def view(self, tensor: Tensor) -> np.ndarray:
        if tensor.stop == tensor.start:
            return np.zeros(tensor.shape, tensor.dtype)
        count = math.prod(tensor.shape)
        return self.region(tensor.file, tensor.dtype, count, tensor.start).reshape(tensor.shape)

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
