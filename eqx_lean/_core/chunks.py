"""Host data written into preallocated, possibly sharded buffers, in bounded pieces.

The loaders' engine. Buffers are allocated once (`allocate_buffers`), then filled in one of two
ways:

- on CPU (`Tricks.host_writes`), device memory is host memory: each shard of each layer is
  copied with NumPy straight from the file's memory map into the buffer's memory, casting on
  the way. Nothing is compiled and nothing is staged.
- elsewhere, by compiled writes that donate the buffers: each call writes a few rows of every
  buffer of a group (of one layer, for stacked buffers), so a call's values never exceed
  `max_chunk_bytes` (plus one row of each buffer), whatever the size of the largest tensor.
  One program is compiled per group of buffers that share a kind (stacked or not) and a mesh,
  not per buffer, nor per device: on a mesh the write is a `shard_map` in which every device
  writes its own chunk at the same local offsets, so one compiled program serves every device.
"""

import concurrent.futures
import itertools
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import Array

from .. import _platform
from .chunk_plan import (
    BufferPlan,
    ChunkGroup,
    ChunkPart,
    Reader,
    Releaser,
    bounded,
    distinct_shards,
)
from .chunk_writes import (
    compile_chunk_writes as compile_chunk_writes,
    compile_group,
    lower_chunk_write as lower_chunk_write,
    run_chunk_writes,
)
from .writes import allocate, delete_arrays


# Test seam: tests/test_io_load.py, test_io.py and test_plan_estimate.py (and
# benchmarks/io_load.py --writes compiled) switch host writes off.
HOST_WRITES = True
"""Whether buffers on a platform with `Tricks.host_writes` (CPU) are written in place with
NumPy. `False` compiles chunk writes everywhere, as on GPU and TPU: a documented internal switch
for tests and benchmarks of that path on CPU."""


def _regions(plan: BufferPlan) -> tuple[tuple[Any, tuple[slice, ...]], ...]:
    shape = plan.struct.shape
    if plan.sharding is None:
        return ((None, bounded((), shape)),)
    indices = plan.sharding.addressable_devices_indices_map(shape)
    return tuple((device, bounded(index, shape)) for device, index in indices.items())


def _local_shape(plan: BufferPlan) -> tuple[int, ...]:
    if plan.sharding is None:
        return tuple(plan.struct.shape)
    return tuple(plan.sharding.shard_shape(plan.struct.shape))


def _group_key(plan: BufferPlan) -> tuple[Any, ...]:
    if isinstance(plan.sharding, NamedSharding):
        return (plan.stacked, "mesh", plan.sharding.mesh)
    return (plan.stacked, "sharding", plan.sharding)


