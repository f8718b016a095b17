"""Platform tricks (`_platform.py`): applied only to programs for the platform measured on.

JAX 0.10.2 lowers for `cuda` and `tpu` without a device (`lowering_platforms=`), so the lowered
programs are inspected directly; compiler options do not show in lowered text, so the decision
itself is tested for them.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_lean
from eqx_lean.internal import (
    ZERO_COPY_ALIGNMENT,
    Tricks,
    host_zeros,
    layers_per_call,
    lower_writes,
    plan_build,
    platform_tricks,
    release_freed_host_memory,
)


def make_draws(key):
    k = jax.random.split(key, 3)
    return {"w": jax.random.normal(k[1], (512, 300)), "u": jax.random.uniform(k[2], (300, 256))}


KEYS = jax.random.split(jax.random.key(0), 4)


def lowered_texts(platform: str, tricks: Tricks) -> list[str]:
    plan = plan_build(make_draws, KEYS, jnp.bfloat16)
    lowered = lower_writes(plan, tricks=tricks, lowering_platforms=(platform,))
    return [x.as_text() for x in lowered]


@pytest.mark.parametrize("platform", ["cpu", "gpu", "cuda", "rocm", "tpu"])
def test_the_decisions(platform):
    tricks = Tricks.for_platform(platform)
    on_cpu = platform == "cpu"
    assert tricks.fused_threefry == tricks.licm_off == tricks.bit_writes == on_cpu
    assert tricks.layer_runs == on_cpu
    assert tricks.trim_host_heap == (on_cpu and platform_tricks._malloc_trim() is not None)
    expected = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"} if on_cpu else {}
    assert tricks.compiler_options() == expected


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_writes_for_accelerators_keep_jax_s_own_lowering(platform):
    # JAX lowers Threefry unrolled there; the override would add loops for key arithmetic, and
    # one layer is written per call, without a loop.
    for text in lowered_texts(platform, Tricks.for_platform(platform)):
        assert "stablehlo.while" not in text
        assert "xui16>" not in text  # no bit writes
    overridden = lowered_texts(platform, Tricks.for_platform("cpu"))
    assert all("stablehlo.while" in text for text in overridden)


@pytest.mark.private_jax
def test_writes_for_cpu_are_fused_and_move_bits():
    cpu = Tricks.for_platform("cpu")
    fused = lowered_texts("cpu", cpu)
    jax_lowering = lowered_texts("cpu", dataclasses.replace(cpu, fused_threefry=False))
    # JAX's CPU lowering is a rolled loop per draw; fused, only key arithmetic keeps its loop.
    assert sum(t.count("stablehlo.while") for t in fused) < sum(
        t.count("stablehlo.while") for t in jax_lowering
    )
    assert all("xui16>" in text for text in fused)


def test_scan_barrier_is_lowered_for_cpu_only():
    # benchmarks/private_paths.py (docs/benchmarks.md, issue 46): it pays on CPU; on an H100 it
    # lowers a fold gradient's plan and raises a Llama-8B step's (mixed: left off); on a v5e
    # it changes the fold gradient by at most 0.01 MiB.
    stacked = {"w": jnp.ones((3, 8, 8), jnp.bfloat16)}
    x = jnp.ones(8, jnp.float32)

    def forward(stacked, x):
        return eqx_lean.fold(stacked, x, call=lambda layer, x: layer["w"].astype(x.dtype) @ x)

    traced = jax.jit(forward).trace(stacked, x)
    assert "optimization_barrier" in traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "optimization_barrier" not in traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "optimization_barrier" not in traced.lower(lowering_platforms=("tpu",)).as_text()


def test_malloc_trim_runs_only_when_the_tricks_say(monkeypatch):
    calls = []
    monkeypatch.setattr(platform_tricks, "_malloc_trim", lambda: calls.append)
    release_freed_host_memory(Tricks(trim_host_heap=False))
    assert calls == []
    release_freed_host_memory(Tricks(trim_host_heap=True))
    assert calls == [0]


def test_off_cpu_each_call_writes_one_layer(monkeypatch):
    plan = plan_build(make_draws, KEYS, jnp.bfloat16)
    assert layers_per_call(plan) == 4
    monkeypatch.setattr(platform_tricks, "platform_of", lambda shardings: "gpu")
    assert layers_per_call(plan) == 1


def donation_is_in_place(array: jax.Array) -> bool:
    before = array.unsafe_buffer_pointer()
    updated = jax.jit(lambda x: x + 1, donate_argnums=0)(array)
    assert array.is_deleted()
    np.testing.assert_array_equal(np.asarray(updated), np.ones(array.shape, updated.dtype))
    return updated.unsafe_buffer_pointer() == before


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float64])
@pytest.mark.parametrize("device", [None, jax.devices()[0]], ids=["default", "committed"])
def test_host_zeros_are_owned_by_xla_so_a_donation_reuses_them(dtype, device):
    # `jax.device_put` of 64-byte-aligned NumPy data aliases it (about one small array in
    # four, found flaky in CI); XLA then cannot reuse it and a donation copies. Many sizes, so
    # that both alignments of NumPy's allocation come up.
    for rows in range(1, 40):
        zeros = host_zeros((rows, 3), dtype, device)
        assert zeros.shape == (rows, 3)
        assert zeros.dtype == jax.dtypes.canonicalize_dtype(dtype)
        assert zeros.committed == (device is not None)
        assert donation_is_in_place(zeros), rows


def test_host_zeros_copy_what_device_put_aliased(monkeypatch):
    # Force the aligned offset at which `device_put` aliases NumPy's memory: the alias is seen
    # and copied into XLA's own buffer.
    aligned = lambda address, itemsize: -address % ZERO_COPY_ALIGNMENT  # noqa: E731
    monkeypatch.setattr(platform_tricks, "_misaligned_offset", aligned)
    put = jax.device_put
    aliased = []

    def spy(x, *args, **kwargs):
        out = put(x, *args, **kwargs)
        if isinstance(x, np.ndarray):
            aliased.append(out.unsafe_buffer_pointer() == x.ctypes.data)
        return out

    monkeypatch.setattr(jax, "device_put", spy)
    for rows in range(1, 20):
        assert donation_is_in_place(host_zeros((rows, 3), jnp.float32, None)), rows
    assert aliased and all(aliased)
