"""Predicted memory of building a stack three ways, from compiled programs only."""

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jaxtyping import PRNGKeyArray

from .. import _core
from .._core import DtypePolicy, ShardingPolicy
from .leaves import LeafReport, leaf_report
from .table import MiB, format_bytes, table


# XLA:CPU draws host memory from glibc, which keeps some of it resident. The constants below are
# the resident memory over idle that fresh processes showed on this project's machine beyond
# XLA's own figures (JAX 0.10.2, glibc 2.36, Mistral-shaped blocks of 120-312 MiB in six
# configurations; `docs/benchmarks.md`). Accelerators allocate from their own pools instead, so
# there the estimate is XLA's figures alone.

# What compiling and running the per-layer writes and the zero-filled allocation leave resident
# once `build_stacked` has trimmed the heap: 31-43 MiB, 38 on average, over six configurations
# of 138-490 MiB twice each (`python benchmarks/estimate_fit.py`, eqx_lean 0.2.0: the writes
# evaluate the traced program and leave about 8 MiB less than 0.1.0's, fitted at 46).
_CPU_BUILD_RETAINED = 38 * MiB
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
    - `leaves`: every leaf's path, shape, built and stored dtypes and sharding, as
        [`eqx_lean.memory.describe`][] reports them.

    With a sharding, `build_stacked_peak` is per device, while the two `filter_vmap` peaks are
    those of running them as written, without a sharding, on one device: the table compares each
    peak with the final size on the same basis, and says which.
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
    leaves: LeafReport

    @property
    def build_stacked_overhead(self) -> int:
        """`build_stacked_peak - final_bytes_per_device`: what building costs beyond the result."""
        return self.build_stacked_peak - self.final_bytes_per_device

    def table(self) -> str:
        """The estimate as an aligned text table, one row per construction method.

        Each row compares a peak with the final size on the same basis: per device for
        `build_stacked`, and, with more than one device, the whole model on one device for the
        `filter_vmap` rows (they run unsharded), in a `basis` column.
        """
        sharded = self.num_devices > 1
        per_device = (self.final_bytes_per_device, f"per device (of {self.num_devices})")
        one_device = (self.final_bytes, "1 device, unsharded")
        rows = [
            ("build_stacked", self.build_stacked_peak, per_device),
            ("filter_vmap, eager", self.filter_vmap_peak, one_device),
            ("filter_jit(filter_vmap)", self.filter_jit_vmap_peak, one_device),
        ]
        body = table(
            ("method",) + ("basis",) * sharded + ("predicted peak", "over final", "peak / final"),
            [
                (name,)
                + (basis,) * sharded
                + (format_bytes(peak), format_bytes(peak - final), f"{peak / final:.2f}x")
                for name, peak, (final, basis) in rows
            ],
        )
        devices = "" if self.num_devices == 1 else f" ({self.num_devices} devices)"
        summary = (
            f"{self.num_layers} layers on {self.platform}{devices}: final "
            f"{format_bytes(self.final_bytes)}"
            + (
                f" ({format_bytes(self.final_bytes_per_device)} per device)"
                if self.final_bytes_per_device != self.final_bytes
                else ""
            )
            + f"; one layer {format_bytes(self.layer_bytes)} and all layers "
            f"{format_bytes(self.construction_bytes)} at construction precision; largest write's "
            f"XLA temp {format_bytes(self.write_temp_bytes[0] if self.write_temp_bytes else 0)}"
        )
        return f"{summary}\n{body}"

    def __repr__(self) -> str:
        return f"MemoryEstimate(\n{self.table()}\n(every leaf's dtypes and sharding: `.leaves`)\n)"


def _num_devices(shardings: Sequence[Sharding | None]) -> int:
    devices = set()
    for sharding in shardings:
        if sharding is not None:
            devices |= sharding.device_set
    return max(1, len(devices))


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


def _first_device(shardings: Sequence[Sharding | None]) -> SingleDeviceSharding | None:
    """Where the unsharded `filter_vmap` rows run: the first device of the build's shardings.

    The first device of the mesh for a named sharding (the lowest id otherwise), so that their
    programs are compiled for the platform the build targets (compile-only devices included);
    `None` (the default device) without a sharding.
    """
    for sharding in shardings:
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return SingleDeviceSharding(sharding.mesh.devices.flat[0])
        if sharding is not None:
            return SingleDeviceSharding(min(sharding.device_set, key=lambda d: d.id))
    return None


# Below this, a dispatched operation's XLA temporaries are not worth a compilation to find out.
_EAGER_TEMP_MIN_OUTPUT = MiB


def _dispatch_key(eqn: Any) -> Any | None:
    """Identifies an operation whose eager dispatch may need temporaries; `None` for the rest."""
    if eqn.effects or sum(_core.struct_bytes(v.aval) for v in eqn.outvars) < _EAGER_TEMP_MIN_OUTPUT:
        return None
    structs = tuple(_core.struct_of(v.aval) for v in eqn.invars if not isinstance(v, jcore.Literal))
    return (eqn.primitive.name, str(eqn.params), structs)


def _lower_dispatch(eqn: Any, device: Sharding | None) -> Any | None:
    """Lowers one operation on its own, as eager JAX dispatches it; `None` if it cannot be."""

    def dispatch(*values):
        it = iter(values)
        args = [v.val if isinstance(v, jcore.Literal) else next(it) for v in eqn.invars]
        return eqn.primitive.bind(*args, **eqn.params)

    structs = [
        _core.struct_of(v.aval, device) for v in eqn.invars if not isinstance(v, jcore.Literal)
    ]
    try:
        return jax.jit(dispatch).lower(*structs)
    except Exception:
        # An operation that only exists inside a larger program: counted without temporaries.
        return None


