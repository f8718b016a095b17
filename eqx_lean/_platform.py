"""Tricks measured on one platform, applied only to programs compiled for that platform.

Each trick below was introduced for a measurement on XLA:CPU, and is decided per program from
the platform it is compiled for (`Tricks.for_platform`), never globally:

- `fused_threefry`: lower Threefry unrolled (`_threefry`), so random draws fuse into the
  in-place writes. XLA:CPU lowers it as a rolled loop whose state is as large as the draw
  (4x a float32 leaf in temporaries); JAX's GPU and TPU lowerings are unrolled already, and the
  override would add two `while` loops there (for key arithmetic).
- `licm_off`: compile the writes without loop-invariant code motion, which on XLA:CPU hoists
  the fused draw's leaf-sized counters out of the loop over layers and materialises them, where
  the fused write needs a few KiB of temporaries.
- `bit_writes`: write floating rows as unsigned-integer bits; XLA:CPU updates bfloat16 in place
  several times slower than `uint16`.
- `layer_runs`: each call of a compiled write fills a run of layers in a loop, so that XLA:CPU
  allocates (and the kernel zeroes) its temporaries once per run rather than once per layer
  (page faults that were a large part of a build's time). On an H100 target the loop costs a
  copy of the whole donated group for initialisers that change layouts (a QR), so elsewhere
  each call writes one layer, without a loop.
- `trim_host_heap`: `malloc_trim` after each write, so glibc returns XLA:CPU's freed
  temporaries to the system (CPU programs with glibc only: elsewhere temporaries live in the
  device's own pool).
- scan's optimisation barrier (`barrier_on_cpu`): ties the stack to the loop index so XLA:CPU,
  which slices bfloat16 in float32, does not hoist a float32 copy of the whole stack.
  Elsewhere the evidence is mixed (`benchmarks/private_paths.py`): on an H100 target it takes
  a 16-layer `fold` gradient from 33.06 to 17.03 MiB but raises a Llama-8B NF4 LoRA step at
  131,072 tokens from 50.48 to 52.44 GiB; on a v5e it changes neither the first nor an 8B
  bfloat16 step on 4 chips. So it stays CPU-only.
- the per-layer gather's barrier (`gather_barrier`, `_scan.gather`), before its constraints: on
  Auto axes XLA:CPU would otherwise relayout the whole stack's shard to suit the gathered
  slice; on a v5e-4 it lowers an 8B bfloat16 LoRA step's plan by 0.11 GiB per chip, on 4 H100s
  it changes nothing. So CPU and TPU (`GATHER_BARRIER_PLATFORMS`).
- `host_writes`: loads copy file data with NumPy straight into the memory of freshly allocated
  CPU buffers (`host_view`), which is host memory: no compiled write, no staged copy. Elsewhere
  device memory is not host memory, and loads use compiled, donated chunk writes.

One choice is a size rather than a trick, measured on both sides:

- `loss_chunk_bytes`: the float32 logits one chunk of `eqx_lean.nn.linear_cross_entropy` holds
  when its `chunk_bytes` is `None`. On one H200 (CUDA), 64 MiB chunks took 1.87x (float32) and
  1.55x (bfloat16 8B head) the time of the textbook loss, 256 MiB chunks 1.11x and 1.05x: 256
  MiB on GPUs (JAX reports ROCm GPUs as `"gpu"` too; they are unmeasured). On this project's
  CPU a bfloat16 LoRA step with 64 MiB chunks took 0.80x the textbook step's time: 64 MiB on
  CPUs, and on TPUs, where it is unmeasured.
- `mlp_chunk_bytes`: the widest activation of one chunk of the HF decoder's MLP
  (`eqx_lean.nn.positionwise`) when its `mlp_chunk_bytes` is `None`. XLA:CPU holds eleven
  chunk-sized float32 buffers at once in the backward pass of one chunk of a LoRA-adapted
  SwiGLU MLP (it fuses no sum into a product). On this project's CPU, the plan of a
  Llama-3.2-1B-shaped bfloat16 LoRA step at 1 x 8,192 tokens holds 1.84 GiB of temporaries
  with 32 MiB chunks, 1.62 with 16 and 1.55 with 8 (2.97 with one chunk); the adapter
  gradient of a narrow decoder (hidden 256, intermediate 896, float32) at 1 x 16,384 tokens
  627 MiB with 32, 450 with 16, 361 with 8; and the 1B step at 1 x 2,048 (four chunks of
  8 MiB, one of 32) ran no slower with 8 MiB chunks (0.95x): 8 MiB on CPUs. On GPUs and TPUs
  256 MiB (planned for one H100: an 8B's step at 131,072 tokens fits, 50.48 GiB, where
  unchunked it needs 63.11).

A plan made on this machine for another platform (`eqx_lean.memory.plan`) traces its program
with that platform's choices (`tracing_for`): the sizes above are read while tracing, from the
platform of the arrays at hand or, inside a trace, the one being planned for.

The measurements behind each trick are in `docs/benchmarks.md` (every private-JAX path and the
barriers, on and off, for this CPU, an H100 and a v5e, in "Private JAX paths per platform"):
the CPU side in "Building stacked layers" (its list "What brought it there" and the section
"Loop-invariant code motion in the writes"), the H100-target figures that decide the non-CPU
side in "Compiled for an H100 without a GPU" (`benchmarks/gpu_target.py`), the loss's chunks in
"The loss without the logits" (`benchmarks/fused_loss.py`, `benchmarks/fused_loss_gpu.py`).
"""

