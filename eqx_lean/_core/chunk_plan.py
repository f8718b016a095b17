"""The loaders' plan types: what a buffer to fill is (`BufferPlan`), how its host values are read
(`Reader`, `Releaser`), and how the buffers are grouped and cut into calls (`ChunkGroup`,
`ChunkPart`). `chunks` makes the plan and fills the buffers; `chunk_writes` compiles the writes
a group's plan describes. Both import this module and not each other.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, Sharding

from .. import _platform


class BufferPlan(NamedTuple):
    """One buffer to fill from host data.

    **Attributes:**

    - `struct`: the buffer's full shape and dtype (a stacked buffer has the layer axis first).
    - `sharding`: its full sharding (`None`: the default device, uncommitted).
    - `stacked`: whether the leading axis is the layer axis, filled one layer at a time.
    - `source_dtype`: the dtype of the host values, cast to `struct.dtype` by the write.
    """

    struct: jax.ShapeDtypeStruct
    sharding: Sharding | None
    stacked: bool
    source_dtype: np.dtype


# `read(buffer, layer, index)`: the host values of buffer `buffer` (an index into the plans) at
# `index` (in the buffer's axis order; for a stacked buffer, an index into one layer, whose global
# index is `layer`).
Reader = Callable[[int, int | None, tuple[slice, ...]], np.ndarray]
# `release(buffers, layer)`: the reader will not be asked for that layer of those buffers again.
Releaser = Callable[[Sequence[int], int | None], None]


def bounded(index: Any, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """`index` (a tuple of slices, possibly short or open) with explicit bounds on every axis."""
    index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


class ChunkPart(NamedTuple):
    """One buffer inside a group, as its compiled write sees it."""

    buffer: int  # which buffer: an index into the plans (and the buffers)
    stacked: bool
    regions: tuple[tuple[Any, tuple[slice, ...]], ...]  # (device, its shard of the buffer)
    local: tuple[int, ...]  # every device's shard shape
    rows: int  # rows written per call along `row_axis` (0: no row axis, the whole shard)
    value: jax.ShapeDtypeStruct  # the global value of one call, with its sharding

    @property
    def row_axis(self) -> int:
        return 1 if self.stacked else 0

    def staged_bytes(self) -> int:
        """The most host bytes one call stages for this part (alignment padding included)."""
        distinct = distinct_shards(self.regions)
        itemsize = np.dtype(self.value.dtype).itemsize
        per_shard = (
            math.prod(self.value.sharding.shard_shape(self.value.shape))
            if isinstance(self.value.sharding, NamedSharding)
            else math.prod(self.value.shape)
        )
        return distinct * (per_shard * itemsize + _platform.ZERO_COPY_ALIGNMENT)


class ChunkGroup(NamedTuple):
    stacked: bool
    mesh: Any  # a `Mesh` for named shardings, else None
    parts: tuple[ChunkPart, ...]
    calls: int  # calls per (local) layer
    buffers: tuple[jax.ShapeDtypeStruct, ...]  # with their shardings, for lowering
    host: bool  # filled by host writes (CPU), not by a compiled write

    @property
    def local_layers(self) -> int:
        return self.parts[0].local[0] if self.stacked else 1


def distinct_shards(regions: Sequence[tuple[Any, tuple[slice, ...]]]) -> int:
    """How many distinct shards there are (replicas hold the same one)."""
    return len({tuple((s.start, s.stop) for s in region) for _, region in regions})
