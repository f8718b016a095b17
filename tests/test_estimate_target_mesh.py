"""`memory.estimate(..., mesh=target.mesh(...))` without `sharding=` estimates the build on the
target's mesh (replicated over it, as `sharding=P()`), compiled for the target, not this CPU;
and a target spec beyond the largest GPU topology shown to compile is refused before anything is
built.

Expected figures come from programs compiled here with `jax.jit` for the same device, not from
the code under test."""

import importlib.util

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P, SingleDeviceSharding

import eqx_lean
from eqx_lean.internal import memory_targets
from eqx_lean.memory import target


HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _make_layer(key):
    return eqx.nn.Linear(512, 512, key=key)


_KEYS = jax.random.split(jax.random.key(0), 4)
_FINAL = 4 * (512 * 512 + 512) * 2  # bfloat16


def _vmap_and_cast(keys):
    # Written here, not taken from eqx_lean: the program `filter_jit(filter_vmap)` compiles.
    stack = eqx.filter_vmap(_make_layer)(keys)
    return [x.astype(jnp.bfloat16) for x in jax.tree.leaves(eqx.filter(stack, eqx.is_array))]


def _jit_vmap_temp(device):
    struct = jax.ShapeDtypeStruct(_KEYS.shape, _KEYS.dtype, sharding=device)
    stats = jax.jit(_vmap_and_cast).lower(struct).compile().memory_analysis()
    assert stats is not None
    return stats.temp_size_in_bytes


@pytest.fixture(scope="module", params=["8xh100", "v4-8"])
def where(request):
    """A GPU target and a TPU one (a v4-8 is 4 megacore chips), made once for the module."""
    needed = HAS_CUDA_PLUGIN if request.param == "8xh100" else HAS_LIBTPU
    if not needed:
        pytest.skip(f"planning for {request.param} needs the plan extra")
    return target(request.param)


def test_a_target_mesh_alone_places_the_build_on_the_target(where):
    n = len(where.devices)
    mesh = where.mesh((n,), ("data",))
    est = eqx_lean.memory.estimate(_make_layer, _KEYS, jnp.bfloat16, mesh=mesh)
    # Replicated over the target's mesh, as `sharding=P()` places it: compiled for the target
    # (the CPU allowance is for XLA:CPU only), the whole stack on each device.
    assert (est.platform, est.num_devices, est.runtime_overhead) == (where.platform, n, 0)
    assert est.final_bytes_per_device == _FINAL
    # The unsharded rows run on the mesh's first device, compiled for it.
    first = SingleDeviceSharding(mesh.devices.flat[0])
    assert est.filter_jit_vmap_temp_bytes == _jit_vmap_temp(first)
    replicated = eqx_lean.memory.estimate(_make_layer, _KEYS, jnp.bfloat16, P(), mesh=mesh)
    assert replicated.platform == where.platform
    assert replicated.build_stacked_peak == est.build_stacked_peak
    assert replicated.write_temp_bytes == est.write_temp_bytes


@pytest.mark.cpu_mesh
def test_a_mesh_of_this_machine_estimates_for_this_machine():
    """A mesh over this machine's own devices (the suite has 8 CPU devices) is not a target's:
    the estimate stays XLA:CPU's."""
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[4:6])
    est = eqx_lean.memory.estimate(_make_layer, _KEYS, jnp.bfloat16, mesh=mesh)
    assert est.platform == "cpu" and est.runtime_overhead > 0
    assert est.filter_jit_vmap_temp_bytes == _jit_vmap_temp(None)


@pytest.mark.parametrize(
    "spec, hosts, per_host",
    [("1000x1000xh100", 1000, 1000), ("33x8xh100", 33, 8), ("9xa100-40gb", 1, 9)],
)
def test_a_gpu_target_beyond_the_largest_topology_is_refused_unbuilt(
    spec, hosts, per_host, monkeypatch
):
    def build(*args, **kwargs):
        raise AssertionError(f"{spec!r} built its devices before being refused")

    monkeypatch.setattr(memory_targets, "_topology_devices", build)
    with pytest.raises(ValueError) as refused:
        target(spec)
    message = str(refused.value)
    assert f"asks for {hosts} host(s) of {per_host} GPU(s)" in message
    assert "at most 8 GPUs per host and at most 32 hosts (256 GPUs" in message


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="planning for GPUs needs the plan extra")
def test_the_largest_gpu_topology_is_accepted():
    assert len(target("32x8xh100").devices) == 256
    assert len(target("8xa100-80gb").devices) == 8
