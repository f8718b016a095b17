"""Compile-only targets: N GPUs or a TPU slice that XLA compiles for, on a machine without them."""

import dataclasses
import functools
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from .. import _arguments as arguments
from . import plugins


_GPU_SPECS_DIR = Path(__file__).parent / "gpu_specs"


@dataclasses.dataclass(frozen=True)
class _Gpu:
    spec_file: str  # XLA's device description, in `gpu_specs/`
    hbm_bytes: int  # its `device_memory_size`


# Each GPU's description is XLA's own (`gpu_specs/`, Apache-2.0, attributed in each file).
_GPUS = {
    "h100": _Gpu("h100_sxm.txtpb", 84978434048),
    "a100-40gb": _Gpu("a100_sxm_40.txtpb", 42331013120),
    "a100-80gb": _Gpu("a100_sxm_80.txtpb", 85100068864),
}


@dataclasses.dataclass(frozen=True)
class _Tpu:
    name: str  # as `get_topology_desc` names the generation
    megacore: bool  # one device per chip (two TensorCores), and a slice's number counts cores
    three_d: bool  # chips in a 3-D torus
    hbm_bytes: int  # per device, as sold
    compiler_bytes: int  # the most XLA lets one program use per device


# `compiler_bytes`: the largest output a program may have on one device before XLA's TPU compiler
# refuses it with RESOURCE_EXHAUSTED, found by bisection with libtpu 0.0.42.1
# (`benchmarks/tpu_hbm.py`). A test checks each against the figure XLA's refusal prints.
_TPUS = {
    "v2": _Tpu("v2", False, False, 8 * 2**30, 8034140160),
    "v3": _Tpu("v3", False, False, 16 * 2**30, 16624075776),
    "v4": _Tpu("v4", True, True, 32 * 2**30, 33014367232),
    "v5e": _Tpu("v5e", False, False, 16 * 2**30, 16909283328),
    "v5p": _Tpu("v5p", True, True, 96 * 2**30, 102803369984),
    "v6e": _Tpu("v6e", False, False, 32 * 2**30, 33550180352),
}

# Chips per slice -> the torus shape `get_topology_desc` takes, as the slices are sold.
_TORUS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16"}
_TORUS_2D |= {256: "16x16", 512: "16x32", 1024: "32x32"}
_TORUS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"}
_TORUS_3D |= {256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}

# The largest GPU topology shown to compile here (XLA's "1x32x8": a 175B build on 256 H100s,
# docs/planning.md): nothing bounded a spec before, and `"1000x1000xh100"` built a million
# compile-only devices (6 GiB and half a minute) before anything could be planned. Eight GPUs
# per host is what an SXM machine (HGX/DGX) holds.
MAX_GPU_HOSTS = 32
MAX_GPUS_PER_HOST = 8

_MEM_FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
_DEFAULT_GPU_FRACTION = 0.75  # what JAX's GPU client takes without either variable

