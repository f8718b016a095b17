"""The memory of a load on a target, planned from the checkpoint's headers and compiled writes."""

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, Sharding, SingleDeviceSharding

from .._core import DtypePolicy, LayerAxis, ShardingPolicy, check_dtype_policy, shard_bytes
from .._core.chunk_plan import BufferPlan, ChunkGroup
from .._core.chunk_writes import ALIGN
from .._core.chunks import lower_chunk_write, plan_chunks
from .._io.checks import check_checkpoint, select_layers
from .._io.load import _CHUNK_BYTES, _plan_leaves
from .._io.snapshot import Checkpoint, opened
from .table import format_bytes, table
from .targets import Target, placed_on, resolve_target


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """The memory a load needs on a target, per device and per process.

    Returned by [`eqx_lean.memory.plan_load`][]; `print` it for a table.

    **Attributes:**

    - `target`: the spec of the target planned for, such as `"8xh100"`.
    - `platform`: `"gpu"`, `"tpu"` or `"cpu"`.
    - `num_devices`: the devices the loaded leaves are placed on.
    - `loaded_bytes`: the loaded leaves in their target dtypes, once each (replicas not
        counted twice).
    - `loaded_bytes_per_device`: the loaded leaves' share on the busiest device.
    - `chunk_temp_bytes`: XLA's temporary bytes per device of each compiled chunk write (one
        per group of buffers), largest first; `()` where every buffer is written by the host
        (CPU: nothing is compiled).
    - `chunk_value_bytes`: the most bytes per device that the values of chunk writes in flight
        hold: two calls' values (one staged while the previous runs).
    - `device_peaks`: the predicted peak of each of `target.devices` (0 for a device that holds
        nothing of the load), in their order.
    - `device_peak`: the busiest device's peak: its loaded bytes plus, for the group whose
        writes cost it most, that write's temporaries and two calls' values.
    - `host_peak`: the host memory one process allocates beyond the page cache while it
        streams: at most the two staging slots of the largest compiled group (see
        [`eqx_lean.memory.plan_load`][]); 0 for host writes.
    - `device_memory`: the bytes one process can use on one device of the target.
    - `fits`: `device_peak <= device_memory`.
    """

    target: str
    platform: str
    num_devices: int
    loaded_bytes: int
    loaded_bytes_per_device: int
    chunk_temp_bytes: tuple[int, ...]
    chunk_value_bytes: int
    device_peaks: tuple[int, ...]
    device_peak: int
    host_peak: int
    device_memory: int
    fits: bool

    def table(self) -> str:
        """The plan as an aligned text table."""
        rows = [
            ("loaded leaves (busiest device)", self.loaded_bytes_per_device),
            ("largest chunk write's XLA temp", max(self.chunk_temp_bytes, default=0)),
            ("chunk values in flight", self.chunk_value_bytes),
            ("device peak", self.device_peak),
            ("device memory", self.device_memory),
            ("host staging per process", self.host_peak),
        ]
        verdict = "fits" if self.fits else "does NOT fit"
        head = (
            f"load plan for {self.target} ({self.num_devices} x {self.platform}): {verdict} "
            f"({format_bytes(self.device_peak)} of {format_bytes(self.device_memory)} per "
            f"device); {format_bytes(self.loaded_bytes)} loaded in all"
        )
        return head + "\n" + table(("", "bytes"), [(n, format_bytes(b)) for n, b in rows])

    def __str__(self) -> str:
        return self.table()


def _on_target(sharding: Sharding | None, where: Target, path: str) -> Sharding:
    placed = placed_on(where, sharding, f"leaf {path}")
    # The loader puts a leaf without a sharding on its default device: the target's first.
    return SingleDeviceSharding(where.devices[0]) if placed is None else placed


def _loaded_per_device(plans: Sequence[BufferPlan]) -> dict[Any, int]:
    loaded: dict[Any, int] = {}
    for buffer in plans:
        assert buffer.sharding is not None
        nbytes = shard_bytes(buffer.struct, buffer.sharding)
        for device in buffer.sharding.device_set:
            loaded[device] = loaded.get(device, 0) + nbytes
    return loaded


def _distinct_bytes(buffer: BufferPlan) -> int:
    """The leaf's bytes once, however many devices hold replicas of its shards."""
    assert buffer.sharding is not None
    indices = buffer.sharding.devices_indices_map(buffer.struct.shape)
    shape = buffer.struct.shape
    shards = {
        tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        for index in indices.values()
    }
    return len(shards) * shard_bytes(buffer.struct, buffer.sharding)


def _group_devices(group: ChunkGroup) -> set[Any]:
    devices: set[Any] = set()
    for buffer in group.buffers:
        devices |= buffer.sharding.device_set
    return devices


def _values_per_device(group: ChunkGroup) -> int:
    """Two calls' values on one device: one staged while the previous call runs."""
    return 2 * sum(shard_bytes(p.value, p.value.sharding) for p in group.parts)


def _staging_bytes(group: ChunkGroup) -> int:
    """`chunk_writes._Staging`'s two slots, each `reserve + ALIGN` bytes, for one group."""
    reserve = sum(p.staged_bytes() for p in group.parts)
    return 2 * (reserve + ALIGN)


