"""Allocation and donated in-place writes: the engine under build, load, stack and estimate.

A build is planned (`plan_build`: the traced program, the target dtypes and shardings, the
groups of leaves each compiled write returns), compiled (`compile_writes`, reused by content
through `compiled_cache.CompiledCache`), then run on preallocated buffers (`run_writes`; inside
an outer trace, `build_in_trace`).
"""

import concurrent.futures
import functools
import os
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, Sharding
from jaxtyping import Array

from .. import _compat, _platform
from .compiled_cache import CompiledCache, on_clear, settings_key
from .dtypes import DtypePolicy, check_dtype_policy, is_floating
from .layout import (
    Layout,
    Structs,
    layer_struct,
    leaf_groups,
    num_layers_of_keys,
    stacked_structs,
    tree_bytes,
    zeros_like_struct as zeros_like_struct,
)
from .program import LayerProgram, has_tracers, trace_layer
from .sharding import (
    ShardingPolicy,
    constrain,
    explicit_part,
    has_explicit_axes,
    resolve_shardings,
    stacked_sharding,
)


Leaves = tuple[Array, ...]
Shardings = tuple[Sharding | None, ...]

# The compiled writes of builds, by content (`compile_writes`' key).
WRITES = CompiledCache()


# --- allocation -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _zeros(structs: Structs, shardings: Shardings) -> Callable[[], Leaves]:
    # Created under `jit` with its output shardings, each device allocates only its shards.
    return jax.jit(
        lambda: tuple(zeros_like_struct(s) for s in structs), out_shardings=tuple(shardings)
    )


on_clear(_zeros.cache_clear)


def allocate(structs: Structs, shardings: Shardings) -> Leaves:
    """Zero-filled buffers of `structs`, each created directly with its (full) sharding."""
    return _zeros(tuple(structs), tuple(shardings))()


def delete_arrays(arrays: Sequence[Any]) -> None:
    """Frees the buffers of `arrays` now (on failure paths, so a half-built model costs nothing)."""
    for x in arrays:
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


# --- writing rows -----------------------------------------------------------------------------


def as_bits(x: Array) -> Array:
    """`x` reinterpreted as unsigned integers of the same width (a free bitcast)."""
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def update_slice(buffer: Array, value: Array, index: Sequence[Any], *, bit_writes: bool) -> Array:
    """`buffer` with the block at `index` (one start per dimension) set to `value`, cast.

    With `bit_writes` (XLA:CPU: it updates bfloat16 in place several times slower than unsigned
    integers of the same width), floating values are moved as bits; the bitcasts are free and
    keep a donated buffer aliased.
    """
    value = value.astype(buffer.dtype)
    if not (bit_writes and is_floating(buffer.dtype)):
        return lax.dynamic_update_slice(buffer, value, tuple(index))
    updated = lax.dynamic_update_slice(as_bits(buffer), as_bits(value), tuple(index))
    return lax.bitcast_convert_type(updated, buffer.dtype)


def update_rows(buffer: Array, value: Array, start: Any, *, bit_writes: bool) -> Array:
    """`buffer` with rows `start : start + len(value)` of its leading axis set to `value`, cast
    (moved as bits with `bit_writes`, see `update_slice`)."""
    index = (start, *(0,) * (buffer.ndim - 1))
    return update_slice(buffer, value, index, bit_writes=bit_writes)


def write_slice(buffer: Array, value: Array, index: Any, *, bit_writes: bool) -> Array:
    """`buffer` with slice `index` of its leading axis set to `value` cast to its dtype."""
    if buffer.weak_type:
        # dynamic_update_slice always returns a strong type; a select of weak operands keeps
        # the weak type (weakly typed leaves are small: scalars broadcast from Python numbers).
        is_slice = lax.broadcasted_iota(jnp.int32, buffer.shape, 0) == index
        return jnp.where(is_slice, value[None], buffer)
    return update_rows(buffer, value[None], index, bit_writes=bit_writes)


@functools.partial(jax.jit, donate_argnums=0, static_argnames="bit_writes")
def _write_slice_donated(buffer: Array, value: Array, index: Any, bit_writes: bool) -> Array:
    return write_slice(buffer, value, index, bit_writes=bit_writes)