import contextlib
import contextvars
import ctypes
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.core import Tracer
from jax.sharding import Sharding

from . import _compat, _threefry


LOSS_CHUNK_BYTES = 64 * 2**20
"""`Tricks.loss_chunk_bytes` on CPUs (measured) and TPUs (unmeasured): 64 MiB."""

GPU_LOSS_CHUNK_BYTES = 256 * 2**20
"""`Tricks.loss_chunk_bytes` on GPUs: 256 MiB (measured on one H200)."""

MLP_CHUNK_BYTES = 256 * 2**20
"""`Tricks.mlp_chunk_bytes` on GPUs and TPUs: 256 MiB (planned for one H100)."""

CPU_MLP_CHUNK_BYTES = 8 * 2**20
"""`Tricks.mlp_chunk_bytes` on CPUs: 8 MiB (XLA:CPU's plans and a 1B step's time, measured
here)."""

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class Tricks:
    """Which platform-specific tricks a compiled program gets (see the module docstring)."""

    fused_threefry: bool = False
    licm_off: bool = False
    bit_writes: bool = False
    layer_runs: bool = False
    trim_host_heap: bool = False
    host_writes: bool = False
    loss_chunk_bytes: int = LOSS_CHUNK_BYTES
    mlp_chunk_bytes: int = MLP_CHUNK_BYTES

    @classmethod
    def for_platform(cls, platform: str) -> "Tricks":
        """The tricks measured to help on `platform` (`"cpu"`, `"cuda"`, `"rocm"`, `"tpu"`...)."""
        on_cpu = platform == "cpu"
        return cls(
            fused_threefry=on_cpu,
            licm_off=on_cpu,
            bit_writes=on_cpu,
            layer_runs=on_cpu,
            trim_host_heap=on_cpu and _malloc_trim() is not None,
            host_writes=on_cpu,
            loss_chunk_bytes=(
                GPU_LOSS_CHUNK_BYTES if platform in _GPU_PLATFORMS else LOSS_CHUNK_BYTES
            ),
            mlp_chunk_bytes=CPU_MLP_CHUNK_BYTES if on_cpu else MLP_CHUNK_BYTES,
        )

    def compiler_options(self) -> dict[str, str]:
        """XLA compiler options for `jax.jit(..., compiler_options=...)`."""
        if self.licm_off:
            return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
        return {}


