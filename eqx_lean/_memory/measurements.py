"""Measured memory: the peak of what runs inside a `with` block."""

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from .._rss import rss_high_water_mark, sampled_rss_bytes
from .live import live_bytes
from .table import format_bytes, table


class _RssSampler:
    """Samples the resident memory in a background thread, keeping the largest value seen."""

    def __init__(self, interval: float):
        self.interval = interval
        self.peak = sampled_rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eqx_lean-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        rss = sampled_rss_bytes()
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
            ("peak over entry" + exact, format_bytes(self.peak_bytes)),
            ("live arrays before", format_bytes(self.live_bytes_before)),
            ("live arrays after", format_bytes(self.live_bytes_after)),
            ("resident before", format_bytes(self.rss_before)),
            ("resident peak", format_bytes(self.rss_peak)),
            ("resident after", format_bytes(self.rss_after)),
        ]
        if self.device_bytes_before is not None:
            rows += [
                ("device in use before", format_bytes(self.device_bytes_before)),
                ("device in use after", format_bytes(self.device_bytes_after)),
            ]
        return f"{self.backend}, {self.seconds:.2f} s\n" + table(("", "bytes"), rows)

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
    result.live_bytes_before = live_bytes()
    stats_before = _device_stats(devices)
    hwm_before = rss_high_water_mark()
    result.rss_before = sampled_rss_bytes()
    start = time.perf_counter()
    with _RssSampler(interval) as sampler:
        yield result
    result.seconds = time.perf_counter() - start
    result.rss_after = sampled_rss_bytes()
    hwm_after = rss_high_water_mark()
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
    result.live_bytes_after = live_bytes()
