"""XLA's memory plan of any function on a target: per-device bytes, and whether it fits."""

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

from .. import _platform
from .._core import shard_bytes, struct_of
from .table import MiB, format_bytes, table
from .targets import Target, placed_on, resolve_target


# A closed-over array larger than this is refused: it would be baked into the program as a
# constant, which a compile-only device cannot receive and a real run would copy per call.
CLOSURE_LIMIT = MiB

DonateSpec = Literal["none", "all"] | Sequence[int]


@dataclasses.dataclass(frozen=True)
class Plan:
    """XLA's memory plan of one compiled program on one target, per device.

    Returned by [`eqx_lean.memory.plan`][]; `print` it for a table. Byte counts are per device
    (XLA plans an SPMD program once for every device).

    **Attributes:**

    - `target`: the spec of the target planned for, such as `"8xh100"`.
    - `platform`: `"gpu"`, `"tpu"` or `"cpu"`.
    - `num_devices`: the devices the program runs on.
    - `argument`, `output`, `alias`, `temp`: XLA's `memory_analysis()` figures: the arguments,
        the outputs, the outputs that reuse a donated argument's buffer, and the temporaries.
    - `peak`: `argument + output - alias + temp`: what the program needs at once on one device.
    - `xla_peak`: XLA's own `peak_memory_in_bytes`, where the platform gives a meaningful one
        (GPU and TPU; `None` on CPU, where it counts only the arguments). It counts the
        buffers offloaded to host memory too (compiled for one H100, a step whose carries
        are offloaded reads its arguments plus its `host` bytes: `docs/benchmarks.md`, issue
        44).
    - `host`: the bytes the program keeps in the device's host memory (pinned host: what
        `remat="offload"` moves there), its host arguments, outputs and temporaries; 0 for a
        program without memory kinds.
    - `device_memory`: the bytes one process can use on one device of the target.
    - `fits`: whether [`needed`][eqx_lean.memory.Plan.needed] is within `device_memory`.
        On TPU, `False` also when XLA refused to compile the program for the device's
        memory.
    - `refused`: XLA's refusal (TPU only) when it would not compile the program for lack of
        memory; its figures are then the arguments and outputs as traced, and `temp` is what
        the refusal reports beyond them (rounded as XLA prints it). `None` otherwise.
    - `compile_seconds`: how long tracing, lowering and compiling took.
    """

    target: str
    platform: str
    num_devices: int
    argument: int
    output: int
    alias: int
    temp: int
    peak: int
    xla_peak: int | None
    device_memory: int
    fits: bool
    refused: str | None
    compile_seconds: float
    host: int = 0

    @property
    def needed(self) -> int:
        """The device bytes `fits` is judged on: the larger of `peak` and XLA's own peak less
        the host bytes (which XLA's peak counts). On a TPU, `temp` can read far below XLA's
        peak; on a GPU the two agree without offloading."""
        return needed_bytes(self.peak, self.xla_peak, self.host)

    def table(self) -> str:
        """The plan as an aligned text table."""
        rows = [
            ("arguments", self.argument),
            ("outputs", self.output),
            ("donated outputs (alias)", -self.alias),
            ("temporaries", self.temp),
            ("peak", self.peak),
        ]
        if self.xla_peak is not None and self.needed != self.peak:
            rows.append(("XLA's peak, less host bytes", self.needed))
        rows.append(("device memory", self.device_memory))
        if self.host:
            rows.append(("host memory (offloaded)", self.host))
        verdict = "fits" if self.fits else "does NOT fit"
        head = (
            f"plan for {self.target} ({self.num_devices} x {self.platform}), per device: "
            f"{verdict} ({format_bytes(self.needed)} of {format_bytes(self.device_memory)})"
        )
        if self.refused:
            head += f"\nXLA refused to compile it: {self.refused}"
        return head + "\n" + table(("", "bytes"), [(n, format_bytes(b)) for n, b in rows])

    def __str__(self) -> str:
        return self.table()


def needed_bytes(peak: int, xla_peak: int | None, host: int) -> int:
    """`Plan.needed`: `peak`, or XLA's peak less the host bytes where that is larger."""
    if xla_peak is None:
        return peak
    return max(peak, xla_peak - host)


