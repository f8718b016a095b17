"""Compile-only targets (`eqx_lean.memory.target`) and plans of any function (`plan`).

Expected figures come from outside the code under test: byte counts of shards computed here,
`memory_analysis()` of programs compiled here with `jax.jit`, XLA's own refusal messages.
"""

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_lean
from eqx_lean.internal import TPUS, memory_targets, topology_devices


ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_gpu_plugin = pytest.mark.skipif(
    not HAS_CUDA_PLUGIN, reason="the plan-gpu extra (JAX's CUDA plugin) is not installed"
)
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU, reason="the plan-tpu extra (libtpu) is not installed"
)
GiB = 2**30


def _shard_bytes(struct) -> int:
    shape = struct.sharding.shard_shape(struct.shape)
    return math.prod(shape) * jnp.dtype(struct.dtype).itemsize


@needs_gpu_plugin
@pytest.mark.parametrize(
    "spec, count, kind, hbm",
    [
        ("h100", 1, "NVIDIA H100 80GB HBM3", 84978434048),
        ("8xh100", 8, "NVIDIA H100 80GB HBM3", 84978434048),
        ("4x8xh100", 32, "NVIDIA H100 80GB HBM3", 84978434048),
        ("a100-40gb", 1, "NVIDIA A100-SXM4-40GB", 42331013120),
        ("2xa100-80gb", 2, "NVIDIA A100-SXM4-80GB", 85100068864),
    ],
)
def test_gpu_targets(spec, count, kind, hbm, monkeypatch):
    for variable in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(variable, raising=False)
    target = eqx_lean.memory.target(spec)
    assert len(target.devices) == count
    assert target.platform == "gpu" == target.devices[0].platform
    assert target.device_kind == kind
    assert target.hbm_bytes == hbm
    assert target.device_memory == int(hbm * 0.75)
    assert eqx_lean.memory.target(spec.upper()) is target


@needs_gpu_plugin
def test_gpu_memory_fraction(monkeypatch):
    hbm = 84978434048
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert eqx_lean.memory.target("h100").device_memory == int(hbm * 0.5)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")  # the new name wins
    assert eqx_lean.memory.target("h100").device_memory == int(hbm * 0.9)
    assert eqx_lean.memory.target("h100", memory_fraction=0.25).device_memory == hbm // 4
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "lots")
    with pytest.raises(ValueError, match="XLA_CLIENT_MEM_FRACTION='lots'"):
        eqx_lean.memory.target("h100")
    with pytest.raises(ValueError, match="memory_fraction must be in"):
        eqx_lean.memory.target("h100", memory_fraction=1.5)


@needs_libtpu
@pytest.mark.parametrize(
    "spec, count, kind",
    [
        ("v4-8", 4, "TPU v4"),  # megacore: 8 TensorCores are 4 devices
        ("v5p-128", 64, "TPU v5"),
        ("v5e-16", 16, "TPU v5 lite"),
        ("v5e-256", 256, "TPU v5 lite"),
        ("v6e-256", 256, "TPU v6 lite"),
        ("v3-8", 8, "TPU v3"),
    ],
)
def test_tpu_slices(spec, count, kind):
    target = eqx_lean.memory.target(spec)
    assert len(target.devices) == count
    assert target.platform == "tpu" == target.devices[0].platform
    assert target.device_kind == kind


@needs_libtpu
@pytest.mark.parametrize("generation", sorted(TPUS))
def test_tpu_table_matches_xla_refusal(generation):
    """Each generation's usable memory is the figure XLA's own refusal prints."""
    size = {"v2": 8, "v3": 8, "v4": 8, "v5p": 8, "v5e": 4, "v6e": 4}[generation]
    target = eqx_lean.memory.target(f"{generation}-{size}")
    sharding = jax.sharding.SingleDeviceSharding(target.devices[0])
    too_big = jax.ShapeDtypeStruct((200 * GiB,), jnp.uint8, sharding=sharding)
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as info:
        jax.jit(lambda x: x + 1).trace(too_big).lower().compile()
    printed = re.search(r"exceeds available HBM \(([\d.]+)G\)", str(info.value))
    assert printed is not None
    assert float(printed.group(1)) == round(target.device_memory / GiB, 2)
    assert target.device_memory <= target.hbm_bytes


@needs_libtpu
def test_tpu_device_memory_is_the_compiler_boundary():
    target = eqx_lean.memory.target("v5e-4")
    sharding = jax.sharding.SingleDeviceSharding(target.devices[0])

    def output_of(n):
        return jax.jit(lambda: jnp.zeros((n,), jnp.uint8), out_shardings=sharding)

    output_of(target.device_memory).trace().lower().compile()
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        output_of(target.device_memory + 2**20).trace().lower().compile()


