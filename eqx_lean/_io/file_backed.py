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

import jax
import numpy as np

from .._platform import ZERO_COPY_ALIGNMENT
from .checks import Leaf, describe_leaf
from .safetensors import Maps, Tensor
from .snapshot import Checkpoint


_RESAVE = (
    "Load it without `file_backed`, or save the checkpoint again with eqx_lean (`save_hf`, "
    "`save_tensors`, `save_stacked`, with `max_shard_bytes` at least the size of its largest "
    "stacked leaf): those write every stack as consecutive, 64-byte aligned tensors of one file."
)


def _refuse(leaf: Leaf, reason: str, fix: str = _RESAVE) -> ValueError:
    return ValueError(f"`file_backed=True` cannot map leaf {describe_leaf(leaf)}: {reason}. {fix}")


def _check_placement(leaf: Leaf) -> None:
    """Refuses a leaf that is not to be on one CPU device."""
    devices = [jax.devices()[0]] if leaf.sharding is None else list(leaf.sharding.device_set)
    if len(devices) != 1:
        raise _refuse(
            leaf,
            f"its sharding spreads it over {len(devices)} devices, and only an array on one "
            "CPU device can be the file's pages",
            "Load it without `file_backed`.",
        )
    if devices[0].platform != "cpu":
        raise _refuse(
            leaf,
            f"it is placed on a {devices[0].platform} device, and only CPU arrays can be the "
            "file's pages (an accelerator's memory is not the host's)",
            "Load it without `file_backed`.",
        )


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


def _file_backed_leaf(
    leaf: Leaf, checkpoint: Checkpoint, selected: Sequence[int] | None, maps: Maps
) -> jax.Array:
    name = leaf.name
    assert name is not None
    struct = leaf.struct
    _check_placement(leaf)
    if name.transpose is not None:
        raise _refuse(
            leaf,
            "its tensor is stored transposed, and a transposition is a copy",
            "Load it without `file_backed`.",
        )
    if name.stacked:
        layers = list(selected if selected is not None else range(struct.shape[0]))
        tensors = [checkpoint.tensors[name.at(layer)] for layer in layers]
    else:
        layers, tensors = [], [checkpoint.tensors[name.at(None)]]
    stored = tensors[0].dtype
    if stored != np.dtype(struct.dtype):
        raise _refuse(
            leaf,
            f"the checkpoint stores it as {stored} and the load asks for {struct.dtype}, and a "
            "conversion is a copy",
            f"Load it as {stored} (the `dtype` it is stored in), or without `file_backed`.",
        )
    count = math.prod(struct.shape)
    if count == 0:
        return jax.device_put(np.zeros(struct.shape, stored), leaf.sharding)
    file, start = _region(leaf, tensors, layers)
    view = maps.region(file, stored, count, start).reshape(struct.shape)
    array = jax.device_put(view, leaf.sharding)
    if array.unsafe_buffer_pointer() != view.ctypes.data:
        array.delete()
        raise _refuse(
            leaf,
            f"JAX {jax.__version__} copied the mapped data instead of using it in place",
            "Load it without `file_backed`.",
        )
    return array


def file_backed_leaves(
    leaves: Sequence[Leaf], checkpoint: Checkpoint, selected: Sequence[int] | None
) -> list[jax.Array]:
    """The leaves as JAX arrays whose memory is their tensors' pages of the checkpoint's files.

    **Arguments:**

    - `leaves`: named leaves of the load, already checked against the checkpoint.
    - `checkpoint`, `selected`: the open checkpoint and the layers loaded (`None`: all).

    **Returns:**

    The arrays, each on its one CPU device as its sharding says (`None`: the default device,
    uncommitted). Raises `ValueError` naming the first leaf whose tensors cannot be its memory
    as they are (a dtype conversion, a transposition, several devices, layers apart or in two
    files, data not 64-byte aligned); the arrays made before it are deleted.
    """
    maps = Maps(checkpoint.fds, access=mmap.ACCESS_COPY)  # each map lives while an array uses it
    arrays: list[jax.Array] = []
    try:
        for leaf in leaves:
            arrays.append(_file_backed_leaf(leaf, checkpoint, selected, maps))
    except BaseException:
        for array in arrays:
            array.delete()
        raise
    return arrays
