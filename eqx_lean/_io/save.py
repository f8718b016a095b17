"""Saving: models with stacked layers to safetensors files, one tensor at a time."""

import json
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
from jax import lax
from jaxtyping import Array

from .._core import Layout, as_bits, is_floating, struct_bytes
from .._core.chunk_plan import bounded
from . import directory, fs, owned
from .carry import OtherWeights
from .names import check_transpose_rank, layer_count, require_all_stacked, resolve_names
from .safetensors import ALIGN, DTYPE_CODES, index_name


class ComputedTensor(jax.ShapeDtypeStruct):
    """A leaf that a save computes as it writes it, one layer at a time: for a value that is
    never held whole, such as a quantised weight written dequantised, with an adapter merged.

    **Arguments:**

    - `shape`, `dtype`: the leaf's, as an array's (a stacked leaf's shape has the layer axis).
    - `read`: `read(layer)` gives layer `layer`'s value as a host array of `shape[1:]` for a
        stacked leaf; `read(None)` the whole value for a plain one. Called once per tensor
        written, at the moment it is written.
    """

    def __init__(self, shape: tuple[int, ...], dtype: Any, read: Callable[[int | None], Any]):
        super().__init__(shape, dtype)
        self.read = read


def _is_saved(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, ComputedTensor)


class _Record(NamedTuple):
    name: str
    leaf: int
    layer: int | None
    inverse: tuple[int, ...] | None  # the transpose taking the leaf's axes to the stored ones
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return struct_bytes(self)


def _inverse(axes: tuple[int, ...] | None) -> tuple[int, ...] | None:
    return None if axes is None else tuple(int(a) for a in np.argsort(axes))


def _plan_records(tree: Any, names: Any, fn: str) -> tuple[list[Any], list[_Record]]:
    layout = Layout.of(tree)
    arrays = jax.tree.leaves(eqx.filter(tree, _is_saved))
    if len(arrays) != len(layout.paths):
        raise TypeError(
            f"`{fn}` needs arrays to write, but the model has `jax.ShapeDtypeStruct` leaves."
        )
    tensor_names = resolve_names(names, layout, fn)
    if fn == "save_stacked":
        require_all_stacked(layout, tensor_names, fn)
    num_layers = layer_count(layout, tensor_names)
    plain: list[_Record] = []
    stacks: list[list[_Record]] = []
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
            layers = range(num_layers or 0)
            stacks.append([_Record(name.at(i), j, i, inverse, dtype, stored) for i in layers])
        else:
            plain.append(_Record(name.at(None), j, None, inverse, dtype, stored))
    # Each stack's layers are consecutive in the file, in layer order, so that a load with
    # `file_backed=True` can use the stack's bytes in place as one array.
    records = plain + [r for stack in stacks for r in stack]
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


def _units(records: Sequence[_Record]) -> list[list[_Record]]:
    """Records grouped into what a file keeps whole: a stack (a leaf's consecutive layer
    records), or one plain tensor."""
    units: list[list[_Record]] = []
    for r in records:
        if r.layer is not None and r.layer > 0 and units and units[-1][-1].leaf == r.leaf:
            units[-1].append(r)
        else:
            units.append([r])
    return units


def _split_files(records: Sequence[_Record], max_shard_bytes: int) -> list[list[_Record]]:
    """Records in order, cut into files of at most `max_shard_bytes` (or one tensor more).

    A stack that fits in a file is never cut: it starts a new file rather than straddle two,
    so that it can be loaded in place (`file_backed`).
    """
    files: list[list[_Record]] = [[]]
    size = 0
    for unit in _units(records):
        unit_bytes = sum(r.nbytes for r in unit)
        if files[-1] and unit_bytes <= max_shard_bytes and size + unit_bytes > max_shard_bytes:
            files.append([])
            size = 0
        for r in unit:  # a stack larger than a file is cut as tensors come
            if files[-1] and size + r.nbytes > max_shard_bytes:
                files.append([])
                size = 0
            files[-1].append(r)
            size += r.nbytes
    return files


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
    """Puts the stacks and tensors whose sizes are multiples of 64 bytes first, so that all of
    them start aligned (and each stack's layers stay consecutive).

    Tensors must be contiguous in a safetensors file (no padding between them), so order is the
    only way to keep their offsets aligned.
    """
    units = _units(records)
    units.sort(key=lambda unit: sum(r.nbytes for r in unit) % ALIGN != 0)
    return [r for unit in units for r in unit]


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
    if isinstance(array, ComputedTensor):
        value = np.asarray(array.read(record.layer))
        expected = array.shape if record.layer is None else array.shape[1:]
        if value.shape != expected or value.dtype != record.dtype:
            raise ValueError(
                f"A computed tensor must give {record.dtype}{list(expected)} for {record.name!r}; "
                f"it gave {value.dtype}{list(value.shape)}."
            )
    elif record.layer is None:
        value = np.asarray(array)
    elif isinstance(array, jax.Array):
        value = _host_layer(array, record.layer, record.dtype)
    else:
        value = np.asarray(array[record.layer])
    if record.inverse is not None:
        value = value.transpose(record.inverse)
    return np.ascontiguousarray(value)


