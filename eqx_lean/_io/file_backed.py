"""File-backed loading: leaves that are the checkpoint file's own pages, not copies of them.

On CPU, `jax.device_put` uses 64-byte aligned host memory in place. A tensor of a memory-mapped
file whose data starts 64-byte aligned, stored in the dtype asked for, therefore becomes a JAX
array with no copy and no anonymous memory: its pages are the page cache's, read on first use
(as `transformers` reads a checkpoint lazily). A stacked leaf can be so mapped when its layers
are consecutive tensors of one file, in layer order, which is how `eqx_lean.save_stacked`,
`save_tensors` and `save_hf` write every stack that fits in one file.

The maps are private copy-on-write maps (`mmap.ACCESS_COPY`): should anything write into such
an array (XLA may reuse a donated buffer for an output), the pages written become private
anonymous pages of this process, and the file is never changed. The map of a file lives as long
as an array uses it.
"""

import math
import mmap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._platform import ZERO_COPY_ALIGNMENT
from .checks import Leaf, describe_leaf
from .safetensors import Tensor
from .snapshot import Checkpoint


class FileMaps:
    """Private copy-on-write maps of a checkpoint's files, one per file, made on first use."""

    def __init__(self, checkpoint: Checkpoint):
        self._fds = checkpoint.fds
        self._maps: dict[Path, mmap.mmap] = {}

    def map(self, file: Path) -> mmap.mmap:
        if file not in self._maps:
            # The map duplicates the descriptor, so it outlives the checkpoint's own.
            self._maps[file] = mmap.mmap(self._fds[file], 0, access=mmap.ACCESS_COPY)
        return self._maps[file]


_RESAVE = (
    "Load it without `file_backed`, or save the checkpoint again with eqx_lean (`save_hf`, "
    "`save_tensors`, `save_stacked`, with `max_shard_bytes` at least the size of its largest "
    "stacked leaf): those write every stack as consecutive, 64-byte aligned tensors of one file."
)


def _refuse(leaf: Leaf, reason: str, fix: str = _RESAVE) -> ValueError:
    return ValueError(f"`file_backed=True` cannot map leaf {describe_leaf(leaf)}: {reason}. {fix}")


def _device(leaf: Leaf) -> Any:
    sharding = leaf.sharding
    if sharding is None:
        device = jax.devices()[0]
    elif len(sharding.device_set) != 1:
        raise _refuse(
            leaf,
            f"its sharding spreads it over {len(sharding.device_set)} devices, and only an "
            "array on one CPU device can be the file's pages",
        )
    else:
        (device,) = sharding.device_set
    if device.platform != "cpu":
        raise _refuse(
            leaf,
            f"it is placed on a {device.platform} device, and only CPU arrays can be the "
            "file's pages (an accelerator's memory is not the host's)",
            "Load it without `file_backed`.",
        )
    return device


def _region(leaf: Leaf, tensors: Sequence[Tensor], layers: Sequence[int]) -> tuple[Path, int]:
    """The file and start of the one contiguous run of bytes holding `tensors` in order."""
    first = tensors[0]
    for k in range(1, len(tensors)):
        previous, tensor = tensors[k - 1], tensors[k]
        if tensor.file != first.file:
            raise _refuse(
                leaf,
                f"its layers {layers[k - 1]} and {layers[k]} are in two files "
                f"({previous.file.name} and {tensor.file.name})",
            )
        if tensor.start != previous.stop:
            raise _refuse(
                leaf,
                f"its layers {layers[k - 1]} and {layers[k]} are not next to each other in "
                f"{first.file.name} (files written layer by layer, as `transformers` writes "
                "them, hold a stack's layers apart)",
            )
    if first.start % ZERO_COPY_ALIGNMENT:
        raise _refuse(
            leaf,
            f"its data starts at byte {first.start} of {first.file.name}, not a multiple of "
            f"{ZERO_COPY_ALIGNMENT} (JAX copies host data that is not {ZERO_COPY_ALIGNMENT}-byte "
            "aligned)",
        )
    return first.file, first.start


def file_backed_leaf(
    leaf: Leaf, checkpoint: Checkpoint, selected: Sequence[int] | None, maps: FileMaps
) -> jax.Array:
    """The leaf as a JAX array whose memory is its tensors' pages of the checkpoint file.

    **Arguments:**

    - `leaf`: a named leaf of the load, already checked against the checkpoint.
    - `checkpoint`, `selected`: the open checkpoint and the layers loaded (`None`: all).
    - `maps`: the load's file maps.

    **Returns:**

    The array, on one CPU device. Raises `ValueError` naming the leaf when its tensors cannot
    be its memory as they are (a dtype conversion, a transposition, several devices, layers
    out of order or in two files, data not 64-byte aligned).
    """
    name = leaf.name
    assert name is not None
    target = leaf.target
    device = _device(leaf)
    if name.transpose is not None:
        raise _refuse(
            leaf,
            "its tensor is stored transposed, and a transposition is a copy",
            "Load it without `file_backed`.",
        )
    layers = list(selected if selected is not None else range(target.shape[0]))
    if name.stacked:
        tensors = [checkpoint.tensors[name.at(layer)] for layer in layers]
    else:
        tensors = [checkpoint.tensors[name.at(None)]]
    stored = tensors[0].dtype
    if stored != np.dtype(target.dtype):
        raise _refuse(
            leaf,
            f"the checkpoint stores it as {stored} and the load asks for {target.dtype}, and a "
            "conversion is a copy",
            f"Load it as {stored} (the `dtype` it is stored in), or without `file_backed`.",
        )
    count = math.prod(target.shape)
    if count == 0:
        return jax.device_put(np.zeros(target.shape, stored), device)
    file, start = _region(leaf, tensors, layers)
    view = np.frombuffer(maps.map(file), stored, count, start).reshape(target.shape)
    array = jax.device_put(view, device)
    if array.unsafe_buffer_pointer() != view.ctypes.data:
        array.delete()
        raise _refuse(
            leaf,
            f"JAX {jax.__version__} copied the mapped data instead of using it in place",
            "Load it without `file_backed`.",
        )
    return array