def test_cpu_target():
    target = eqx_lean.memory.target("cpu")
    assert target.platform == "cpu"
    assert target.devices == tuple(jax.devices("cpu"))
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert target.hbm_bytes == physical
    assert target.device_memory == physical // len(target.devices)
    with pytest.raises(ValueError, match="GPU targets only"):
        eqx_lean.memory.target("cpu", memory_fraction=0.5)


@pytest.mark.parametrize("spec", ["h200", "v5e-3", "v4-7", "8xh100x", "0xh100", "tpu"])
def test_unknown_specs(spec):
    with pytest.raises(ValueError) as info:
        eqx_lean.memory.target(spec)
    message = str(info.value)
    assert spec in message
    if spec in ("h200", "8xh100x", "tpu"):
        assert "Known specs" in message and "v5e-<chips>" in message
    if spec.startswith("v"):
        assert "must be one of" in message


def test_target_mesh():
    target = eqx_lean.memory.target("cpu")
    mesh = target.mesh((len(target.devices),), ("fsdp",))
    assert mesh.axis_names == ("fsdp",)
    with pytest.raises(ValueError, match="must equal the number of devices"):
        target.mesh((len(target.devices) + 1,), ("fsdp",))


def test_missing_plugin_names_the_extra(monkeypatch):
    from jax.experimental import topologies

    def unavailable(*args, **kwargs):
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", unavailable)
    monkeypatch.setattr(memory_targets, "_cuda_plugin_installed", lambda: False)
    with pytest.raises(ImportError, match=r'pip install "\.\[plan-gpu\]"'):
        topology_devices("cuda", "1x1x3")