# Test seam: tests/test_platform.py makes every program a GPU's.
# The platform `eqx_lean.memory.plan` is tracing a program for (`tracing_for`), if any.
_planned_for: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "eqx_lean_planned_for", default=None
)


def tricks_of(x: Any) -> "Tricks":
    """The tricks of a program over `x`: its devices' platform's where `x` is an array already
    placed, else (inside a trace) that of `platform_of([])`, the platform traced for."""
    placed = isinstance(x, jax.Array) and not isinstance(x, Tracer)
    return Tricks.for_platform(platform_of([x.sharding] if placed else []))


@contextlib.contextmanager
def tracing_for(platform: str) -> Iterator[None]:
    """Within the block, `platform_of` without shardings answers `platform`: a program traced
    here for another platform's devices (a plan for GPUs made on a CPU) takes that platform's
    choices, as a run there would."""
    token = _planned_for.set(platform)
    try:
        yield
    finally:
        _planned_for.reset(token)


def platform_of(shardings: tuple[Sharding | None, ...] | list[Sharding | None]) -> str:
    """The platform a program over arrays with these shardings runs on (default: the platform
    being planned for, inside `tracing_for`, else the backend's).

    A GPU device reports `"gpu"` (only `"cpu"` selects tricks, so `"cuda"` and `"rocm"` need not
    be told apart here).
    """
    for sharding in shardings:
        if sharding is not None:
            return next(iter(sharding.device_set)).platform
    planned = _planned_for.get()
    return jax.default_backend() if planned is None else planned


def lower(
    traced: jax.stages.Traced, tricks: Tricks, lowering_platforms: tuple[str, ...] | None = None
) -> jax.stages.Lowered:
    """Lowers a traced program, with Threefry unrolled when `tricks.fused_threefry` says so.

    Only the lowering changes: the random values are bitwise those of JAX's own lowering.

    **Arguments:**

    - `traced`: the result of `jax.jit(f).trace(*args)`.
    - `tricks`: the program's tricks, from `Tricks.for_platform`.
    - `lowering_platforms`: as for `jax.stages.Traced.lower` (to lower for a platform that has
        no device here).

    **Returns:**

    The `jax.stages.Lowered` program.
    """
    if tricks.fused_threefry:
        return _compat.lower_with_overrides(traced, _threefry.FUSED_RULES, lowering_platforms)
    return traced.lower(lowering_platforms=lowering_platforms)


# Test seam: tests/test_platform.py records the calls.
@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_host_memory(tricks: Tricks) -> None:
    """Returns memory that glibc's allocator holds but no longer uses to the operating system.

    XLA:CPU's temporaries are freed after every write, but glibc keeps freed heap chunks (and
    raises its mmap threshold after the first large free), so without this the resident size
    creeps up by one write's temporaries every few layers. A no-op unless `tricks` says so.
    """
    trim = _malloc_trim() if tricks.trim_host_heap else None
    if trim is not None:
        trim(0)


def barrier_on(values: Any, platforms: tuple[str, ...]) -> Any:
    """`lax.optimization_barrier(values)` in programs lowered for one of `platforms` (`"cpu"`,
    `"cuda"`, `"rocm"`, `"tpu"`); `values` elsewhere.

    Used inside traces whose platform is not known yet (a user's `jit`): the choice is made
    when the program is lowered.
    """
    barriers = dict.fromkeys(platforms, lax.optimization_barrier)
    return lax.platform_dependent(values, **barriers, default=lambda x: x)


def barrier_on_cpu(values: Any) -> Any:
    """`lax.optimization_barrier(values)` in programs lowered for CPU; `values` elsewhere."""
    return barrier_on(values, ("cpu",))


