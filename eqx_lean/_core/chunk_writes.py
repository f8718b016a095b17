"""The compiled chunk writes of loads, for platforms whose device memory is not host memory.

Each call of a group's compiled write copies a few rows of every buffer of the group (of one
layer, for stacked buffers), staged in reusable aligned host memory, into the donated buffers.
On a mesh the write is a `shard_map` in which every device writes its own rows at the same local
offsets: one program for every device. See `eqx_lean._core.chunks` for the plan it follows.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array

from .. import _platform
from .chunk_plan import ChunkGroup, Reader, Releaser
from .compiled_cache import CompiledCache
from .writes import delete_arrays, update_slice


ALIGN = _platform.ZERO_COPY_ALIGNMENT  # host arrays so aligned are used in place, not copied


def _write_fn(stacked: bool, bit_writes: bool) -> Callable[..., tuple[Array, ...]]:
    def write_chunks(buffers: tuple[Array, ...], values: tuple[Array, ...], offsets: Array):
        # offsets = [layer, start of part 0, start of part 1, ...], in local coordinates.
        updated = []
        for k, (buffer, value) in enumerate(zip(buffers, values, strict=True)):
            index = [offsets[0]] if stacked else []
            if buffer.ndim > len(index):
                index.append(offsets[k + 1])
            index += [jnp.int32(0)] * (buffer.ndim - len(index))
            updated.append(update_slice(buffer, value, index, bit_writes=bit_writes))
        return tuple(updated)

    return write_chunks


_COMPILED = CompiledCache(max_entries=32)


def _tricks(group: ChunkGroup) -> _platform.Tricks:
    return _platform.Tricks.for_platform(_platform.platform_of([b.sharding for b in group.buffers]))


def _offsets_struct(group: ChunkGroup) -> jax.ShapeDtypeStruct:
    sharding = None if group.mesh is None else NamedSharding(group.mesh, PartitionSpec())
    if group.mesh is None and group.buffers[0].sharding is not None:
        sharding = group.buffers[0].sharding
    return jax.ShapeDtypeStruct((1 + len(group.parts),), jnp.int32, sharding=sharding)


def lower_chunk_write(group: ChunkGroup) -> jax.stages.Lowered:
    """The group's write, lowered (for inspection: `memory_analysis()` of its compilation)."""
    tricks = _tricks(group)
    write = _write_fn(group.stacked, tricks.bit_writes)
    if group.mesh is not None:
        specs = tuple(b.sharding.spec for b in group.buffers)
        write = jax.shard_map(
            write,
            mesh=group.mesh,
            in_specs=(specs, specs, PartitionSpec()),
            out_specs=specs,
        )
    values = tuple(p.value for p in group.parts)
    # The buffers keep exactly the shardings they were allocated with.
    out_shardings = tuple(b.sharding for b in group.buffers)
    jitted = jax.jit(write, donate_argnums=0, out_shardings=out_shardings)
    return jitted.lower(group.buffers, values, _offsets_struct(group))


def _compile_key(group: ChunkGroup) -> Any:
    def struct_key(s: jax.ShapeDtypeStruct) -> Any:
        return (s.shape, str(s.dtype), s.sharding)

    return (
        group.stacked,
        group.mesh,
        tuple(struct_key(b) for b in group.buffers),
        tuple(struct_key(p.value) for p in group.parts),
        _tricks(group),
    )


def compile_group(group: ChunkGroup) -> jax.stages.Compiled:
    key = _compile_key(group)
    program = _COMPILED.get(key)
    if program is None:
        program = lower_chunk_write(group).compile()
        _COMPILED.put(key, program)
        _platform.release_freed_host_memory(_tricks(group))
    return program


def compile_chunk_writes(groups: Sequence[ChunkGroup]) -> list[jax.stages.Compiled | None]:
    """Each group's compiled write (None for host writes), reused from earlier loads.

    Call it before allocating the buffers: the compiler's transient memory then never adds to
    the loaded model's.
    """
    return [None if group.host else compile_group(group) for group in groups]


# --- staging host values and filling ----------------------------------------------------------