def _bit_writes_for(buffer: jax.Array) -> bool:
    return _platform.Tricks.for_platform(_platform.platform_of([buffer.sharding])).bit_writes


def write_layer(buffer: jax.Array, value: Any, index: int) -> jax.Array:
    """Writes `value` as slice `index` of `buffer`'s leading axis, donating `buffer`."""
    return _write_slice_donated(buffer, value, index, bit_writes=_bit_writes_for(buffer))


def _in_threads(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    # XLA compiles without the GIL, so independent programs compile side by side.
    workers = max(1, min(len(items), os.cpu_count() or 1))
    if workers == 1:
        return [fn(x) for x in items]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


# --- building: the plan -----------------------------------------------------------------------


class WriteGroup(NamedTuple):
    """Which leaves one compiled write builds, and their per-layer shardings."""

    leaves: tuple[int, ...]
    shardings: Shardings


class BuildPlan(NamedTuple):
    """Everything `build_stacked` derives from its arguments before it allocates."""

    program: LayerProgram
    num_layers: int
    keys: jax.ShapeDtypeStruct
    structs: Structs  # the stacked leaves, in their target dtypes
    shardings: Shardings  # per layer (the layer axis is replicated)
    groups: tuple[WriteGroup, ...]

    @property
    def layout(self) -> Layout:
        return self.program.layout

    @property
    def platform(self) -> str:
        return _platform.platform_of(self.shardings)

    def stacked_shardings(self) -> Shardings:
        return tuple(stacked_sharding(s) for s in self.shardings)

    def buffer_structs(self, group: WriteGroup) -> Structs:
        return tuple(
            jax.ShapeDtypeStruct(
                self.structs[j].shape,
                self.structs[j].dtype,
                weak_type=self.structs[j].weak_type,
                sharding=stacked_sharding(self.shardings[j]),
            )
            for j in group.leaves
        )


def _keys_struct(keys: Any) -> jax.ShapeDtypeStruct:
    # No sharding: keys made by `jax.random.split` are uncommitted and follow the buffers.
    return jax.ShapeDtypeStruct(keys.shape, keys.dtype)


def plan_build(
    make_layer: Callable[[Any], Any],
    keys: Any,
    dtype: DtypePolicy = None,
    sharding: ShardingPolicy = None,
    mesh: Mesh | None = None,
) -> BuildPlan:
    """Traces `make_layer` and resolves the dtype and sharding of every leaf; allocates nothing."""
    num_layers = num_layers_of_keys(keys)
    dtype = check_dtype_policy(dtype)
    key = layer_struct(keys)
    program = trace_layer(make_layer, key)
    layout = program.layout
    shardings = resolve_shardings(sharding, mesh, layout.paths, layout.structs, layout.treedef)
    explicit = [s for s in shardings if has_explicit_axes(s)]
    if explicit:
        # The writes build a layer inside `auto_axes`: its equations must be traced in that
        # context (a jaxpr records the mesh it was traced under, and is evaluated under it).
        mesh_axes = cast(NamedSharding, explicit[0]).mesh.abstract_mesh
        auto = mesh_axes.update_axis_types({name: AxisType.Auto for name in mesh_axes.axis_names})
        with jax.sharding.use_abstract_mesh(auto):
            program = trace_layer(make_layer, key)
    groups = tuple(
        WriteGroup(leaves, tuple(shardings[j] for j in leaves))
        for leaves in leaf_groups(layout.structs)
    )
    structs = stacked_structs(layout, num_layers, dtype)
    return BuildPlan(program, num_layers, _keys_struct(keys), structs, shardings, groups)


def is_traced(plan: BuildPlan, keys: Any) -> bool:
    """Whether the build runs inside a trace (so it must be traced too, not run)."""
    return has_tracers(keys, plan.program.consts)


# --- building: the compiled writes ------------------------------------------------------------


def _write_run(
    jaxpr: Any, embedded: tuple[Any, ...], group: WriteGroup, bit_writes: bool, loop: bool = True
) -> Callable[..., Leaves]:
    """`run(buffers, keys, consts, start, stop)`: writes layers `start..stop-1` of one group.

    Without `loop`, it writes layer `start` alone (callers then pass `stop = start + 1`).

    Closes over the jaxpr and host copies of the embedded constants (`embedded`, `None` where a
    constant is an argument), never the user's arrays: `consts` are the other constants.
    """
    explicit = any(has_explicit_axes(s) for s in group.shardings)

    def write(buffers: Leaves, keys: Any, consts: Any, index: Any) -> Leaves:
        supply = iter(consts)
        values = [next(supply) if e is None else e for e in embedded]
        # A literal output (a constant leaf) comes back as a Python or NumPy scalar.
        leaves = [
            jnp.asarray(x)
            for x in jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, values))(keys[index])
        ]
        return tuple(
            # Constraining the fresh leaf makes each device build only its shard of it.
            write_slice(
                buffer,
                constrain(leaves[j], s, inside_auto_axes=explicit),
                index,
                bit_writes=bit_writes,
            )
            for buffer, j, s in zip(buffers, group.leaves, group.shardings, strict=True)
        )

    if explicit:
        # With Explicit mesh axes, a layer built outside `auto_axes` would be replicated first.
        # On a mesh mixing Explicit and Auto axes, the types name the Explicit ones only.
        out_sharding = tuple(
            explicit_part(cast(NamedSharding, stacked_sharding(s))) for s in group.shardings
        )
        write = cast(Any, jax.sharding.auto_axes(write, out_sharding=out_sharding))

    # Named for compile logs (`jax.log_compiles`) and profiles.
    def write_layers(buffers: Leaves, keys: Any, consts: Any, start: Any, stop: Any) -> Leaves:
        if not loop:
            return write(buffers, keys, consts, start)
        return lax.fori_loop(start, stop, lambda i, b: write(b, keys, consts, i), buffers)

    return write_layers