def _is_traced(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _chosen_sharding(x: Any) -> Any:
    """`x`'s sharding if one was chosen for it: not a NumPy array's, nor an uncommitted one's."""
    if isinstance(x, np.ndarray | np.generic) or not getattr(x, "committed", True):
        return None
    return getattr(x, "sharding", None)


def _structs_on(
    leaves: Sequence[tuple[Any, Any]], where: Target, *, first_device_if_none: bool = True
) -> list[jax.ShapeDtypeStruct]:
    """Each `(path, array or struct)` as a `ShapeDtypeStruct` placed by `placed_on`'s rule.

    Unplaced leaves stay uncommitted (`sharding=None`) where another leaf is on the target, so
    the program replicates them over its devices as a run does with uncommitted arrays; where
    no leaf is placed, the program is a single-device one on `target.devices[0]` (or, with
    `first_device_if_none=False`, every leaf stays unplaced for a later call to decide).
    """
    shardings = [
        placed_on(
            where,
            _chosen_sharding(x),
            f"argument leaf {jax.tree_util.keystr(path)}",
            concrete=not isinstance(x, jax.ShapeDtypeStruct),
        )
        for path, x in leaves
    ]
    if first_device_if_none and all(s is None for s in shardings):
        shardings = [SingleDeviceSharding(where.devices[0])] * len(shardings)
    return [struct_of(x, s) for (_, x), s in zip(leaves, shardings, strict=True)]


def _donated(donate: DonateSpec, num_args: int) -> tuple[int, ...]:
    if isinstance(donate, str):
        if donate == "none":
            return ()
        if donate == "all":
            return tuple(range(num_args))
        raise ValueError(f"donate must be 'none', 'all' or argument positions, got {donate!r}.")
    positions = tuple(int(i) for i in donate)
    for i in positions:
        if not 0 <= i < num_args:
            raise ValueError(f"donate names argument {i}, but there are {num_args} arguments.")
    return positions


def _closure_values(fn: Any, prefix: str = "fn") -> list[tuple[str, Any]]:
    """Named values a function can reach without arguments: cells, partial args, fields."""
    found: list[tuple[str, Any]] = []
    if isinstance(fn, eqx.Module):
        for path, leaf in jax.tree_util.tree_leaves_with_path(fn):
            found.append((prefix + jax.tree_util.keystr(path), leaf))
    inner = getattr(fn, "func", None)  # functools.partial
    if inner is not None:
        for i, arg in enumerate(getattr(fn, "args", ())):
            for path, leaf in jax.tree_util.tree_leaves_with_path(arg):
                found.append((f"{prefix}.args[{i}]{jax.tree_util.keystr(path)}", leaf))
        for name, arg in (getattr(fn, "keywords", None) or {}).items():
            for path, leaf in jax.tree_util.tree_leaves_with_path(arg):
                found.append((f"{prefix}.keywords[{name!r}]{jax.tree_util.keystr(path)}", leaf))
        found += _closure_values(inner, prefix + ".func")
    code = getattr(fn, "__code__", None)
    values = []
    cells = getattr(fn, "__closure__", None) or ()
    for name, cell in zip(getattr(code, "co_freevars", ()), cells, strict=False):
        try:
            values.append((name, cell.cell_contents))
        except ValueError:
            continue
    module_globals = getattr(fn, "__globals__", {})
    values += [(n, module_globals[n]) for n in getattr(code, "co_names", ()) if n in module_globals]
    for name, value in values:
        if isinstance(value, eqx.Module | list | tuple | dict | jax.Array | np.ndarray):
            for path, leaf in jax.tree_util.tree_leaves_with_path(value):
                found.append((name + jax.tree_util.keystr(path), leaf))
    return found


def _identity(x: Any) -> Any:
    """The same for an array and the constant tracing made of it (a copy of the wrapper)."""
    if isinstance(x, jax.Array):
        try:
            return ("buffer", x.unsafe_buffer_pointer())
        except Exception:  # a tracer, several shards, or deleted
            return id(x)
    if isinstance(x, np.ndarray):
        return ("buffer", x.ctypes.data)
    return id(x)


def _check_constants(fn: Callable, consts: Sequence[Any]) -> None:
    large = [c for c in consts if eqx.is_array(c) and c.nbytes > CLOSURE_LIMIT]
    if not large:
        return
    named = {_identity(v): name for name, v in _closure_values(fn) if eqx.is_array(v)}
    what = ", ".join(
        f"{named.get(_identity(c), 'an array')} "
        f"({c.dtype}{list(c.shape)}, {format_bytes(c.nbytes)})"
        for c in large
    )
    raise ValueError(
        f"The planned function closes over concrete arrays larger than "
        f"{format_bytes(CLOSURE_LIMIT)}: {what}. Pass them as arguments (or as "
        f"`jax.ShapeDtypeStruct`s) so that they are planned as inputs on the target."
    )


_REFUSAL = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _refusal(error: Exception) -> str | None:
    message = str(error)
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    return message.split("\n")[0].strip()


def plan(
    fn: Callable,
    *args: Any,
    target: Target | str,
    donate: DonateSpec = "none",
) -> Plan:
    """XLA's per-device memory plan of `fn(*args)` on a target, compiled without running it.

    ```python
    h100s = eqx_lean.memory.target("8xh100")
    mesh = h100s.mesh((8,), ("fsdp",))
    params = jax.ShapeDtypeStruct((32768, 262144), jnp.float32,
                                  sharding=jax.NamedSharding(mesh, jax.P(None, "fsdp")))
    print(eqx_lean.memory.plan(lambda p: p * 2, params, target=h100s, donate="all"))
    ```

    Arguments follow `eqx.filter_jit`'s rules: every JAX array and `jax.ShapeDtypeStruct` leaf
    is traced (an abstract Equinox module, as `eqx.filter_eval_shape` gives, is welcome), every
    other leaf is static. A struct's sharding must be over the target's devices (made on
    `target.mesh(...)`, or a `SingleDeviceSharding` of one of `target.devices`); any other is
    refused. A leaf with none, or a concrete array of this machine on one device, is placed
    as a run places an uncommitted array: replicated over the devices the other arguments
    use, or on `target.devices[0]` where none has a sharding on the target.

    The plan is XLA's `memory_analysis()` of the program compiled for the target's devices, the
    program a run on that hardware would compile. GPU plans that do not fit compile anyway (XLA
    only logs a line), so `fits` is what says it; a TPU program too large for its HBM is refused
    by XLA's compiler, reported as `fits=False` with `refused` set.

    **Arguments:**

    - `fn`: the function to plan. It must not close over a concrete array larger than 1 MiB
        (pass it as an argument); such an array is named in the error.
    - `*args`: its positional arguments.
    - `target`: a [`eqx_lean.memory.Target`][] or a spec for [`eqx_lean.memory.target`][].
    - `donate`: which arguments' buffers the program may reuse for its outputs: `"none"`,
        `"all"`, or a sequence of argument positions (as `jax.jit`'s `donate_argnums`).

    **Returns:**

    A [`eqx_lean.memory.Plan`][]; `print` it for a table.
    """
    where = resolve_target(target)
    donated = _donated(donate, len(args))
    dynamic, static = eqx.partition(args, _is_traced)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(dynamic)
    structs = _structs_on(leaves, where)
    dynamic = jax.tree_util.tree_unflatten(treedef, structs)

    def call(*dynamic_args):
        return fn(*eqx.combine(dynamic_args, static))

    start = time.perf_counter()
    # Traced with the target's choices (chunk sizes), not this machine's (`_platform`).
    with _platform.tracing_for(where.platform):
        traced = jax.jit(call, donate_argnums=donated).trace(*dynamic)
    _check_constants(fn, traced.jaxpr.consts)
    lowered = traced.lower()
    try:
        compiled = lowered.compile()
    except Exception as error:
        refused = _refusal(error)
        if refused is None or where.platform != "tpu":
            raise
        return _refused_plan(where, lowered, structs, refused, time.perf_counter() - start)
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(f"XLA gives no memory analysis for {where.platform} programs.")
    argument = stats.argument_size_in_bytes
    output = stats.output_size_in_bytes
    alias = stats.alias_size_in_bytes
    temp = stats.temp_size_in_bytes
    peak = argument + output - alias + temp
    xla_peak = None if where.platform == "cpu" else getattr(stats, "peak_memory_in_bytes", None)
    host = sum(
        getattr(stats, f"host_{name}_size_in_bytes", 0) for name in ("argument", "output", "temp")
    ) - getattr(stats, "host_alias_size_in_bytes", 0)
    return Plan(
        target=where.spec,
        platform=where.platform,
        num_devices=len(_program_devices(compiled, where)),
        argument=argument,
        output=output,
        alias=alias,
        temp=temp,
        peak=peak,
        xla_peak=xla_peak,
        device_memory=where.device_memory,
        fits=needed_bytes(peak, xla_peak, host) <= where.device_memory,
        refused=None,
        compile_seconds=seconds,
        host=host,
    )


def _program_devices(compiled: Any, where: Target) -> list[Any]:
    devices: set[Any] = set()
    for sharding in jax.tree.leaves(
        (compiled.input_shardings, compiled.output_shardings),
        is_leaf=lambda x: isinstance(x, Sharding),
    ):
        devices |= sharding.device_set
    return sorted(devices, key=lambda d: d.id) or [where.devices[0]]


def _refused_plan(
    where: Target, lowered: Any, structs: Sequence[Any], refused: str, seconds: float
) -> Plan:
    argument = sum(shard_bytes(s) for s in structs)
    outs = jax.tree.leaves(lowered.out_info)
    output = sum(shard_bytes(s) for s in outs if hasattr(s, "sharding"))
    match = _REFUSAL.search(refused)
    required = float(match.group(1)) * _UNITS[match.group(2)] if match else 0.0
    temp = max(0, int(required) - argument - output)
    peak = max(argument + output + temp, where.device_memory + 1)
    devices = set()
    for s in [*structs, *outs]:
        sharding = getattr(s, "sharding", None)
        if isinstance(sharding, Sharding):
            devices |= sharding.device_set
    return Plan(
        target=where.spec,
        platform=where.platform,
        num_devices=max(1, len(devices)),
        argument=argument,
        output=output,
        alias=0,
        temp=temp,
        peak=peak,
        xla_peak=None,
        device_memory=where.device_memory,
        fits=False,
        refused=refused,
        compile_seconds=seconds,
    )