GATHER_BARRIER_PLATFORMS = ("cpu", "tpu")
"""Where the per-layer gather (`_scan.gather`) puts a barrier before its constraints: XLA:CPU
(a relayout of the whole stack's shard otherwise) and TPUs (a Llama-8B bfloat16 LoRA step on a
v5e-4 plans 5.87 GiB per chip with it, 5.98 without); on 4 H100s the same step plans the same
either way (`benchmarks/private_paths.py`, docs/benchmarks.md "Private JAX paths per
platform")."""


def gather_barrier(values: Any) -> Any:
    """`lax.optimization_barrier(values)` in programs lowered for `GATHER_BARRIER_PLATFORMS`."""
    return barrier_on(values, GATHER_BARRIER_PLATFORMS)


def host_view(array: jax.Array) -> np.ndarray | None:
    """A writable NumPy view of the memory of a single-device CPU array, for `host_writes`.

    JAX arrays are immutable: only a loader that has just allocated `array`, holds its only
    reference and has waited for it to be ready may write through this view, before anyone else
    sees the array. `None` where the memory is not plain row-major host memory (another
    platform, another layout): the caller then writes with a compiled program.
    """
    if len(array.devices()) != 1 or next(iter(array.devices())).platform != "cpu":
        return None
    layout = getattr(getattr(array, "format", None), "layout", None)
    major_to_minor = getattr(layout, "major_to_minor", None)
    if major_to_minor is not None and tuple(major_to_minor) != tuple(range(array.ndim)):
        return None
    dtype = np.dtype(array.dtype)
    if array.size == 0:
        return None
    memory = (ctypes.c_char * (array.size * dtype.itemsize)).from_address(
        array.unsafe_buffer_pointer()
    )
    return np.frombuffer(memoryview(memory), dtype, array.size).reshape(array.shape)


ZERO_COPY_ALIGNMENT = 64
"""PJRT's CPU client uses host memory aligned to this many bytes in place, without a copy
(`jax.device_put` of NumPy data so aligned aliases it, even with `may_alias=False`)."""


# Test seam: tests/test_platform.py forces the aligned offset at which `device_put` aliases.
def _misaligned_offset(address: int, itemsize: int) -> int:
    """An offset from `address` (a multiple of `itemsize`) where data is not 64-byte aligned."""
    return 0 if address % ZERO_COPY_ALIGNMENT else itemsize


def host_zeros(shape: tuple[int, ...], dtype: Any, device: Any) -> jax.Array:
    """A zero CPU array in memory that XLA owns, for `host_writes`; nothing is compiled.

    `jax.device_put` of a NumPy array aliases the array's memory where it can (64-byte aligned
    data, on CPU). A donating computation cannot reuse memory XLA does not own: it silently
    allocates a new output, twice the model at a first training step. So the zeros are given at
    an offset that is not 64-byte aligned, which makes PJRT copy them into its own buffer (from
    untouched pages of `np.zeros`: only the copy's pages become resident). Should a JAX alias
    them anyway, the pointers show it and the array is copied explicitly.

    **Arguments:**

    - `shape`, `dtype`: those of the array.
    - `device`: the `jax.Device` to put it on; `None` for JAX's default device (uncommitted).

    **Returns:**

    The array, which the caller may fill through `host_view` before anyone else sees it.
    """
    # JAX's own dtype (float32 for float64 without x64), so that NumPy's array is not converted
    # into a new, possibly aligned one.
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    size = int(np.prod(shape, dtype=np.int64))
    raw = np.zeros(size * dtype.itemsize + ZERO_COPY_ALIGNMENT, np.uint8)
    offset = _misaligned_offset(raw.ctypes.data, dtype.itemsize)
    zeros = raw[offset : offset + size * dtype.itemsize].view(dtype).reshape(shape)
    array = jax.device_put(zeros, device)
    if size and array.unsafe_buffer_pointer() == zeros.ctypes.data:
        array = jax.device_put(array, device, may_alias=False)
    return array