@needs_gpu_plugin
def test_missing_environment_says_which_variable():
    """Without JAX_PLATFORMS=cpu the CUDA plugin cannot compile for absent GPUs
    (`tests/workers/gpu_target_unconfigured.py`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["PYTHONPATH"] = str(ROOT)
    worker = ROOT / "tests" / "workers" / "gpu_target_unconfigured.py"
    out = subprocess.run(
        [sys.executable, str(worker)], env=env, capture_output=True, text=True, timeout=120
    )
    if "cuda" in out.stdout + out.stderr and "NVIDIA" in out.stdout:
        pytest.skip("this machine has a GPU")
    assert "JAX_PLATFORMS=cpu" in out.stdout
    assert "before JAX's first computation" in out.stdout


# Plans.


@needs_gpu_plugin
def test_plan_equals_xla_memory_analysis_for_the_target():
    target = eqx_lean.memory.target("8xh100")
    mesh = target.mesh((8,), ("fsdp",))
    params = jax.ShapeDtypeStruct(
        (4096, 8192), jnp.float32, sharding=jax.NamedSharding(mesh, jax.P(None, "fsdp"))
    )

    def step(p):
        return jnp.tanh(p) * 2 + p.sum(axis=1, keepdims=True)

    plan = eqx_lean.memory.plan(step, params, target=target)
    expected = jax.jit(step).trace(params).lower().compile().memory_analysis()
    assert expected is not None
    assert plan.platform == "gpu" and plan.num_devices == 8
    assert plan.argument == expected.argument_size_in_bytes == _shard_bytes(params)
    assert plan.output == expected.output_size_in_bytes
    assert plan.temp == expected.temp_size_in_bytes
    assert plan.peak == plan.argument + plan.output - plan.alias + plan.temp
    assert plan.xla_peak == expected.peak_memory_in_bytes
    assert plan.fits and plan.device_memory == target.device_memory
    donated = eqx_lean.memory.plan(step, params, target=target, donate="all")
    assert donated.alias == _shard_bytes(params)
    assert donated.peak == plan.peak - _shard_bytes(params)
    assert "fits" in str(plan) and "8xh100" in str(plan)


@pytest.mark.quick
@needs_gpu_plugin
def test_gpu_plan_over_memory_does_not_fit():
    target = eqx_lean.memory.target("a100-40gb")
    x = jax.ShapeDtypeStruct((20 * GiB // 4,), jnp.float32)  # 20 GiB in, 20 GiB out
    plan = eqx_lean.memory.plan(lambda a: a * 2, x, target=target)
    assert plan.peak == 40 * GiB > target.device_memory
    assert not plan.fits and plan.refused is None
    assert "does NOT fit" in str(plan)


@needs_libtpu
def test_tpu_refusal_is_a_plan_that_does_not_fit():
    target = eqx_lean.memory.target("v5e-16")
    x = jax.ShapeDtypeStruct((20 * GiB // 4,), jnp.float32)
    plan = eqx_lean.memory.plan(lambda a: a * 2, x, target=target)
    assert not plan.fits
    assert plan.refused is not None and "RESOURCE_EXHAUSTED" in plan.refused
    assert plan.argument == plan.output == 20 * GiB
    assert plan.peak > target.device_memory
    small = jax.ShapeDtypeStruct((2**20,), jnp.float32)
    fitting = eqx_lean.memory.plan(lambda a: a * 2, small, target=target)
    assert fitting.fits and fitting.refused is None


def test_plan_follows_filter_jit_argument_rules(getkey):
    linear = eqx.filter_eval_shape(eqx.nn.Linear, 256, 512, key=getkey())
    x = jnp.zeros((8, 256))  # a concrete array: planned by shape on the target

    def forward(model, x, activation):
        return activation(jax.vmap(model)(x))

    plan = eqx_lean.memory.plan(forward, linear, x, jax.nn.relu, target="cpu")
    assert plan.argument == (256 * 512 + 512 + 8 * 256) * 4
    assert plan.output == 8 * 512 * 4
    assert plan.xla_peak is None  # on CPU XLA's peak counts only arguments


def test_plan_refuses_large_closed_over_arrays():
    table = jnp.ones((1024, 1024))  # 4 MiB

    def lookup(i):
        return table[i]

    with pytest.raises(ValueError, match=r"table \(float32\[1024, 1024\], 4.0 MiB\)"):
        eqx_lean.memory.plan(lookup, jnp.int32(3), target="cpu")
    small = jnp.ones((16,))
    eqx_lean.memory.plan(lambda i: small[i], jnp.int32(3), target="cpu")


@needs_gpu_plugin
def test_plan_rejects_shardings_of_other_devices():
    cpu = jax.sharding.NamedSharding(
        jax.make_mesh((1,), ("x",), devices=jax.devices("cpu")[:1]), jax.P()
    )
    # A sharding chosen for the plan must be on the target, even one of a single device:
    # the same rule as plan_load's `sharding=`.
    x = jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=cpu)
    with pytest.raises(ValueError, match="argument leaf \\[0\\] is over devices that target"):
        eqx_lean.memory.plan(lambda a: a, x, target="8xh100")
    if len(jax.devices("cpu")) > 1:
        mesh = jax.make_mesh((2,), ("x",), devices=jax.devices("cpu")[:2])
        y = jax.device_put(jnp.ones((4, 4)), jax.NamedSharding(mesh, jax.P("x")))
        with pytest.raises(ValueError, match="devices that target '8xh100' does not have"):
            eqx_lean.memory.plan(lambda a: a, y, target="8xh100")


@needs_gpu_plugin
def test_plan_places_this_machines_arrays_on_the_target():
    where = eqx_lean.memory.target("8xh100")
    # Concrete arrays made here (committed to a CPU device or not) and NumPy arrays alone: a
    # single-device program on the target's first device.
    committed = jax.device_put(jnp.ones((256, 256)), jax.devices("cpu")[0])
    alone = eqx_lean.memory.plan(
        lambda a, b: a @ b + 1, committed, np.ones((256, 256), np.float32), target=where
    )
    assert alone.platform == "gpu" and alone.argument == 2 * 256 * 256 * 4
    # Beside an argument sharded over the mesh, an uncommitted scalar (optax's step count) is
    # replicated over the mesh's devices, as a run places it; it used to fail to compile.
    mesh = where.mesh((8,), ("x",))
    sharded = jax.ShapeDtypeStruct(
        (8, 1024), jnp.float32, sharding=jax.NamedSharding(mesh, jax.P("x"))
    )
    count = jnp.zeros((), jnp.int32)
    assert not count.committed
    mixed = eqx_lean.memory.plan(lambda a, n: a * n.astype(a.dtype), sharded, count, target=where)
    assert mixed.num_devices == 8 and mixed.argument == 1024 * 4 + 4


def test_plan_argument_errors():
    with pytest.raises(ValueError, match="donate names argument 3"):
        eqx_lean.memory.plan(lambda a: a, jnp.ones(2), target="cpu", donate=[3])
    with pytest.raises(ValueError, match="donate must be"):
        eqx_lean.memory.plan(lambda a: a, jnp.ones(2), target="cpu", donate="some")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="target must be"):
        eqx_lean.memory.plan(lambda a: a, jnp.ones(2), target=np.float32(1))  # pyright: ignore[reportArgumentType]


@needs_libtpu
def test_libtpu_held_by_another_process_says_what_to_set(monkeypatch):
    from jax.experimental import topologies

    def locked(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(
            'ABORTED: Internal error when accessing libtpu multi-process lockfile. Run "$ sudo rm '
            '/tmp/libtpu_lockfile".'
        )

    monkeypatch.setattr(topologies, "get_topology_desc", locked)
    with pytest.raises(RuntimeError, match="ALLOW_MULTIPLE_LIBTPU_LOAD=1"):
        topology_devices("tpu", "v5e:2x2")
