"""Memory before, while and after building: estimates, measurements and live-array reports."""

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import pathlib
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jaxtyping import PRNGKeyArray

from . import _build
from ._policy import DtypePolicy, ShardingPolicy, stacked_sharding


MiB = 2**20
GiB = 2**30


def _format_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An aligned text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        parts = [str(first).ljust(widths[0])]
        parts += [str(x).rjust(w) for x, w in zip(rest, widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


# --- estimate ---------------------------------------------------------------------------------

# XLA:CPU draws host memory from glibc, which keeps some of it resident. The constants below are
# the resident memory over idle that fresh processes showed on this project's machine beyond
# XLA's own figures (JAX 0.10.2, glibc 2.36, Mistral-shaped blocks of 120-312 MiB in six
# configurations; `docs/benchmarks.md`). Accelerators allocate from their own pools instead, so
# there the estimate is XLA's figures alone.

# What compiling and running the per-layer writes and the zero-filled allocation leave resident
# once `build_stacked` has trimmed the heap: 33-64 MiB measured, 46 on average.
_CPU_BUILD_RETAINED = 46 * MiB
# Compiling the writes side by side peaks before any buffer exists: 118-158 MiB measured.
_CPU_BUILD_COMPILE_PEAK = 140 * MiB
# Eager `filter_vmap` compiles one small program per operation it dispatches; what they and the
# allocator leave resident: 62-112 MiB measured, 85 on average.
_CPU_EAGER_RETAINED = 85 * MiB
# What compiling the one jitted program leaves resident: 101-119 MiB measured, 108 on average.
_CPU_JIT_RETAINED = 108 * MiB
# glibc serves allocations up to its largest mmap threshold (32 MiB on 64-bit) from per-thread
# heaps, whose top it keeps after a free (`malloc_trim` trims only the main heap's top). Where a
# write's temporaries are this small, the previous write's were found still resident.
_GLIBC_MMAP_THRESHOLD_MAX = 32 * MiB


def _nbytes(struct: Any) -> int:
    return math.prod(struct.shape) * struct.dtype.itemsize


def _shard_nbytes(struct: jax.ShapeDtypeStruct, sharding: Sharding | None) -> int:
    if sharding is None:
        return _nbytes(struct)
    return math.prod(sharding.shard_shape(struct.shape)) * struct.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Predicted memory of building a stack of layers, three ways, before anything is allocated.

    Returned by [`eqx_lean.memory.estimate`][]; `print` it for a table. All byte counts are
    integers. Peaks are *over idle*: on top of what the process (or device) already holds, such
    as the keys and anything `make_layer` captures.

    **Attributes:**

    - `num_layers`: the number of stacked layers `L`.
    - `platform`: the platform the stack is built on (`"cpu"`, `"gpu"`, `"tpu"`).
    - `num_devices`: how many devices the stack is spread over (1 without a sharding).
    - `layer_bytes`: one layer at construction precision (the dtypes `make_layer` produces).
    - `construction_bytes`: all `L` layers at construction precision: what `filter_vmap` holds
        before it can cast.
    - `final_bytes`: the stacked result in its target dtypes, over all devices.
    - `final_bytes_per_device`: the stacked result's share on the busiest device.
    - `write_temp_bytes`: XLA's temporary bytes per device of each compiled per-layer write of
        `build_stacked`, largest first (from `memory_analysis()`).
    - `runtime_overhead`: the part of `build_stacked_peak` for what compiling and the host
        allocator leave resident beyond XLA's figures; nonzero on CPU only.
    - `build_stacked_peak`: the predicted peak per device of `eqx_lean.build_stacked`.
    - `filter_vmap_peak`: the predicted peak of eager `eqx.filter_vmap(make_layer)(keys)` followed
        by a cast to the target dtypes.
    - `filter_jit_vmap_temp_bytes`: XLA's temporary bytes of the jitted `filter_vmap` and cast.
    - `filter_jit_vmap_peak`: the predicted peak of
        `eqx.filter_jit(lambda k: cast(eqx.filter_vmap(make_layer)(k)))(keys)`.
    """

    num_layers: int
    platform: str
    num_devices: int
    layer_bytes: int
    construction_bytes: int
    final_bytes: int
    final_bytes_per_device: int
    write_temp_bytes: tuple[int, ...]
    runtime_overhead: int
    build_stacked_peak: int
    filter_vmap_peak: int
    filter_jit_vmap_temp_bytes: int
    filter_jit_vmap_peak: int

    @property
    def build_stacked_overhead(self) -> int:
        """`build_stacked_peak - final_bytes_per_device`: what building costs beyond the result."""
        return self.build_stacked_peak - self.final_bytes_per_device

    def table(self) -> str:
        """The estimate as an aligned text table, one row per construction method."""
        final = self.final_bytes_per_device
        rows = [
            ("build_stacked", self.build_stacked_peak),
            ("filter_vmap, eager", self.filter_vmap_peak),
            ("filter_jit(filter_vmap)", self.filter_jit_vmap_peak),
        ]
        body = _table(
            ("method", "predicted peak", "over final", "peak / final"),
            [
                (name, _format_bytes(peak), _format_bytes(peak - final), f"{peak / final:.2f}x")
                for name, peak in rows
            ],
        )
        devices = "" if self.num_devices == 1 else f" ({self.num_devices} devices)"
        summary = (
            f"{self.num_layers} layers on {self.platform}{devices}: final "
            f"{_format_bytes(self.final_bytes)}"
            + (
                f" ({_format_bytes(final)} per device)"
                if self.final_bytes_per_device != self.final_bytes
                else ""
            )
            + f"; one layer {_format_bytes(self.layer_bytes)} and all layers "
            f"{_format_bytes(self.construction_bytes)} at construction precision; largest write's "
            f"XLA temp {_format_bytes(self.write_temp_bytes[0] if self.write_temp_bytes else 0)}"
        )
        return f"{summary}\n{body}"

    def __repr__(self) -> str:
        return f"MemoryEstimate(\n{self.table()}\n)"


def _platform(shardings: Sequence[Sharding | None]) -> str:
    for sharding in shardings:
        if sharding is not None:
            return next(iter(sharding.device_set)).platform
    return jax.devices()[0].platform


def _num_devices(shardings: Sequence[Sharding | None]) -> int:
    devices = set()
    for sharding in shardings:
        if sharding is not None:
            devices |= sharding.device_set
    return max(1, len(devices))


def _final_bytes_per_device(plan: Any) -> int:
    # The layer axis is replicated, so every device holds the same share of each leaf's shards
    # (replicated leaves in full): the first device's share is the busiest one's.
    return sum(
        _shard_nbytes(struct, stacked_sharding(sharding))
        for struct, sharding in zip(plan.structs, plan.shardings, strict=True)
    )


def _cpu_write_allowance(write_temps: Sequence[int]) -> int:
    """Host memory beyond the final stack and the largest write's temporaries, on XLA:CPU."""
    heap_served = [t for t in write_temps if t <= _GLIBC_MMAP_THRESHOLD_MAX]
    return _CPU_BUILD_RETAINED + max(heap_served, default=0)


def _cast_leaves(leaves: Sequence[Any], targets: Sequence[jax.ShapeDtypeStruct]) -> list[Any]:
    return [
        x.astype(t.dtype) if x.dtype != t.dtype else x for x, t in zip(leaves, targets, strict=True)
    ]


def _vmapped_leaves(make_layer: Callable[[PRNGKeyArray], Any]) -> Callable[[Any], list[Any]]:
    def vmapped(keys):
        return jax.tree.leaves(eqx.filter(eqx.filter_vmap(make_layer)(keys), eqx.is_array))

    return vmapped


def _struct_of(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


# Below this, a dispatched operation's XLA temporaries are not worth a compilation to find out.
_EAGER_TEMP_MIN_OUTPUT = MiB


def _dispatch_key(eqn: Any) -> Any | None:
    """Identifies an operation whose eager dispatch may need temporaries; `None` for the rest."""
    if eqn.effects or sum(_nbytes(v.aval) for v in eqn.outvars) < _EAGER_TEMP_MIN_OUTPUT:
        return None
    structs = tuple(_struct_of(v.aval) for v in eqn.invars if not isinstance(v, jcore.Literal))
    return (eqn.primitive.name, str(eqn.params), structs)


def _lower_dispatch(eqn: Any) -> Any | None:
    """Lowers one operation on its own, as eager JAX dispatches it; `None` if it cannot be."""

    def dispatch(*values):
        it = iter(values)
        args = [v.val if isinstance(v, jcore.Literal) else next(it) for v in eqn.invars]
        return eqn.primitive.bind(*args, **eqn.params)

    structs = [_struct_of(v.aval) for v in eqn.invars if not isinstance(v, jcore.Literal)]
    try:
        return jax.jit(dispatch).lower(*structs)
    except Exception:
        # An operation that only exists inside a larger program: counted without temporaries.
        return None


def _eager_dispatches(jaxpr: Any) -> dict[Any, Any]:
    """Each distinct operation worth compiling on its own, lowered, by `_dispatch_key`."""
    lowered = {}
    for eqn in jaxpr.eqns:
        key = _dispatch_key(eqn)
        if key is not None and key not in lowered:
            lowered[key] = _lower_dispatch(eqn)
    return {key: x for key, x in lowered.items() if x is not None}


def _eager_peak(jaxpr: Any, temps: dict[Any, int], cast_bytes: int) -> int:
    """Peak bytes of running `jaxpr` one operation at a time, then casting its outputs.

    Eager `filter_vmap` dispatches each batched operation of the traced program on its own (a
    jitted function such as `jax.random.uniform` as one compiled call): while one runs, its
    inputs, its outputs and its XLA temporaries (`temps`, by `_dispatch_key`) exist together with
    every value still needed later. Inputs and captured constants exist before, so they are not
    counted.
    """
    outputs = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    preexisting = {*jaxpr.invars, *jaxpr.constvars}
    last_use: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, jcore.Var):
                last_use[v] = i
    live: dict[Any, int] = {}
    peak = 0
    for i, eqn in enumerate(jaxpr.eqns):
        produced = {v: _nbytes(v.aval) for v in eqn.outvars if not isinstance(v, jcore.DropVar)}
        temp = temps.get(_dispatch_key(eqn), 0)
        peak = max(peak, sum(live.values()) + sum(produced.values()) + temp)
        live.update(produced)
        for v in [*eqn.invars, *eqn.outvars]:
            if not isinstance(v, jcore.Var) or v in outputs or v in preexisting:
                continue
            if last_use.get(v, -1) <= i:
                live.pop(v, None)
    # The cast makes a copy of each cast leaf while the whole uncast stack still exists.
    return max(peak, sum(live.values()) + cast_bytes)


def _cast_bytes(plan: Any) -> int:
    return sum(
        _nbytes(target)
        for target, built in zip(plan.structs, plan.layout.structs, strict=True)
        if target.dtype != built.dtype
    )


def _compile_side_by_side(plan: Any, keys: Any, make_layer: Any, lowered: dict[Any, Any]) -> Any:
    """Compiles `build_stacked`'s writes and every program in `lowered` in parallel threads."""
    # XLA compiles without the GIL; on a few cores this about halves the wait.
    workers = max(1, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        writes = pool.submit(_build._compile_writes, plan, keys, make_layer)
        compiled = {name: pool.submit(x.compile) for name, x in lowered.items()}
        return writes.result(), {name: f.result() for name, f in compiled.items()}


def estimate(
    make_layer: Callable[[PRNGKeyArray], Any],
    keys: PRNGKeyArray,
    dtype: DtypePolicy = None,
    sharding: ShardingPolicy = None,
    *,
    mesh: Mesh | None = None,
) -> MemoryEstimate:
    """Predicts the memory of building `L` stacked layers, without allocating them.

    Takes exactly the arguments of [`eqx_lean.build_stacked`][] and compares three ways of
    building the same stack:

    - `build_stacked`: the final stack plus the XLA temporaries of the largest compiled
        per-layer write (from `memory_analysis()` of the very executables `build_stacked` runs;
        they are cached, so building afterwards compiles nothing again).
    - `filter_vmap`, eager, then a cast: every layer at construction precision, plus the
        temporaries of the largest operation dispatched (each batched operation is compiled on
        its own and its `memory_analysis()` read), plus the cast copies.
    - `filter_jit(filter_vmap)` with the cast inside: the output plus the temporaries of the one
        compiled program, from its `memory_analysis()`.

    ```python
    keys = jax.random.split(jax.random.key(0), 32)
    print(eqx_lean.memory.estimate(lambda k: Block(config, key=k), keys, jnp.bfloat16))
    ```

    Nothing is executed: `make_layer` is traced on abstract keys and the programs are compiled
    only. On CPU the peaks include a measured allowance for the host memory that compiling and
    glibc's allocator leave resident (`runtime_overhead` for `build_stacked`); they predict the
    resident memory over idle of a fresh process. On accelerators they are XLA's figures.

    **Arguments:**

    - `make_layer`, `keys`, `dtype`, `sharding`, `mesh`: as for [`eqx_lean.build_stacked`][].

    **Returns:**

    A [`eqx_lean.memory.MemoryEstimate`][]; `print` it for a table.
    """
    plan = _build._Plan.make(make_layer, keys, dtype, sharding, mesh)
    vmapped = _vmapped_leaves(make_layer)
    key_struct = _struct_of(keys)
    jaxpr = jax.make_jaxpr(vmapped)(key_struct).jaxpr

    def vmap_and_cast(keys):
        return _cast_leaves(vmapped(keys), plan.structs)

    lowered = {**_eager_dispatches(jaxpr), "jit_vmap": jax.jit(vmap_and_cast).lower(key_struct)}
    writes, compiled = _compile_side_by_side(plan, keys, make_layer, lowered)
    jitted = compiled.pop("jit_vmap").memory_analysis()
    dispatch_temps = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
    write_temps = sorted((w.memory_analysis().temp_size_in_bytes for w in writes), reverse=True)

    platform = _platform(plan.shardings)
    on_cpu = platform == "cpu"
    final_per_device = _final_bytes_per_device(plan)
    overhead = _cpu_write_allowance(write_temps) if on_cpu else 0
    build_peak = final_per_device + max(write_temps, default=0) + overhead
    jit_peak = jitted.output_size_in_bytes + jitted.temp_size_in_bytes - jitted.alias_size_in_bytes
    eager_peak = _eager_peak(jaxpr, dispatch_temps, _cast_bytes(plan))
    if on_cpu:
        build_peak = max(build_peak, _CPU_BUILD_COMPILE_PEAK)
        jit_peak += _CPU_JIT_RETAINED
        eager_peak += _CPU_EAGER_RETAINED
    num_layers = int(keys.shape[0])
    layer_bytes = sum(_nbytes(s) for s in plan.layout.structs)
    return MemoryEstimate(
        num_layers=num_layers,
        platform=platform,
        num_devices=_num_devices(plan.shardings),
        layer_bytes=layer_bytes,
        construction_bytes=num_layers * layer_bytes,
        final_bytes=sum(_nbytes(s) for s in plan.structs),
        final_bytes_per_device=final_per_device,
        write_temp_bytes=tuple(write_temps),
        runtime_overhead=overhead,
        build_stacked_peak=build_peak,
        filter_vmap_peak=eager_peak,
        filter_jit_vmap_temp_bytes=jitted.temp_size_in_bytes,
        filter_jit_vmap_peak=jit_peak,
    )


# --- measure ----------------------------------------------------------------------------------


def _physical_nbytes(x: jax.Array) -> int:
    """Bytes an array occupies over all its devices: each shard, replicas counted separately."""
    sharding = x.sharding
    shard = math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
    return shard * len(sharding.device_set)


def _live_arrays() -> list[jax.Array]:
    return [x for x in jax.live_arrays() if not x.is_deleted()]


def _live_bytes() -> int:
    return sum(_physical_nbytes(x) for x in _live_arrays())


_PAGE_SIZE = resource.getpagesize()


def _rss_bytes() -> int | None:
    """This process's resident memory now, from `/proc/self/statm`; `None` without `/proc`."""
    try:
        fields = pathlib.Path("/proc/self/statm").read_text().split()
    except OSError:
        return None
    return int(fields[1]) * _PAGE_SIZE


def _rss_high_water_mark() -> int:
    """The largest resident memory this process has had (`VmHWM`, else `ru_maxrss`)."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kibibytes, macOS bytes.
    return maxrss if sys.platform == "darwin" else maxrss * 1024


class _RssSampler:
    """Samples the resident memory in a background thread, keeping the largest value seen."""

    def __init__(self, interval: float):
        self.interval = interval
        self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eqx_lean-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        rss = _rss_bytes()
        if rss is not None and (self.peak is None or rss > self.peak):
            self.peak = rss

    def __enter__(self) -> "_RssSampler":
        if self.peak is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sample()


def _device_stats(devices: Sequence[Any]) -> list[dict[str, Any]] | None:
    stats = [d.memory_stats() for d in devices]
    if any(s is None or "bytes_in_use" not in s for s in stats):
        return None
    return stats


@dataclasses.dataclass
class Measurement:
    """What [`eqx_lean.memory.measure`][] recorded; filled in when its block exits.

    All byte counts are integers, `None` where the platform does not provide them.

    **Attributes:**

    - `backend`: the default backend (`"cpu"`, `"gpu"`, `"tpu"`).
    - `seconds`: wall time spent inside the block.
    - `peak_bytes`: the peak over entry: on GPU/TPU, the largest per-device
        `peak_bytes_in_use` at exit minus that device's `bytes_in_use` at entry; on CPU, the
        peak resident memory inside the block minus the resident memory at entry.
    - `peak_is_exact`: `False` when `peak_bytes` is only an upper bound: a device's
        `peak_bytes_in_use` cannot be reset, so if it was set before the block and not exceeded
        inside, the block's own peak is lower; on CPU, when the peak came from sampling rather
        than from a new high-water mark.
    - `rss_before`, `rss_peak`, `rss_after`: the process's resident memory at entry, at its
        peak inside the block, and at exit.
    - `device_bytes_before`, `device_bytes_after`: `bytes_in_use` summed over the local devices
        at entry and exit (GPU/TPU only).
    - `live_bytes_before`, `live_bytes_after`: bytes of the live JAX arrays
        (`jax.live_arrays()`) at entry and exit, over all devices.
    """

    backend: str
    seconds: float = math.nan
    peak_bytes: int | None = None
    peak_is_exact: bool = False
    rss_before: int | None = None
    rss_peak: int | None = None
    rss_after: int | None = None
    device_bytes_before: int | None = None
    device_bytes_after: int | None = None
    live_bytes_before: int = 0
    live_bytes_after: int = 0

    def table(self) -> str:
        """The measurement as an aligned text table."""
        exact = "" if self.peak_is_exact else " (upper bound)"
        rows = [
            ("peak over entry" + exact, _format_bytes(self.peak_bytes)),
            ("live arrays before", _format_bytes(self.live_bytes_before)),
            ("live arrays after", _format_bytes(self.live_bytes_after)),
            ("resident before", _format_bytes(self.rss_before)),
            ("resident peak", _format_bytes(self.rss_peak)),
            ("resident after", _format_bytes(self.rss_after)),
        ]
        if self.device_bytes_before is not None:
            rows += [
                ("device in use before", _format_bytes(self.device_bytes_before)),
                ("device in use after", _format_bytes(self.device_bytes_after)),
            ]
        return f"{self.backend}, {self.seconds:.2f} s\n" + _table(("", "bytes"), rows)

    def __repr__(self) -> str:
        return f"Measurement(\n{self.table()}\n)"


@contextlib.contextmanager
def measure(*, interval: float = 0.002) -> Iterator[Measurement]:
    """Records the peak memory of what runs inside a `with` block.

    ```python
    with eqx_lean.memory.measure() as m:
        blocks = eqx_lean.build_stacked(make_block, keys, jnp.bfloat16)
        jax.block_until_ready(blocks)
    print(m.peak_bytes, m)
    ```

    JAX dispatches asynchronously: block on the results inside the `with` block, or the work
    may finish after it.

    - On GPU and TPU the peak comes from `device.memory_stats()`: `peak_bytes_in_use` at exit
        minus `bytes_in_use` at entry, the largest over the local devices. XLA offers no way to
        reset `peak_bytes_in_use`, so when the device's all-time peak was reached before the
        block, the figure is an upper bound and `peak_is_exact` is `False`. (JAX preallocates
        75 % of GPU memory unless `XLA_PYTHON_CLIENT_PREALLOCATE=false`; `bytes_in_use` counts
        what XLA uses inside that pool.)
    - On CPU the peak is the process's resident memory (RSS) over its value at entry. A thread
        reads `/proc/self/statm` every `interval` seconds; if the process's high-water mark
        (`VmHWM`, or `ru_maxrss` off Linux) rises inside the block, the peak is that mark,
        exact. Otherwise the block stayed below an earlier peak and the sampled maximum is used:
        it can miss a spike shorter than `interval`. Without `/proc` (macOS), only the
        high-water mark is available.
    - On every backend it records the bytes of live JAX arrays (`jax.live_arrays()`) at entry
        and exit, which shows what the block left allocated.

    **Arguments:**

    - `interval`: seconds between two samples of the resident memory.

    **Returns:**

    A context manager whose `as` target is a [`eqx_lean.memory.Measurement`][], filled in when
    the block exits.
    """
    if not interval > 0:
        raise ValueError(f"`interval` must be a positive number of seconds; got {interval!r}.")
    devices = jax.local_devices()
    result = Measurement(backend=jax.default_backend())
    result.live_bytes_before = _live_bytes()
    stats_before = _device_stats(devices)
    hwm_before = _rss_high_water_mark()
    result.rss_before = _rss_bytes()
    start = time.perf_counter()
    with _RssSampler(interval) as sampler:
        yield result
    result.seconds = time.perf_counter() - start
    result.rss_after = _rss_bytes()
    hwm_after = _rss_high_water_mark()
    rose = hwm_after > hwm_before
    result.rss_peak = hwm_after if rose else sampler.peak
    stats_after = _device_stats(devices)
    if stats_before is not None and stats_after is not None:
        result.device_bytes_before = sum(s["bytes_in_use"] for s in stats_before)
        result.device_bytes_after = sum(s["bytes_in_use"] for s in stats_after)
        peaks = [
            (
                after.get("peak_bytes_in_use", 0) - before["bytes_in_use"],
                after.get("peak_bytes_in_use", 0) > before.get("peak_bytes_in_use", 0),
            )
            for before, after in zip(stats_before, stats_after, strict=True)
        ]
        result.peak_bytes, result.peak_is_exact = max(peaks)
    elif result.rss_peak is not None and result.rss_before is not None:
        result.peak_bytes = result.rss_peak - result.rss_before
        result.peak_is_exact = rose
    result.live_bytes_after = _live_bytes()


# --- live arrays ------------------------------------------------------------------------------


def _describe_sharding(sharding: Sharding) -> str:
    if isinstance(sharding, SingleDeviceSharding):
        (device,) = sharding.device_set
        return f"{device.platform}:{device.id}"
    if isinstance(sharding, NamedSharding):
        mesh = ", ".join(f"{name}={size}" for name, size in sharding.mesh.shape.items())
        return f"{sharding.spec} over ({mesh})"
    return f"{type(sharding).__name__} over {len(sharding.device_set)} devices"


@dataclasses.dataclass(frozen=True)
class LiveArrayGroup:
    """Live arrays that share a shape, a dtype and a sharding.

    **Attributes:**

    - `shape`, `dtype`: of each array.
    - `sharding`: a short description of their sharding (`"cpu:0"`, a `PartitionSpec` and mesh).
    - `count`: how many such arrays are alive.
    - `nbytes`: their bytes together, over all devices (replicas counted).
    """

    shape: tuple[int, ...]
    dtype: str
    sharding: str
    count: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class LiveArrayReport:
    """The live JAX arrays, grouped and sorted by bytes; from [`eqx_lean.memory.live_arrays`][].

    **Attributes:**

    - `groups`: the largest groups, largest first.
    - `count`, `nbytes`: all live arrays, including groups left out of `groups`.
    - `omitted`: how many groups were left out.
    """

    groups: tuple[LiveArrayGroup, ...]
    count: int
    nbytes: int
    omitted: int

    def table(self) -> str:
        """The report as an aligned text table."""
        rows = [
            (f"{g.dtype}{list(g.shape)}", g.sharding, str(g.count), _format_bytes(g.nbytes))
            for g in self.groups
        ]
        body = _table(("array", "sharding", "count", "bytes"), rows)
        more = f" ({self.omitted} smaller groups not shown)" if self.omitted else ""
        return f"{self.count} live arrays, {_format_bytes(self.nbytes)}{more}\n{body}"

    def __repr__(self) -> str:
        return f"LiveArrayReport(\n{self.table()}\n)"


def live_arrays(*, top: int | None = 20) -> LiveArrayReport:
    """Reports the live JAX arrays grouped by shape, dtype and sharding, largest first.

    For finding leaks: call it before and after a step and compare, or look for arrays that
    should have been freed (such as a float32 copy of a model that lives in bfloat16).

    ```python
    print(eqx_lean.memory.live_arrays(top=10))
    ```

    **Arguments:**

    - `top`: how many groups to keep (the largest by bytes); `None` keeps all.

    **Returns:**

    A [`eqx_lean.memory.LiveArrayReport`][]; `print` it for a table.
    """
    if top is not None and (not isinstance(top, int) or top < 0):
        raise ValueError(f"`top` must be a non-negative integer or None; got {top!r}.")
    counts: dict[tuple[tuple[int, ...], str, str], list[int]] = {}
    arrays = _live_arrays()
    for x in arrays:
        key = (tuple(x.shape), str(x.dtype), _describe_sharding(x.sharding))
        entry = counts.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += _physical_nbytes(x)
    groups = sorted(
        (
            LiveArrayGroup(shape, dtype, sharding, count, nbytes)
            for (shape, dtype, sharding), (count, nbytes) in counts.items()
        ),
        key=lambda g: (-g.nbytes, -g.count, g.dtype, g.shape),
    )
    kept = groups if top is None else groups[:top]
    return LiveArrayReport(
        groups=tuple(kept),
        count=len(arrays),
        nbytes=sum(g.nbytes for g in groups),
        omitted=len(groups) - len(kept),
    )