KNOWN_SPECS = (
    '"cpu"; GPUs "h100", "a100-40gb", "a100-80gb" as "<gpu>", "<N>x<gpu>" (N GPUs in one host) or '
    '"<H>x<N>x<gpu>" (H hosts of N; at most 32 hosts of 8); TPU slices as MaxText names them: '
    '"v2-<cores>", "v3-<cores>", "v4-<cores>", "v5p-<cores>" (TensorCores; devices are megacore '
    'chips for v4 and v5p), "v5e-<chips>", "v6e-<chips>"'
)


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    """Devices to plan for: compile-only GPUs or TPUs, or this machine's CPU devices.

    Made by [`eqx_lean.memory.target`][]. XLA compiles for its devices as it would on the real
    hardware; nothing can run on them (`memory_stats()` fails on them), so their memory comes
    from tables.

    **Attributes:**

    - `spec`: the spec it was made from, such as `"8xh100"` or `"v5e-16"`.
    - `devices`: the devices, as a tuple of `jax.Device`.
    - `platform`: as `jax.Device.platform` says: `"gpu"`, `"tpu"` or `"cpu"`.
    - `device_kind`: as `jax.Device.device_kind` says, such as `"NVIDIA H100 80GB HBM3"`.
    - `hbm_bytes`: one device's memory as specified (GPU: XLA's `device_memory_size`; TPU: the
        HBM per device as sold; CPU: this machine's physical memory).
    - `device_memory`: the bytes one process can use on one device. GPU: `hbm_bytes` times the
        fraction JAX's allocator takes (`XLA_CLIENT_MEM_FRACTION`, or the deprecated
        `XLA_PYTHON_CLIENT_MEM_FRACTION`, default 0.75; `memory_fraction=` overrides both). TPU:
        what XLA's compiler lets one program use (15.75 GiB on v5e). CPU: physical memory shared
        evenly by the CPU devices.
    """

    spec: str
    devices: tuple[Any, ...]
    platform: str
    device_kind: str
    hbm_bytes: int
    device_memory: int

    def mesh(self, axis_shapes: Sequence[int], axis_names: Sequence[str], **kwargs) -> Mesh:
        """A `Mesh` over all of this target's devices, as `jax.make_mesh` makes one.

        Axis types are `jax.make_mesh`'s defaults (pass `axis_types=` to choose): with
        `Explicit` axes, code whose products would shard one mesh axis twice needs
        `out_sharding=` (or an `Auto` mesh), as it would on the real devices.

        **Arguments:**

        - `axis_shapes`: the size of each axis, at least one axis, each a positive integer;
            their product must be `len(target.devices)`.
        - `axis_names`: the name of each axis, a distinct non-empty string each.
        - `**kwargs`: passed on to `jax.make_mesh` (`axis_types=`).

        **Returns:**

        A `jax.sharding.Mesh`.
        """
        shapes, names = mesh_axes(self, axis_shapes, axis_names, "`axis_shapes`", "`axis_names`")
        return jax.make_mesh(shapes, names, devices=self.devices, **kwargs)

    def __repr__(self) -> str:
        gib = 2**30
        return (
            f"Target({self.spec!r}: {len(self.devices)} x {self.device_kind} ({self.platform}), "
            f"{self.device_memory / gib:.2f} GiB usable of {self.hbm_bytes / gib:.2f} GiB each)"
        )