def _value_struct(plan: BufferPlan, local_value: tuple[int, ...]) -> jax.ShapeDtypeStruct:
    """The global array holding every device's chunk: the buffer's sharding, smaller shape."""
    sharding = plan.sharding
    if not isinstance(sharding, NamedSharding):
        return jax.ShapeDtypeStruct(local_value, plan.source_dtype, sharding=sharding)
    local = _local_shape(plan)
    shape = tuple(
        v * (n // m) if m else v
        for v, n, m in zip(local_value, plan.struct.shape, local, strict=True)
    )
    return jax.ShapeDtypeStruct(shape, plan.source_dtype, sharding=sharding)


def _plan_group(
    plans: Sequence[BufferPlan],
    members: Sequence[int],
    max_chunk_bytes: int,
    host_writes: bool | None,
) -> ChunkGroup:
    first = plans[members[0]]
    stacked = first.stacked
    row_axis = 1 if stacked else 0
    # Bytes per row (every distinct shard: replicas read the same host data once).
    row_bytes, row_counts = [], []
    for j in members:
        local = _local_shape(plans[j])
        distinct = distinct_shards(_regions(plans[j]))
        has_rows = len(local) > row_axis
        rows = local[row_axis] if has_rows else 1
        rest = math.prod(local[row_axis + 1 :]) if has_rows else 1
        row_bytes.append(rest * np.dtype(plans[j].source_dtype).itemsize * distinct)
        row_counts.append(rows if has_rows else 0)
    total = sum(b * max(n, 1) for b, n in zip(row_bytes, row_counts, strict=True))
    calls = max(1, math.ceil(total / max(1, max_chunk_bytes)))
    calls = min(calls, max(row_counts) or 1)  # no more calls than the longest part has rows
    parts = []
    for j, count in zip(members, row_counts, strict=True):
        plan = plans[j]
        local = _local_shape(plan)
        rows = math.ceil(count / calls) if count else 0
        value_local = list(local)
        if stacked:
            value_local[0] = 1
        if count:
            value_local[row_axis] = rows
        value = _value_struct(plan, tuple(value_local))
        parts.append(ChunkPart(j, stacked, _regions(plan), local, rows, value))
    buffers = tuple(
        jax.ShapeDtypeStruct(
            plans[j].struct.shape, plans[j].struct.dtype, sharding=plans[j].sharding
        )
        for j in members
    )
    mesh = first.sharding.mesh if isinstance(first.sharding, NamedSharding) else None
    host = _on_host(first, host_writes)
    return ChunkGroup(stacked, mesh, tuple(parts), calls, buffers, host)


def plan_chunks(
    plans: Sequence[BufferPlan], max_chunk_bytes: int, host_writes: bool | None = None
) -> list[ChunkGroup]:
    """Groups the buffers by kind and mesh, and sizes each group's chunks.

    **Arguments:**

    - `plans`: the buffers to fill.
    - `max_chunk_bytes`: the host bytes (in the source dtype) one call may write, over every
        buffer of its group and every distinct shard; a call writes at least one row of each.
    - `host_writes`: whether groups on a platform with `Tricks.host_writes` (CPU) are written
        in place with NumPy; `False` compiles writes for every group; `None`: `HOST_WRITES`.

    **Returns:**

    The groups, each to be filled by one compiled program.
    """
    by_key: dict[Any, list[int]] = {}
    for j, plan in enumerate(plans):
        if math.prod(plan.struct.shape) == 0:
            continue  # nothing to write: the zeros it is allocated with are its value
        by_key.setdefault(_group_key(plan), []).append(j)
    return [
        _plan_group(plans, members, max_chunk_bytes, host_writes) for members in by_key.values()
    ]


# --- allocation -------------------------------------------------------------------------------


def _on_host(plan: BufferPlan, host_writes: bool | None) -> bool:
    platform = _platform.platform_of([plan.sharding])
    enabled = HOST_WRITES if host_writes is None else host_writes
    return enabled and _platform.Tricks.for_platform(platform).host_writes


def _host_zeros(plans: Sequence[BufferPlan], pool: concurrent.futures.Executor) -> list[Array]:
    """Zero buffers in memory XLA owns (`_platform.host_zeros`): nothing is compiled.

    Each shard is its own `host_zeros`, spread over `pool`'s threads: a fresh buffer's first
    touch (the kernel's page faults, inside PJRT's copy of the zeros) is most of a CPU load's
    time, and two threads fault pages in faster than one (`docs/benchmarks.md`, "The copying
    load against a plain copy").
    """
    specs = [_shard_specs(plan) for plan in plans]
    made = iter(list(pool.map(lambda spec: _platform.host_zeros(*spec), itertools.chain(*specs))))
    buffers = []
    for plan, shards in zip(plans, specs, strict=True):
        pieces = [next(made) for _ in shards]
        if plan.sharding is None:
            buffers.append(pieces[0])
        else:
            shape = plan.struct.shape
            buffers.append(jax.make_array_from_single_device_arrays(shape, plan.sharding, pieces))
    return buffers


def _shard_specs(plan: BufferPlan) -> list[tuple[tuple[int, ...], np.dtype, Any]]:
    """`host_zeros`' arguments for each shard of the buffer (one, uncommitted, if unsharded)."""
    dtype = np.dtype(plan.struct.dtype)
    if plan.sharding is None:
        return [(plan.struct.shape, dtype, None)]
    devices = plan.sharding.addressable_devices_indices_map(plan.struct.shape)
    return [(_local_shape(plan), dtype, device) for device in devices]


def _host_threads() -> int:
    """Threads of the host copies and allocations: the cores, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


def allocate_buffers(plans: Sequence[BufferPlan], host_writes: bool | None = None) -> list[Array]:
    """Zero-filled buffers as `plans` describe them, each with its (full) sharding.

    Where host writes apply (CPU), each buffer is copied from `np.zeros` (in threads, one
    shard each), which compiles nothing; elsewhere one computation per placement (a mesh, a
    sharding, the default device) creates them, each device allocating only its shards.
    """
    buffers: list[Any] = [None] * len(plans)
    on_host = [j for j, plan in enumerate(plans) if _on_host(plan, host_writes)]
    if on_host:
        with concurrent.futures.ThreadPoolExecutor(_host_threads()) as pool:
            made = _host_zeros([plans[j] for j in on_host], pool)
        for j, buffer in zip(on_host, made, strict=True):
            buffers[j] = buffer
    by_placement: dict[Any, list[int]] = {}
    for j, plan in enumerate(plans):
        if buffers[j] is None:
            sharding = plan.sharding
            key = sharding.mesh if isinstance(sharding, NamedSharding) else sharding
            by_placement.setdefault(key, []).append(j)
    for members in by_placement.values():
        made = allocate(
            tuple(plans[j].struct for j in members),
            tuple(plans[j].sharding for j in members),
        )
        for j, buffer in zip(members, made, strict=True):
            buffers[j] = buffer
    return buffers


def _host_views(buffer: Array) -> list[tuple[np.ndarray, tuple[slice, ...]]] | None:
    """A writable view of each addressable shard's memory, with the shard's region."""
    views = []
    for shard in buffer.addressable_shards:
        view = _platform.host_view(shard.data)
        if view is None:
            return None
        views.append((view, bounded(shard.index, buffer.shape)))
    return views


def _copy(task: tuple[np.ndarray, int, int | None, tuple[slice, ...]], read: Reader) -> None:
    destination, buffer, layer, index = task
    np.copyto(destination, read(buffer, layer, index), casting="unsafe")


# Test seam: tests/test_io_load.py makes the pieces tiny, so that every tensor takes several.
_HOST_PIECE_BYTES = 16 * 2**20  # copies are cut into pieces this big, spread over the threads


def _row_pieces(
    task: tuple[np.ndarray, int, int | None, tuple[slice, ...]],
) -> list[tuple[np.ndarray, int, int | None, tuple[slice, ...]]]:
    """A copy cut along its first axis, so that the threads share a large tensor."""
    destination, buffer, layer, index = task
    if destination.ndim == 0 or destination.nbytes <= _HOST_PIECE_BYTES:
        return [task]
    rows = destination.shape[0]
    step = max(1, rows * _HOST_PIECE_BYTES // destination.nbytes)
    first = index[0].start
    return [
        (
            destination[a : a + step],
            buffer,
            layer,
            (slice(first + a, first + min(a + step, rows)), *index[1:]),
        )
        for a in range(0, rows, step)
    ]


def _copy_on_host(
    group: ChunkGroup,
    views: Sequence[list[tuple[np.ndarray, tuple[slice, ...]]]],
    read: Reader,
    release: Releaser,
    pool: concurrent.futures.Executor,
) -> None:
    """Copies every shard of every layer straight into the buffers' memory (CPU only)."""
    members = [p.buffer for p in group.parts]
    for local_layer in range(group.local_layers):
        tasks, layers = [], set()
        for part, shards in zip(group.parts, views, strict=True):
            for view, region in shards:
                if group.stacked:
                    layer = region[0].start + local_layer
                    tasks.append((view[local_layer, ...], part.buffer, layer, region[1:]))
                    layers.add(layer)
                else:
                    tasks.append((view, part.buffer, None, region))
                    layers.add(None)
        pieces = [piece for task in tasks for piece in _row_pieces(task)]
        for done in pool.map(lambda piece: _copy(piece, read), pieces):
            del done
        for layer in sorted(layers, key=lambda x: -1 if x is None else x):
            release(members, layer)


def fill_chunks(
    groups: Sequence[ChunkGroup],
    compiled: Sequence[jax.stages.Compiled | None],
    buffers: list[Array],
    read: Reader,
    release: Releaser,
) -> None:
    """Fills `buffers` (indexed like `plan_chunks`' `plans`, freshly allocated and owned by
    the caller) from `read`, group by group, layer by layer. On failure the buffers are deleted.

    Compiled writes (`chunk_writes.run_chunk_writes`) stage a call's values while the previous call
    runs, so at most two calls' values are alive at once.
    """
    try:
        with concurrent.futures.ThreadPoolExecutor(_host_threads()) as pool:
            for group, write in zip(groups, compiled, strict=True):
                views = None
                if group.host:
                    jax.block_until_ready([buffers[p.buffer] for p in group.parts])
                    views = [_host_views(buffers[p.buffer]) for p in group.parts]
                if views is not None and all(v is not None for v in views):
                    _copy_on_host(group, views, read, release, pool)  # pyright: ignore
                    continue
                write = compile_group(group) if write is None else write
                run_chunk_writes(group, write, buffers, read, release)
    except BaseException:
        delete_arrays(buffers)
        raise