def _file_chunks(records: Sequence[_Record], arrays: Sequence[Any], metadata) -> Iterator[Any]:
    """A safetensors file as buffers: its header, then each tensor, copied to the host in turn."""
    yield _header_bytes(records, metadata)
    for r in records:
        yield _host_tensor(arrays[r.leaf], r).reshape(-1).view(np.uint8)


def _index_bytes(files: Sequence[Sequence[_Record]], file_names: Sequence[str]) -> bytes:
    weight_map = {r.name: f for f, rs in zip(file_names, files, strict=True) for r in rs}
    index = {
        "metadata": {"total_size": sum(r.nbytes for rs in files for r in rs)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    return json.dumps(index, indent=2).encode()


def _check_save_arguments(max_shard_bytes: Any, metadata: Any) -> dict[str, str]:
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


def _check_arrays(tree: Any, arrays: Sequence[Any], fn: str) -> None:
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(eqx.filter(tree, _is_saved))[0]]
    for path, x in zip(paths, arrays, strict=True):
        if not isinstance(x, jax.Array):
            continue
        if x.is_deleted():
            raise ValueError(
                f"`{fn}` must read every array it saves, but the array of leaf "
                f"{jax.tree_util.keystr(path)} has been deleted (donated to a jitted function, "
                "or deleted explicitly). Save the model returned by that function instead. "
                "Nothing was written."
            )
        if not x.is_fully_addressable:
            raise ValueError(
                f"`{fn}` writes from one process, but leaf {jax.tree_util.keystr(path)} is "
                "spread over several processes; save it with Orbax instead (see the Orbax "
                "recipe)."
            )


def _save(
    path: str | os.PathLike,
    tree: Any,
    names: Any,
    options: dict[str, Any],
    fn: str,
) -> None:
    fs.path_argument(path)
    merged = _check_save_arguments(options["max_shard_bytes"], options["metadata"])
    weights_name = owned.check_weights_name(options["weights_name"])
    extra = owned.check_files(options["files"], weights_name)
    arrays, records = _plan_records(tree, names, fn)
    _check_arrays(tree, arrays, fn)
    files = _split_files(records, options["max_shard_bytes"])
    file_names = owned.weight_file_names(weights_name, len(files))
    owns = owned.owner(weights_name, extra)
    planned = directory.plan(path, owns, options["other_weights"])

    def write_owned(new: Path, modes: Mapping[str, int]) -> None:
        for file_name, file_records in zip(file_names, files, strict=True):
            chunks = _file_chunks(_aligned_first(file_records), arrays, merged)
            fs.write_file(new / file_name, chunks, modes.get(file_name))
        if len(files) > 1:
            index = index_name(weights_name)
            fs.write_file(new / index, [_index_bytes(files, file_names)], modes.get(index))
        for name, content in extra.items():
            if isinstance(content, bytes):
                fs.write_file(new / name, [content], modes.get(name))
            else:
                fs.copy_file(content, new / name, modes.get(name, "new"))

    # Arrays are sliced by small jitted functions on the devices holding them: a mesh set with
    # `jax.set_mesh` would make those refuse arrays on one device of it.
    with jax.set_mesh(None):
        directory.replace(planned, write_owned)


def save_tensors(
    path: str | os.PathLike,
    tree: Any,
    names: Any,
    *,
    max_shard_bytes: int = 5 * 10**9,
    metadata: Mapping[str, str] | None = None,
    weights_name: str = "model.safetensors",
    files: Mapping[str, bytes | os.PathLike] | None = None,
    other_weights: OtherWeights = "refuse",
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
    options = dict(
        max_shard_bytes=max_shard_bytes,
        metadata=metadata,
        weights_name=weights_name,
        files=files,
        other_weights=other_weights,
    )
    _save(path, tree, names, options, "save_tensors")


def save_stacked(
    path: str | os.PathLike,
    stacked: Any,
    names: Any,
    *,
    max_shard_bytes: int = 5 * 10**9,
    metadata: Mapping[str, str] | None = None,
    weights_name: str = "model.safetensors",
    files: Mapping[str, bytes | os.PathLike] | None = None,
    other_weights: OtherWeights = "refuse",
) -> None:
    """Saves stacked layers as a safetensors checkpoint with one tensor per layer.

    The files follow Hugging Face's layout: `model.safetensors`, or, past `max_shard_bytes`,
    `model-00001-of-0000N.safetensors` files with a `model.safetensors.index.json`. Each
    tensor is copied to the host and written on its own, so saving needs one layer's tensor of
    memory beyond the model.

    A checkpoint directory is one unit. The save writes the complete new directory beside
    `path` (as `.<name>.tmp-<token>`), flushes it to disk, and swaps it with `path` in one
    atomic step (`renameat2(RENAME_EXCHANGE)` on Linux); only then is the old checkpoint
    deleted. Whenever the process dies, `path` holds exactly the old checkpoint or exactly the
    new one, and if the save raises before the swap, `path` is unchanged and the error's notes
    say so. A `.<name>.tmp-*` directory left by a killed save is never the checkpoint: the next
    save warns about it and [`eqx_lean.remove_leftovers`][] deletes it (each save holds a lock
    on its own until it ends). The new directory keeps the old one's permissions; a symbolic
    link `path` is kept, and the directory it points to replaced. Of two saves to one `path`
    at once, first saves included, the last swap wins.

    Of the old directory's entries, the save owns its weight files and index (any shard count)
    and the `files` it is given, and writes them anew, each with the old file's mode if there
    was one (else `0o666` less the umask, as any new file); anything but a regular file (or a
    link to one) under such a name, a directory say, is refused before any work. It copies
    everything else (tokenizer, `config.json`, README, subdirectories), never through a link,
    except weight files it does not own, which it refuses (see `other_weights`); just before
    the swap it lists the directory again and copies what other processes wrote meanwhile.
    Destinations it cannot replace (the current directory, a mount point, a directory without
    owner write permission) are refused before anything is written. See
    [the I/O guide](../io.md#saving).

    **Arguments:**

    - `path`: the checkpoint directory (a `str` or `os.PathLike`), created if needed.
    - `stacked`: the stacked model, with arrays (on any devices, sharded or not) as leaves.
    - `names`: the tensor-name template of every array leaf, as for
        [`eqx_lean.load_stacked`][] (a function is given one layer's paths): every name must
        contain `{i}`; a leaf named `None` is not saved.
    - `max_shard_bytes`: the largest file to write, in bytes (a single tensor bigger than this
        gets a file of its own). Hugging Face's default is 5 GB.
    - `metadata`: strings to store in every file's header, added to `{"format": "pt"}` (which
        `transformers` requires).
    - `weights_name`: the weight file's name, `model.safetensors` by default; shards are then
        `<stem>-0000k-of-0000n.safetensors` and the index `<weights_name>.index.json` (PEFT
        names adapters `adapter_model.safetensors`).
    - `files`: other files to write into the same directory, in the same atomic step: file
        names to their content (`bytes`) or to a `pathlib.Path` to copy, such as
        `{"config.json": json.dumps(config).encode(), "tokenizer.json": Path("tok.json")}`.
    - `other_weights`: what to do with weight files already in `path` that this save does not
        own (another `*.safetensors`, a `*.bin` or `*.pt` pickle, ...): `"refuse"` (the
        default) raises an error naming them and writes nothing, `"keep"` copies them into the
        new checkpoint, `"drop"` leaves them out (they go with the old checkpoint).

    **Returns:**

    Nothing.
    """
    options = dict(
        max_shard_bytes=max_shard_bytes,
        metadata=metadata,
        weights_name=weights_name,
        files=files,
        other_weights=other_weights,
    )
    _save(path, stacked, names, options, "save_stacked")