class _Staging:
    """Reusable, aligned host memory that non-contiguous or unaligned chunks are copied into.

    Two slots alternate: a call's values are staged in one while the previous call, reading
    the other, runs. A slot is allocated on first use, at the size `reserve` asked for.
    """

    def __init__(self) -> None:
        self._slots: list[np.ndarray | None] = [None, None]
        self._used = [0, 0]
        self._size = 0

    def reserve(self, nbytes: int) -> None:
        """Every call from now on stages at most `nbytes` (alignment padding included)."""
        self._size = nbytes

    def reset(self, slot: int) -> None:
        self._used[slot] = 0

    def place(self, slot: int, host: np.ndarray, platform: str) -> np.ndarray:
        aligned = host.ctypes.data % ALIGN == 0 or platform != "cpu"
        if host.flags.c_contiguous and aligned:
            return host  # used in place (on CPU, straight from the page cache)
        start = self._used[slot]
        stop = start + host.nbytes
        memory = self._slots[slot]
        if memory is None or memory.nbytes < max(stop, self._size) + ALIGN:
            if start:  # cannot move what is staged already (a plan too small: not expected)
                return _aligned_copy(host)
            self._slots[slot] = None
            memory = self._slots[slot] = np.empty(max(stop, self._size) + ALIGN, np.uint8)
        offset = -memory.ctypes.data % ALIGN
        staged = memory[offset + start : offset + stop].view(host.dtype).reshape(host.shape)
        np.copyto(staged, host)
        self._used[slot] = stop + (-stop % ALIGN)
        return staged


def _aligned_copy(value: np.ndarray) -> np.ndarray:
    raw = np.empty(value.nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    aligned = raw[start : start + value.nbytes].view(value.dtype).reshape(value.shape)
    np.copyto(aligned, value)
    return aligned


def _call_offsets(group: ChunkGroup, local_layer: int, call: int) -> np.ndarray:
    offsets = [local_layer]
    for part in group.parts:
        if not part.rows:
            offsets.append(0)
            continue
        count = part.local[part.row_axis]
        # The last call of a shorter part writes its last rows again (the same values).
        offsets.append(min(call * part.rows, count - part.rows))
    return np.asarray(offsets, np.int32)


def _values(
    group: ChunkGroup,
    offsets: np.ndarray,
    local_layer: int,
    read: Reader,
    staging: _Staging,
    slot: int,
) -> tuple[tuple[Array, ...], set[int | None]]:
    """One call's values, every device's chunk placed on its device; and the layers read."""
    staging.reset(slot)
    values, layers = [], set()
    for k, part in enumerate(group.parts):
        platform = _platform.platform_of([part.value.sharding])
        staged: dict[Any, np.ndarray] = {}  # one host copy per distinct shard (replicas share)
        pieces = []
        for device, region in part.regions:
            layer = region[0].start + local_layer if part.stacked else None
            within = list(region[1:] if part.stacked else region)
            if part.rows:
                start = within[0].start + int(offsets[k + 1])
                within[0] = slice(start, start + part.rows)
            key = (layer, *((s.start, s.stop) for s in within))
            if key not in staged:
                host = read(part.buffer, layer, tuple(within))
                staged[key] = staging.place(slot, host[None] if part.stacked else host, platform)
                layers.add(layer)
            pieces.append((device, staged[key]))
        if group.mesh is None:
            # One device, or a fully replicated sharding: the one host chunk, everywhere.
            values.append(jax.device_put(pieces[0][1], part.value.sharding))
        else:
            arrays = [jax.device_put(host, device) for device, host in pieces]
            values.append(
                jax.make_array_from_single_device_arrays(
                    part.value.shape, part.value.sharding, arrays
                )
            )
    return tuple(values), layers


def run_chunk_writes(
    group: ChunkGroup,
    write: jax.stages.Compiled,
    buffers: list[Array],
    read: Reader,
    release: Releaser,
) -> None:
    """Runs one group's compiled write, call by call, each call a few rows of every buffer."""
    members = [p.buffer for p in group.parts]
    tricks = _tricks(group)
    staging = _Staging()
    staging.reserve(sum(p.staged_bytes() for p in group.parts))
    previous: tuple[Array, ...] = ()
    step = 0
    for local_layer in range(group.local_layers):
        read_layers: set[int | None] = set()
        for call in range(group.calls):
            offsets = _call_offsets(group, local_layer, call)
            # Staged in the slot of the call before the previous one, which is done.
            values, layers = _values(group, offsets, local_layer, read, staging, step % 2)
            read_layers |= layers
            current = tuple(buffers[j] for j in members)
            jax.block_until_ready(current)  # the previous call is done
            delete_arrays(previous)
            for j, buffer in zip(members, write(current, values, offsets), strict=True):
                buffers[j] = buffer
            previous, step = values, step + 1
        jax.block_until_ready([buffers[j] for j in members])
        for layer in sorted(read_layers, key=lambda x: -1 if x is None else x):
            release(members, layer)
        _platform.release_freed_host_memory(tricks)
    delete_arrays(previous)