def plan_load(
    path: str | os.PathLike | Sequence[str | os.PathLike] | Checkpoint,
    like: Any,
    names: Any,
    *,
    target: Target | str,
    dtype: DtypePolicy = None,
    sharding: ShardingPolicy = None,
    mesh: Mesh | None = None,
    layer_axis: LayerAxis = None,
    layers: int | range | None = None,
    strict: bool = True,
    stacked: bool = False,
) -> LoadPlan:
    """Plans the memory of [`eqx_lean.load_tensors`][] (or `load_stacked`) on a target.

    ```python
    h100s = eqx_lean.memory.target("8xh100")
    mesh = h100s.mesh((8,), ("fsdp",))
    print(eqx_lean.memory.plan_load("Mistral-7B-v0.1/", like, names, target=h100s,
                                    dtype=jnp.bfloat16, sharding=eqx_lean.fsdp(mesh, "fsdp")))
    ```

    Only the checkpoint's headers are read, and checked as the load checks them; no tensor is
    read and nothing is allocated. The load is planned as the loader runs it:

    - every loaded leaf is allocated at once, in its target dtype and sharding: each device
        holds its shards (`loaded_bytes_per_device`);
    - on GPU and TPU, buffers are filled group by group by compiled chunk writes. Each group's
        write is compiled here for the target's devices and its `memory_analysis()` read: while
        a group is written, a device holds every loaded buffer, that write's XLA temporaries
        and at most two calls' values (one call runs while the next is staged). The device
        peak is the loaded bytes plus the costliest group's temporaries and values.
    - on the host, a compiled group stages chunks that are not contiguous in the file (a
        sharded or transposed slice) in two reusable slots, each as large as one call's
        values over every distinct shard the process holds (plus alignment); the rest is read
        from memory maps (the page cache, shared and evictable, not counted). `host_peak` is
        the largest group's two slots, an upper bound: a slot is allocated only when a chunk
        needs it.
    - on CPU, device memory is host memory and buffers are written by the host in place:
        nothing is compiled or staged, and the peak is the loaded bytes.

    It models neither the allocation program's own compilation, nor leaves kept from `like`
    (not loaded: they exist before), nor the device allocator's fragmentation.

    **Arguments:**

    - `path`, `like`, `names`, `dtype`, `sharding`, `mesh`, `layer_axis`, `layers`, `strict`:
        as for [`eqx_lean.load_tensors`][]. Shardings must be on the target's devices (made on
        `target.mesh(...)`); leaves without one are planned on `target.devices[0]`.
    - `target`: a [`eqx_lean.memory.Target`][] or a spec for [`eqx_lean.memory.target`][].
    - `stacked`: plan `load_stacked` (every name must contain `{i}`) instead of
        `load_tensors`.

    **Returns:**

    A [`eqx_lean.memory.LoadPlan`][]; `print` it for a table.
    """
    where = resolve_target(target)
    if not isinstance(strict, bool):
        raise TypeError(f"`strict` must be True or False; got {strict!r}.")
    fn = "load_stacked" if stacked else "load_tensors"
    dtype = check_dtype_policy(dtype)
    _, leaves, num_layers = _plan_leaves(like, names, dtype, sharding, mesh, layer_axis, fn, {})
    selected = select_layers(layers, num_layers)
    plans = []
    with opened(path) as checkpoint:
        check_checkpoint(leaves, checkpoint, selected, layers is not None, strict, fn)
        for leaf in leaves:
            if leaf.name is None:
                continue
            first = leaf.name.at((selected or (None,))[0] if leaf.name.stacked else None)
            stored = checkpoint.tensors[first].dtype
            placed = _on_target(leaf.sharding, where, jax.tree_util.keystr(leaf.path))
            plans.append(BufferPlan(leaf.struct, placed, leaf.name.stacked, stored))
    return _plan(where, plans)


def _temp_bytes(compiled: Any) -> int:
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError("XLA gives no memory analysis for this platform's programs.")
    return stats.temp_size_in_bytes


def _plan(where: Target, plans: Sequence[BufferPlan]) -> LoadPlan:
    groups = plan_chunks(plans, _CHUNK_BYTES)
    compiled = [g for g in groups if not g.host]
    temps = [_temp_bytes(lower_chunk_write(g).compile()) for g in compiled]
    loaded = _loaded_per_device(plans)
    extra: dict[Any, int] = {}  # per device: the costliest group's temporaries and values
    values = 0
    for group, temp in zip(compiled, temps, strict=True):
        in_flight = _values_per_device(group)
        values = max(values, in_flight)
        for device in _group_devices(group):
            extra[device] = max(extra.get(device, 0), temp + in_flight)
    peaks = tuple(loaded.get(d, 0) + extra.get(d, 0) for d in where.devices)
    peak = max(peaks, default=0)
    return LoadPlan(
        target=where.spec,
        platform=where.platform,
        num_devices=max(1, len(loaded)),
        loaded_bytes=sum(_distinct_bytes(buffer) for buffer in plans),
        loaded_bytes_per_device=max(loaded.values(), default=0),
        chunk_temp_bytes=tuple(sorted(temps, reverse=True)),
        chunk_value_bytes=values,
        device_peaks=peaks,
        device_peak=peak,
        host_peak=max((_staging_bytes(g) for g in compiled), default=0),
        device_memory=where.device_memory,
        fits=peak <= where.device_memory,
    )