def _const_sharding(plan: BuildPlan) -> Sharding | None:
    """Where the closed-over arrays go: replicated where the stack lives (default: unplaced)."""
    for sharding in plan.shardings:
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
        if sharding is not None:
            return sharding
    return None


def placed_consts(plan: BuildPlan) -> tuple[Any, ...]:
    """The program's constants, on the devices its compiled writes expect them."""
    sharding = _const_sharding(plan)
    consts = plan.program.argument_consts()
    if sharding is None:
        return consts
    return tuple(jax.device_put(c, sharding) for c in consts)


def trace_writes(plan: BuildPlan, tricks: _platform.Tricks | None = None) -> list[Any]:
    """Each group's write, traced (`jax.stages.Traced`) with `tricks`, not yet lowered.

    **Arguments:**

    - `plan`: from `plan_build`.
    - `tricks`: the platform tricks to apply; default: those measured for the plan's platform.
    """
    tricks = _platform.Tricks.for_platform(plan.platform) if tricks is None else tricks
    index = jax.ShapeDtypeStruct((), jnp.int32, weak_type=True)
    consts = plan.program.argument_structs(_const_sharding(plan))
    embedded = plan.program.embedded_values()
    traced = []
    for group in plan.groups:
        run = jax.jit(
            _write_run(plan.program.jaxpr, embedded, group, tricks.bit_writes, tricks.layer_runs),
            donate_argnums=0,
            compiler_options=tricks.compiler_options(),
        )
        traced.append(run.trace(plan.buffer_structs(group), plan.keys, consts, index, index))
    return traced


def lower_writes(
    plan: BuildPlan,
    *,
    tricks: _platform.Tricks | None = None,
    lowering_platforms: tuple[str, ...] | None = None,
) -> list[jax.stages.Lowered]:
    """Each group's write, traced and lowered (not compiled): for inspection and benchmarks.

    **Arguments:**

    - `plan`: from `plan_build`.
    - `tricks`: the platform tricks to apply; default: those measured for the plan's platform.
    - `lowering_platforms`: as for `jax.stages.Traced.lower`.
    """
    tricks = _platform.Tricks.for_platform(plan.platform) if tricks is None else tricks
    return [_platform.lower(t, tricks, lowering_platforms) for t in trace_writes(plan, tricks)]