def mesh_axes(
    where: Target, shapes: Any, names: Any, shapes_what: str, names_what: str
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The one check of a mesh's axes over all of `where`'s devices, before JAX sees them: at
    least one axis, each size a positive integer (not a bool: `True` would be an axis of one),
    each name a non-empty string, no name twice, as many names as sizes, and sizes whose
    product is the number of devices. Negative sizes whose product is right, or a repeated
    name, reached XLA (or passed) before.

    **Arguments:**

    - `where`: the target.
    - `shapes`, `names`: the axes' sizes and names, as the caller took them.
    - `shapes_what`, `names_what`: how an error names them, such as "`axis_shapes`".

    **Returns:**

    `(shapes, names)` as tuples of `int` and `str`.
    """
    if isinstance(shapes, str | bytes) or not isinstance(shapes, Sequence):
        raise TypeError(f"{shapes_what} must be a sequence of axis sizes; got {shapes!r}.")
    if isinstance(names, str | bytes) or not isinstance(names, Sequence):
        raise TypeError(f"{names_what} must be a sequence of axis names; got {names!r}.")
    if not shapes:
        raise ValueError(f"{shapes_what} must hold at least one axis; got {shapes!r}.")
    sizes = tuple(
        arguments.integer(n, f"{shapes_what}[{i}]", minimum=1) for i, n in enumerate(shapes)
    )
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise TypeError(f"{names_what}[{i}] must be a non-empty string; got {name!r}.")
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if list(names).count(n) > 1})
        raise ValueError(f"{names_what} must name each axis once; {twice} appear more than once.")
    if len(names) != len(sizes):
        raise ValueError(
            f"{names_what} has {len(names)} names for the {len(sizes)} sizes of {shapes_what}: "
            "give one name per axis."
        )
    total = math.prod(sizes)
    if total != len(where.devices):
        raise ValueError(
            f"{shapes_what} {sizes} hold {total} devices; target {where.spec!r} has "
            f"{len(where.devices)}: their product must equal the number of devices."
        )
    return sizes, tuple(names)


def target(spec: str, *, memory_fraction: float | None = None) -> Target:
    """Devices to plan memory for: N GPUs or a TPU slice, compiled for from any machine.

    ```python
    h100s = eqx_lean.memory.target("8xh100")
    mesh = h100s.mesh((8,), ("fsdp",))
    print(eqx_lean.memory.plan(step, params, batch, target=h100s))
    ```

    GPUs need JAX's CUDA plugin (no NVIDIA libraries), TPUs libtpu, either in a directory of
    their own that only planning loads (`pip install --no-deps --target .venv/plan-plugins
    jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2 "libtpu==0.0.42.*"`: `plan-plugins` in
    the running environment, or the directory `EQX_LEAN_PLAN_PLUGINS` names), so that no other
    JAX program in the environment meets them, or installed in the environment (the `plan-gpu`
    and `plan-tpu` extras), where JAX starts them in every program. From the directory, a plan
    starts the CUDA plugin itself, after JAX's backends, with nothing to set. Installed in the
    environment, the CUDA plugin compiles for GPUs it does not have only if the process started
    with `JAX_PLATFORMS=cpu` (or `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`) set before JAX's first
    computation; eqx_lean never sets either itself, and says so where one is missing.
    `python -m eqx_lean.memory` runs a plan in a fresh process with them set.

    The same spec (and memory fraction) gives the same `Target` for the life of the process, so
    meshes and shardings made from it stay compatible.

    **Arguments:**

    - `spec`: `"cpu"` (this machine's CPU devices); `"h100"`, `"a100-40gb"` or `"a100-80gb"`,
        alone, as `"<N>x<gpu>"` (N GPUs in one host, such as `"8xh100"`) or as `"<H>x<N>x<gpu>"`
        (H hosts of N GPUs, such as `"4x8xh100"`), at most 8 GPUs per host and 32 hosts (the
        largest topology shown to compile here, `"32x8xh100"`); or a TPU slice as MaxText names
        it: `"v4-8"`, `"v5p-128"` (the number counts TensorCores; devices are megacore chips, two
        cores each), `"v5e-16"`, `"v6e-256"` (the number counts chips), `"v2-8"`, `"v3-8"`
        (cores; one device per core).
    - `memory_fraction`: GPU only: the fraction of each GPU's memory one process can use,
        instead of the one the allocator variables give.

    **Returns:**

    A [`eqx_lean.memory.Target`][].
    """
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a string such as '8xh100' or 'v5e-16', got {spec!r}.")
    spec = spec.strip().lower()
    if memory_fraction is not None:
        # A bool is not a fraction (`True` was taken as all of the memory).
        memory_fraction = arguments.number(memory_fraction, "`memory_fraction`")
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}.")
    gpu = _parse_gpu(spec)
    if gpu is not None:
        return _gpu_target(spec, *gpu, _gpu_fraction(memory_fraction))
    if memory_fraction is not None:
        raise ValueError(f"memory_fraction applies to GPU targets only, not {spec!r}.")
    if spec == "cpu":
        return _cpu_target()
    tpu = _parse_tpu(spec)
    if tpu is not None:
        return _tpu_target(spec, *tpu)
    raise ValueError(f"Unknown target spec {spec!r}. Known specs: {KNOWN_SPECS}.")


def resolve_target(given: "Target | str") -> Target:
    """`target=` as every planner takes it: a `Target`, or a spec for `target`."""
    where = target(given) if isinstance(given, str) else given
    if not isinstance(where, Target):
        raise TypeError(f"target must be a Target or a spec string, got {given!r}.")
    return where


def placed_on(where: Target, sharding: Any, what: str, *, concrete: bool = False) -> Any:
    """The one rule for where a planned value lives on a target: its sharding, or `None`.

    A sharding that was chosen for the plan (a struct's, or a `sharding=` argument's) must be
    over the target's devices; any other is refused, naming `what`. A leaf without one, or a
    concrete array of this machine on one device (its placement says where it was made here,
    not where it would run), is unplaced: `None`, for the caller to put where a run would put
    an uncommitted array. A concrete array spread over several devices that are not the
    target's is refused too.

    **Arguments:**

    - `where`: the target.
    - `sharding`: the value's sharding, or `None`.
    - `what`: how an error names the value, such as `"argument leaf [0].weight"`.
    - `concrete`: whether the value is an array of this machine (not a struct).

    **Returns:**

    `sharding` if it is on the target's devices; `None` if the value is unplaced.
    """
    if sharding is None:
        return None
    if sharding.device_set <= set(where.devices):
        return sharding
    if concrete and len(sharding.device_set) == 1:
        return None
    raise ValueError(
        f"The sharding of {what} is over devices that target {where.spec!r} does not have: "
        "make it on `target.mesh(...)` (or a device in `target.devices`)."
    )


def _parse_gpu(spec: str) -> tuple[str, int, int] | None:
    match = re.fullmatch(r"(?:(\d+)x)?(?:(\d+)x)?([a-z0-9-]+)", spec)
    if match is None or match.group(3) not in _GPUS:
        return None
    first, second, name = match.groups()
    hosts, per_host = (int(first), int(second)) if second else (1, int(first or 1))
    if hosts < 1 or per_host < 1:
        raise ValueError(f"Target spec {spec!r} asks for no GPUs; counts must be at least 1.")
    if hosts > MAX_GPU_HOSTS or per_host > MAX_GPUS_PER_HOST:
        raise ValueError(
            f"Target spec {spec!r} asks for {hosts} host(s) of {per_host} GPU(s): a GPU target "
            f"must have at most {MAX_GPUS_PER_HOST} GPUs per host and at most {MAX_GPU_HOSTS} "
            f"hosts ({MAX_GPU_HOSTS * MAX_GPUS_PER_HOST} GPUs, '{MAX_GPU_HOSTS}x"
            f"{MAX_GPUS_PER_HOST}x{name}'), the largest topology shown to compile here. Write "
            f"more than {MAX_GPUS_PER_HOST} GPUs as hosts of {MAX_GPUS_PER_HOST}, such as "
            f"'2x{MAX_GPUS_PER_HOST}x{name}'."
        )
    return name, hosts, per_host


def _parse_tpu(spec: str) -> tuple[_Tpu, int] | None:
    match = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", spec)
    if match is None or match.group(1) not in _TPUS:
        return None
    return _TPUS[match.group(1)], int(match.group(2))


def _gpu_fraction(memory_fraction: float | None) -> float:
    if memory_fraction is not None:
        return float(memory_fraction)
    for variable in _MEM_FRACTION_VARIABLES:
        value = os.environ.get(variable)
        if value is not None:
            try:
                fraction = float(value)
            except ValueError:
                raise ValueError(f"{variable}={value!r} is not a number in (0, 1].") from None
            if not 0 < fraction <= 1:
                raise ValueError(f"{variable}={value!r} must be in (0, 1].")
            return fraction
    return _DEFAULT_GPU_FRACTION


@functools.cache
def _gpu_target(spec: str, name: str, hosts: int, per_host: int, fraction: float) -> Target:
    gpu = _GPUS[name]
    devices = _topology_devices(
        "cuda",
        f"1x{hosts}x{per_host}",
        target_config=(_GPU_SPECS_DIR / gpu.spec_file).read_text(),
    )
    return Target(
        spec=spec,
        devices=devices,
        platform="gpu",
        device_kind=devices[0].device_kind,
        hbm_bytes=gpu.hbm_bytes,
        device_memory=int(gpu.hbm_bytes * fraction),
    )


@functools.cache
def _tpu_target(spec: str, tpu: _Tpu, count: int) -> Target:
    chips, remainder = divmod(count, 2) if tpu.megacore or tpu.name in ("v2", "v3") else (count, 0)
    shapes = _TORUS_3D if tpu.three_d else _TORUS_2D
    if remainder or chips not in shapes:
        sizes = sorted(n * (2 if tpu.megacore or tpu.name in ("v2", "v3") else 1) for n in shapes)
        raise ValueError(
            f"Unknown {tpu.name} slice {spec!r}: the number after the dash must be one of "
            f"{', '.join(map(str, sizes))}."
        )
    kwargs = {"chip_config_name": "megacore"} if tpu.megacore else {}
    devices = _topology_devices("tpu", f"{tpu.name}:{shapes[chips]}", **kwargs)
    return Target(
        spec=spec,
        devices=devices,
        platform="tpu",
        device_kind=devices[0].device_kind,
        hbm_bytes=tpu.hbm_bytes,
        device_memory=tpu.compiler_bytes,
    )


@functools.cache
def _cpu_target() -> Target:
    devices = tuple(jax.devices("cpu"))
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Target(
        spec="cpu",
        devices=devices,
        platform="cpu",
        device_kind=devices[0].device_kind,
        hbm_bytes=physical,
        device_memory=physical // len(devices),
    )


def _topology_devices(platform: str, topology: str, **kwargs) -> tuple[Any, ...]:
    from jax.experimental import topologies

    extra = "plan-gpu" if platform == "cuda" else "plan-tpu"
    # Plugins kept in a directory of their own (`plugins.py`) become visible here only.
    plugins.make_visible(platform)
    try:
        if platform == "cuda":
            desc = topologies.get_topology_desc(platform="cuda", topology=topology, **kwargs)
        else:
            desc = topologies.get_topology_desc(topology, platform="tpu", **kwargs)
    except NotImplementedError as error:
        if not _cuda_plugin_installed():
            raise _missing_extra(extra) from error
        raise RuntimeError(
            "JAX's CUDA plugin is installed but cannot compile for GPUs this machine lacks: "
            "start the process with JAX_PLATFORMS=cpu (or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1) in "
            "its environment, set before JAX's first computation (setting it later has no "
            "effect), or use `python -m eqx_lean.memory`, which plans in a fresh process with it "
            "set."
        ) from error
    except RuntimeError as error:  # JaxRuntimeError included
        if "not installed" in str(error):
            raise _missing_extra(extra) from error
        if "libtpu multi-process lockfile" in str(error):
            raise RuntimeError(
                "Another process holds libtpu, which by default loads in one process at a time. "
                "Compiling for TPUs needs no exclusive access: start this process with "
                "ALLOW_MULTIPLE_LIBTPU_LOAD=1 in its environment (set before JAX starts), or "
                "use `python -m eqx_lean.memory`, which plans in a fresh process with it set."
            ) from error
        raise
    return tuple(desc.devices)


# Test seam: tests/test_targets.py says the plugin is missing.
def _cuda_plugin_installed() -> bool:
    return plugins.available("cuda")


def _missing_extra(extra: str) -> ImportError:
    what = "GPUs needs JAX's CUDA plugin" if extra == "plan-gpu" else "TPUs needs libtpu"
    hint = (
        'from the root of the eqx_lean checkout, `pip install ".[plan-gpu]"`'
        if extra == "plan-gpu"
        else 'from the root of the eqx_lean checkout, `pip install ".[plan-tpu]"`'
    )
    return ImportError(
        f"Planning for {what}, which eqx_lean's `{extra}` extra installs, pinned to the JAX "
        f"version eqx_lean is tested with: {hint}. That makes every JAX program in the "
        "environment print CUDA and TPU errors at start; to keep them out of it, install both "
        f"plugins into a directory of their own instead, which only planning loads: "
        f"`{plugins.install_command()}` (or name another directory in {plugins.VARIABLE})."
    )
