"""`memory.estimate` for compile-only targets (every row compiled for the target's devices), and
`memory.plan_load`."""

import importlib.util

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

import eqx_lean
from eqx_lean.internal import BufferPlan, chunks, io_load, lower_chunk_write, plan_chunks
from eqx_lean.memory import target


def _gpu_or_skip():
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        pytest.skip("planning for GPUs needs JAX's CUDA plugin (jax_plugins.xla_cuda12)")
    return target("8xh100")


def _tpu_or_skip():
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("planning for TPUs needs libtpu")
    return target("v5e-16")


def _make_layer(key):
    return eqx.nn.Linear(512, 512, key=key)


def _vmap_and_cast(keys):
    # Written here, not taken from eqx_lean: the program `filter_jit(filter_vmap)` compiles.
    stack = eqx.filter_vmap(_make_layer)(keys)
    return [x.astype(jnp.bfloat16) for x in jax.tree.leaves(eqx.filter(stack, eqx.is_array))]


def _jit_vmap_analysis(keys, device):
    struct = jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=device)
    stats = jax.jit(_vmap_and_cast).lower(struct).compile().memory_analysis()
    assert stats is not None
    return stats


_KEYS = jax.random.split(jax.random.key(0), 4)
_CONSTRUCTION = 4 * (512 * 512 + 512) * 4  # float32
_CAST = _CONSTRUCTION // 2  # the bfloat16 copies


@pytest.mark.parametrize("spec", ["8xh100", "v5e-16"])
def test_estimate_compiles_every_row_for_the_target(spec):
    where = _gpu_or_skip() if spec == "8xh100" else _tpu_or_skip()
    n = len(where.devices)
    mesh = where.mesh((n,), ("fsdp",))
    est = eqx_lean.memory.estimate(
        _make_layer, _KEYS, jnp.bfloat16, eqx_lean.fsdp(mesh, "fsdp"), mesh=mesh
    )
    assert est.platform == where.platform
    assert est.num_devices == n
    assert est.runtime_overhead == 0  # the CPU allowances apply on CPU only
    assert est.final_bytes_per_device == est.final_bytes // n
    # The jitted row is XLA's plan of the same program on the mesh's first device.
    expected = _jit_vmap_analysis(_KEYS, SingleDeviceSharding(mesh.devices.flat[0]))
    assert est.filter_jit_vmap_temp_bytes == expected.temp_size_in_bytes
    assert est.filter_jit_vmap_peak == (
        expected.output_size_in_bytes + expected.temp_size_in_bytes - expected.alias_size_in_bytes
    )
    # Eager: every float32 layer, then the cast copies, plus the largest dispatch's temporaries.
    assert _CONSTRUCTION + _CAST <= est.filter_vmap_peak <= _CONSTRUCTION + _CAST + 2**20


def test_estimate_on_gpu_differs_from_cpu():
    where = _gpu_or_skip()
    mesh = where.mesh((8,), ("fsdp",))
    gpu = eqx_lean.memory.estimate(
        _make_layer, _KEYS, jnp.bfloat16, eqx_lean.fsdp(mesh, "fsdp"), mesh=mesh
    )
    cpu_temp = _jit_vmap_analysis(_KEYS, None).temp_size_in_bytes
    # XLA:CPU keeps float32 temporaries of the whole stack; XLA:GPU fuses the cast into them.
    assert cpu_temp >= _CONSTRUCTION
    assert gpu.filter_jit_vmap_temp_bytes < cpu_temp // 100
    assert gpu.filter_jit_vmap_temp_bytes < 2**16


def test_estimate_on_one_compile_only_device():
    where = _gpu_or_skip()
    device = SingleDeviceSharding(where.devices[3])
    est = eqx_lean.memory.estimate(_make_layer, _KEYS, jnp.bfloat16, device)
    assert (est.platform, est.num_devices, est.runtime_overhead) == ("gpu", 1, 0)
    expected = _jit_vmap_analysis(_KEYS, device)
    assert est.filter_jit_vmap_temp_bytes == expected.temp_size_in_bytes
    assert est.final_bytes_per_device == est.final_bytes == _CAST


# --- plan_load ---------------------------------------------------------------------------------

_NAMES = {".weight": "layers.{i}.weight", ".bias": "layers.{i}.bias"}