def _write_key(plan: BuildPlan, group: WriteGroup, tricks: _platform.Tricks) -> Hashable:
    keys = (plan.keys.shape, str(plan.keys.dtype))
    buffers = tuple(
        (s.shape, str(s.dtype), s.weak_type, s.sharding) for s in plan.buffer_structs(group)
    )
    return (
        plan.program.key,
        keys,
        group.leaves,
        buffers,
        tricks,
        _compat.can_override_lowering() and tricks.fused_threefry,
        plan.platform,
        settings_key(),
    )


def compile_writes(plan: BuildPlan) -> list[jax.stages.Compiled]:
    """Each group's compiled write, from `WRITES` when the same program was compiled before."""
    tricks = _platform.Tricks.for_platform(plan.platform)
    keys = [_write_key(plan, group, tricks) for group in plan.groups]
    compiled: list[Any] = [WRITES.get(key) for key in keys]
    missing = [g for g, c in enumerate(compiled) if c is None]
    if missing:
        lowered = lower_writes(plan, tricks=tricks)
        fresh = _in_threads(lambda g: lowered[g].compile(), missing)
        for g, c in zip(missing, fresh, strict=True):
            compiled[g] = c
            WRITES.put(keys[g], c)
    return compiled


def memory_analysis(compiled: jax.stages.Compiled) -> Any:
    """`compiled.memory_analysis()`, which every backend eqx_lean runs on provides."""
    analysis = compiled.memory_analysis()
    if analysis is None:  # pragma: no cover - backends without it
        raise NotImplementedError("This backend gives no `memory_analysis()` of its programs.")
    return analysis


def write_temp_bytes(plan: BuildPlan) -> list[int]:
    """XLA temporary bytes (per device) of each group's compiled write, largest first."""
    temps = (memory_analysis(c).temp_size_in_bytes for c in compile_writes(plan))
    return sorted(temps, reverse=True)


# --- building: running the writes -------------------------------------------------------------

# Runs of layers are cut so that one call writes about this many bytes of the stack.
_BYTES_PER_CALL = 256 * 2**20


def layers_per_call(plan: BuildPlan) -> int:
    """How many layers one call of a compiled write fills (1 unless `Tricks.layer_runs`).

    A call allocates its temporaries once for all the layers it writes. Each call's temporaries
    are fresh pages that the kernel must zero, so writing a run of small layers per call instead
    of one saves that system time (about a fifth of the build on XLA:CPU).
    """
    if not _platform.Tricks.for_platform(plan.platform).layer_runs:
        return 1
    stack_bytes = tree_bytes(plan.structs)
    per_call = _BYTES_PER_CALL * plan.num_layers // max(stack_bytes, 1)
    return max(1, min(plan.num_layers, per_call))


def run_writes(
    plan: BuildPlan,
    buffers: list[Array],
    keys: Any,
    writes: Sequence[jax.stages.Compiled],
    runs: Iterator[tuple[int, int]],
) -> None:
    """Runs each group's compiled, donating write on runs of layers, filling `buffers`."""
    tricks = _platform.Tricks.for_platform(plan.platform)
    consts = placed_consts(plan)
    for start, stop in runs:
        for group, write in zip(plan.groups, writes, strict=True):
            filled = write(tuple(buffers[j] for j in group.leaves), keys, consts, start, stop)
            for j, buffer in zip(group.leaves, filled, strict=True):
                buffers[j] = buffer
            # Dispatch is asynchronous and the groups are independent: without waiting, several
            # writes run at once and their temporaries add up.
            jax.block_until_ready(filled)
            _platform.release_freed_host_memory(tricks)


def build_in_trace(plan: BuildPlan, keys: Any) -> list[Array]:
    """The stacked leaves, written by one `fori_loop` per group, inside an outer trace."""
    buffers = [
        constrain(zeros_like_struct(struct), stacked_sharding(s))
        for struct, s in zip(plan.structs, plan.shardings, strict=True)
    ]
    for group in plan.groups:
        # The platform is the outer program's, not known here: no bit writes.
        program = plan.program
        run = _write_run(program.jaxpr, (None,) * len(program.consts), group, bit_writes=False)
        ins = tuple(buffers[j] for j in group.leaves)
        filled = run(ins, keys, program.consts, 0, plan.num_layers)
        for j, buffer in zip(group.leaves, filled, strict=True):
            buffers[j] = buffer
    return buffers