def _eager_dispatches(jaxpr: Any, device: Sharding | None) -> dict[Any, Any]:
    """Each distinct operation worth compiling on its own, lowered on `device`, by
    `_dispatch_key`."""
    lowered = {}
    for eqn in jaxpr.eqns:
        key = _dispatch_key(eqn)
        if key is not None and key not in lowered:
            lowered[key] = _lower_dispatch(eqn, device)
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
        produced = {
            v: _core.struct_bytes(v.aval) for v in eqn.outvars if not isinstance(v, jcore.DropVar)
        }
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
        _core.struct_bytes(target)
        for target, built in zip(plan.structs, plan.layout.structs, strict=True)
        if target.dtype != built.dtype
    )


# Test seam (of a benchmark): benchmarks/plan_targets.py replaces it to compile and time each
# program in turn.
def _compile_side_by_side(plan: Any, lowered: dict[Any, Any]) -> Any:
    """Compiles `build_stacked`'s writes and every program in `lowered` in parallel threads."""
    # XLA compiles without the GIL; on a few cores this about halves the wait.
    workers = max(1, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        compiled = {name: pool.submit(x.compile) for name, x in lowered.items()}
        writes = pool.submit(_core.compile_writes, plan)
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
    only. Every row is compiled for the devices the build targets, compile-only devices
    included: pass `mesh=target.mesh(...)` (or a sharding on one of `target.devices`) of an
    [`eqx_lean.memory.target`][] to plan for GPUs or TPUs this machine lacks. The `filter_vmap`
    rows run unsharded on one device, so they are compiled for the first device of the build's
    shardings (the mesh's first device), or the default device without a sharding.

    `sharding=None` means what it means for [`eqx_lean.build_stacked`][]: with `mesh=` (or a
    mesh set by `jax.set_mesh`) the build is replicated over that mesh, as
    `sharding=PartitionSpec()` would place it and as JAX places an array created under
    `jax.set_mesh`. So `mesh=target.mesh(...)` alone gives the target's estimate (its
    `platform` says so), the whole stack on every device of the mesh. Pass a sharding such as
    [`eqx_lean.fsdp`][] to spread the stack over the mesh instead.

    On CPU the peaks include a measured allowance for the host memory that compiling and
    glibc's allocator leave resident (`runtime_overhead` for `build_stacked`); they predict the
    resident memory over idle of a fresh process. On accelerators they are XLA's figures alone.
    There the eager row is a lower bound: each dispatched operation is lowered for the target
    and its temporaries read, but it models neither values that Python references keep alive
    nor the fragmentation of the device allocator.

    **Arguments:**

    - `make_layer`, `keys`, `dtype`, `sharding`, `mesh`: as for [`eqx_lean.build_stacked`][].
        `sharding` may also be one sharding on one device of a target.

    **Returns:**

    A [`eqx_lean.memory.MemoryEstimate`][]; `print` it for a table.
    """
    plan = _core.plan_build(make_layer, keys, dtype, sharding, mesh)
    vmapped = _vmapped_leaves(make_layer)
    device = _first_device(plan.shardings)
    key_struct = _core.struct_of(keys, device)
    jaxpr = jax.make_jaxpr(vmapped)(key_struct).jaxpr

    def vmap_and_cast(keys):
        return _cast_leaves(vmapped(keys), plan.structs)

    # The whole jitted program first: it takes longest to compile (37 s of the 92 s of a 7B
    # on a v5e), and the pool compiles in submission order.
    lowered = {
        "jit_vmap": jax.jit(vmap_and_cast).lower(key_struct),
        **_eager_dispatches(jaxpr, device),
    }
    writes, compiled = _compile_side_by_side(plan, lowered)
    jitted = compiled.pop("jit_vmap").memory_analysis()
    dispatch_temps = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
    write_temps = sorted((w.memory_analysis().temp_size_in_bytes for w in writes), reverse=True)

    platform = plan.platform
    on_cpu = platform == "cpu"
    # The layer axis is replicated, so every device holds the same share of each leaf.
    leaves = leaf_report(plan)
    final_per_device = sum(x.nbytes_per_device for x in leaves)
    overhead = _cpu_write_allowance(write_temps) if on_cpu else 0
    build_peak = final_per_device + max(write_temps, default=0) + overhead
    jit_peak = jitted.output_size_in_bytes + jitted.temp_size_in_bytes - jitted.alias_size_in_bytes
    eager_peak = _eager_peak(jaxpr, dispatch_temps, _cast_bytes(plan))
    if on_cpu:
        build_peak = max(build_peak, _CPU_BUILD_COMPILE_PEAK)
        jit_peak += _CPU_JIT_RETAINED
        eager_peak += _CPU_EAGER_RETAINED
    num_layers = int(keys.shape[0])
    layer_bytes = _core.tree_bytes(plan.layout.structs)
    return MemoryEstimate(
        num_layers=num_layers,
        platform=platform,
        num_devices=_num_devices(plan.shardings),
        layer_bytes=layer_bytes,
        construction_bytes=num_layers * layer_bytes,
        final_bytes=sum(x.nbytes for x in leaves),
        final_bytes_per_device=final_per_device,
        write_temp_bytes=tuple(write_temps),
        runtime_overhead=overhead,
        build_stacked_peak=build_peak,
        filter_vmap_peak=eager_peak,
        filter_jit_vmap_temp_bytes=jitted.temp_size_in_bytes,
        filter_jit_vmap_peak=jit_peak,
        leaves=leaves,
    )
