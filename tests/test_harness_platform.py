"""The test harness's platform branches, forced here: what `harness.py` and `conftest.py` choose
where the default backend is a GPU (the CPU pinning of `cpu_mesh` tests, the `xla_cpu` and
`private_jax` skips, the float32 tolerances), by faking `harness.default_backend`, the one seam
they read. On this CPU machine nothing changes; on a GPU machine these run as they would here."""

import types

import conftest
import harness
import jax
import numpy as np
import pytest
from harness import mesh_of, pinned_to_cpu, platform_skip_reason, tolerance

import eqx_lean.internal


@pytest.fixture
def on_a_gpu(monkeypatch):
    """The default backend reads as a GPU with one device: `jax.devices()` gives one device
    (the first CPU's, standing for the GPU), `jax.devices("cpu")` the eight CPU devices."""
    real_devices = jax.devices
    monkeypatch.setattr(harness, "default_backend", lambda: "gpu")
    monkeypatch.setattr(
        jax, "devices", lambda backend=None: real_devices(backend or "cpu")[: 8 if backend else 1]
    )


def test_the_cpu_runs_everything_with_its_own_bounds():
    assert harness.on_cpu() == (jax.default_backend() == "cpu")
    if harness.on_cpu():
        assert platform_skip_reason(["xla_cpu"]) is None
        assert tolerance("loop") == 1e-6
    if eqx_lean.internal.private_jax_allowed():
        assert platform_skip_reason(["private_jax"]) is None


def test_on_a_gpu_xla_cpu_tests_are_skipped_with_the_reason(on_a_gpu):
    reason = platform_skip_reason(["xla_cpu"])
    assert reason is not None and "XLA:CPU" in reason and "gpu" in reason
    assert platform_skip_reason([]) is None


def test_without_private_jax_private_jax_tests_are_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(eqx_lean.internal, "private_jax_allowed", lambda: False)
    reason = platform_skip_reason(["private_jax"])
    assert reason is not None and "private_jax_allowed() is false" in reason
    assert jax.__version__ in reason


def test_the_collection_hook_adds_the_skip(on_a_gpu):
    """`conftest.pytest_itemcollected` marks an `xla_cpu` test skipped on a GPU, and leaves a
    `cpu_mesh` test to run."""

    def item(*names):
        added = []
        marks = {name: getattr(pytest.mark, name).mark for name in names}
        fake = types.SimpleNamespace(get_closest_marker=marks.get, add_marker=added.append)
        conftest.pytest_itemcollected(fake)  # type: ignore[arg-type]
        return added

    (skip,) = item("xla_cpu")
    assert skip.mark.name == "skip" and "XLA:CPU" in skip.mark.kwargs["reason"]
    assert item("cpu_mesh") == []


def test_on_a_gpu_tolerances_come_from_the_gpu_column(on_a_gpu):
    gpu, cpu = harness.TOLERANCES["gpu"], harness.TOLERANCES["cpu"]
    assert tolerance("loop") == gpu["loop"] > cpu["loop"]


def test_on_a_gpu_a_cpu_mesh_test_gets_the_eight_cpu_devices(on_a_gpu):
    assert len(jax.devices()) == 1
    with pytest.raises(AssertionError, match="needs more than 1 devices"):
        mesh_of((8,), ("data",))
    with pinned_to_cpu():
        assert jax.devices() == jax.devices("cpu") and len(jax.devices()) == 8
        mesh = mesh_of((2, 4), ("data", "model"))
        assert {d.platform for d in mesh.devices.flat} == {"cpu"}
        assert jax.make_mesh((8,), ("data",)).devices.size == 8
        default = jax.config.jax_default_device  # pyright: ignore[reportAttributeAccessIssue]
        assert default == jax.devices("cpu")[0]
        with pinned_to_cpu():  # a test marked inside a module marked: entered once
            assert len(jax.devices()) == 8
        assert np.asarray(jax.numpy.arange(3)).tolist() == [0, 1, 2]
    assert len(jax.devices()) == 1
    assert jax.config.jax_default_device is None  # pyright: ignore[reportAttributeAccessIssue]