def _names(path, _):
    return _NAMES[jax.tree_util.keystr(path)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A stack of 4 float32 `Linear(64, 128)` saved as one tensor per layer."""
    stack = eqx_lean.build_stacked(
        lambda k: eqx.nn.Linear(64, 128, key=k), jax.random.split(jax.random.key(1), 4)
    )
    path = tmp_path_factory.mktemp("plan_load")
    eqx_lean.save_stacked(path, stack, _names)
    return path, eqx.filter_eval_shape(lambda: stack)


_WEIGHT = 4 * 128 * 64
_BIAS = 4 * 128


def test_plan_load_on_cpu_writes_on_the_host(saved, monkeypatch):
    path, like = saved

    def no_reads(*args, **kwargs):
        raise AssertionError("a plan reads only the checkpoint's headers")

    monkeypatch.setattr(io_load, "Maps", no_reads)
    plan = eqx_lean.memory.plan_load(path, like, _names, target="cpu", dtype=jnp.bfloat16)
    loaded = (_WEIGHT + _BIAS) * 2
    assert (plan.platform, plan.num_devices) == ("cpu", 1)
    assert plan.loaded_bytes == plan.loaded_bytes_per_device == loaded
    # Host writes: nothing compiled, nothing staged.
    assert (plan.chunk_temp_bytes, plan.chunk_value_bytes, plan.host_peak) == ((), 0, 0)
    assert plan.device_peak == loaded and plan.fits
    assert "load plan for cpu" in str(plan)


def test_plan_load_on_cpu_with_compiled_writes(saved, monkeypatch):
    path, like = saved
    monkeypatch.setattr(chunks, "HOST_WRITES", False)
    plan = eqx_lean.memory.plan_load(path, like, _names, target="cpu", dtype=jnp.bfloat16)
    # The same write, planned and compiled here: one group, one call per layer.
    device = SingleDeviceSharding(jax.devices("cpu")[0])
    targets = [
        BufferPlan(
            jax.ShapeDtypeStruct((4, *shape), jnp.bfloat16), device, True, np.dtype("float32")
        )
        for shape in [(128,), (128, 64)]  # `like`'s leaf order: bias, weight
    ]
    (group,) = plan_chunks(targets, 4 * 2**20)
    stats = lower_chunk_write(group).compile().memory_analysis()
    assert stats is not None
    temp = stats.temp_size_in_bytes
    values = 2 * (128 + 128 * 64) * 4  # two calls' float32 values of one layer
    loaded = (_WEIGHT + _BIAS) * 2
    assert plan.chunk_temp_bytes == (temp,)
    assert plan.chunk_value_bytes == values
    assert plan.device_peak == loaded + temp + values


@pytest.mark.parametrize("spec", ["8xh100", "v5e-16"])
def test_plan_load_fsdp_on_a_target(saved, spec):
    where = _gpu_or_skip() if spec == "8xh100" else _tpu_or_skip()
    n = len(where.devices)
    path, like = saved
    mesh = where.mesh((n,), ("fsdp",))
    plan = eqx_lean.memory.plan_load(
        path, like, _names, target=where, sharding=eqx_lean.fsdp(mesh, "fsdp"), mesh=mesh
    )
    total = (_WEIGHT + _BIAS) * 4
    assert (plan.platform, plan.num_devices) == (where.platform, n)
    assert plan.loaded_bytes == total
    assert plan.loaded_bytes_per_device == total // n  # every leaf evenly sharded
    assert len(plan.chunk_temp_bytes) == 1
    assert plan.device_peaks == (plan.device_peak,) * n
    assert plan.device_peak == total // n + plan.chunk_temp_bytes[0] + plan.chunk_value_bytes
    assert plan.chunk_value_bytes == 2 * (128 + 128 * 64) * 4 // n
    assert plan.host_peak > 0 and plan.fits


def test_plan_load_refuses_shardings_off_the_target(saved):
    where = _gpu_or_skip()
    path, like = saved
    cpu = SingleDeviceSharding(jax.devices("cpu")[0])
    off_target = "leaf .* is over devices that target '8xh100' does not have"
    with pytest.raises(ValueError, match=off_target):
        eqx_lean.memory.plan_load(path, like, _names, target=where, sharding=cpu)
