"""Long contexts (issue 44): `remat="offload"`, the carries' name, host bytes in plans, what a
plan needs to fit, and the search for the longest sequence that fits (`memory.longest`,
`hf.longest_context`, `python -m eqx_lean.memory ... --max-seq`).

The search is checked against plans made by hand (no compile): an affine peak, a jump, none
fitting, all fitting, a compile budget. Offloading is checked by value against `remat=True` on
this CPU (where it compiles to the same program: measured) and, compiled for one H100, by its
host bytes counted by hand from the carries' shapes.
"""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import TINY_DECODER, assert_bitwise_equal, needs_gpu_plugin

import eqx_lean
from eqx_lean import hf, memory
from eqx_lean.internal import Tricks, memory_cli_main, mlp_chunk, platform_tricks


MiB = 2**20


# --- the search, on plans made by hand -------------------------------------------------------


def _plan(needed: int, memory_bytes: int, *, xla_peak: int | None = None, host: int = 0):
    return memory.Plan(
        target="made by hand",
        platform="gpu",
        num_devices=1,
        argument=0,
        output=0,
        alias=0,
        temp=needed,
        peak=needed,
        xla_peak=xla_peak,
        device_memory=memory_bytes,
        fits=max(needed, (xla_peak or 0) - host) <= memory_bytes,
        refused=None,
        compile_seconds=0.0,
        host=host,
    )


class Planner:
    """`size -> Plan` for a peak given as a function of the size, counting the calls."""

    def __init__(self, peak, memory_bytes: int = 1000):
        self.peak, self.memory, self.calls = peak, memory_bytes, []

    def __call__(self, size: int):
        self.calls.append(size)
        return _plan(int(self.peak(size)), self.memory)


def test_an_affine_peak_takes_four_compiles():
    planner = Planner(lambda n: 100 + 3 * n)  # fits up to n = 300
    found = memory.longest(planner, maximum=10_000, multiple=4, first=16)
    assert (found.size, found.bound) == (300, 304)
    assert found.compiles == len(planner.calls) == 4, found.tried
    assert found.plan.peak == 1000 and found.plan.fits


def test_a_jump_is_bracketed_within_the_budget():
    # Affine, then 300 bytes more from n = 250 on (XLA changing its plan with the size): the
    # answer is 300 (400 + 2 x 300 = 1000), well below the 450 the first line says.
    planner = Planner(lambda n: 100 + 2 * n + (300 if n >= 250 else 0))
    found = memory.longest(planner, maximum=100_000, multiple=1, first=10)
    assert (found.size, found.bound) == (300, 301), found.tried
    assert found.compiles <= 8, found.tried
    # The same search stopped after 4 compiles: an open bracket around the answer.
    stopped = memory.longest(planner, maximum=100_000, multiple=1, first=10, max_compiles=4)
    assert stopped.compiles == 4 and stopped.bound is not None, stopped.tried
    assert stopped.size <= 300 < stopped.bound and stopped.bound - stopped.size > 1


def test_first_too_large_searches_below_it():
    found = memory.longest(Planner(lambda n: 10 * n), maximum=1000, multiple=1, first=512)
    assert (found.size, found.bound) == (100, 101)
    assert found.tried[0][:1] == (512,) and found.tried[1][:1] == (1,)


def test_none_fits_and_all_fit():
    none = memory.longest(Planner(lambda n: 2000 + n), maximum=64, multiple=8, first=16)
    assert (none.size, none.bound, none.compiles) == (0, 8, 2)
    assert not none.plan.fits and none.plan.peak == 2008  # the smallest tried
    every = memory.longest(Planner(lambda n: n), maximum=640, multiple=8, first=16)
    assert every.size == 640 and every.bound is None and every.plan.fits


@pytest.mark.parametrize(
    "changed, error, words",
    [
        (dict(plan_at=3), TypeError, "`plan_at` must be callable"),
        (dict(multiple=0), ValueError, "`multiple`"),
        (dict(maximum=2, multiple=4), ValueError, "`maximum`"),
        (dict(first=6, multiple=4), ValueError, "`first` must be a multiple of `multiple` (4)"),
        (dict(max_compiles=1), ValueError, "`max_compiles`"),
        (dict(first=True), TypeError, "`first`"),
    ],
)
def test_search_arguments_are_checked(changed, error, words):
    arguments = dict(plan_at=Planner(lambda n: n), maximum=100) | changed
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        memory.longest(arguments.pop("plan_at"), **arguments)


def test_fits_is_judged_on_xla_peak_less_host_bytes():
    # XLA's peak counts offloaded (host) buffers: measured on an H100 plan, it reads the
    # arguments plus the host bytes. Less them, it is a device figure, judged beside `peak`.
    offloaded = _plan(400, 1000, xla_peak=1400, host=1000)
    assert offloaded.needed == 400 and offloaded.fits
    # A TPU's temporaries can read far below XLA's own peak: the larger one decides.
    tpu_like = _plan(400, 1000, xla_peak=1200)
    assert tpu_like.needed == 1200 and not tpu_like.fits
    assert "XLA's peak, less host bytes" in tpu_like.table()
    assert "host memory (offloaded)" in offloaded.table()


# --- remat="offload" and the carries' name ---------------------------------------------------


class Layer(eqx.Module):
    weight: jax.Array

    def __call__(self, x):
        return jnp.tanh(x @ self.weight)


def _stack(layers: int = 4, dim: int = 8) -> Layer:
    return Layer(jax.random.normal(jax.random.key(0), (layers, dim, dim)) / 3)


def _fold_grad(remat):
    def loss(stack, x):
        return jnp.sum(eqx_lean.fold(stack, x, remat=remat) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def test_offload_on_cpu_is_remat_true():
    stack, x = _stack(), jax.random.normal(jax.random.key(1), (3, 8))
    offload, recompute = _fold_grad("offload"), _fold_grad(True)
    assert_bitwise_equal(offload(stack, x), recompute(stack, x))
    # Host and device memory are one on a CPU: the program is `True`'s (measured).
    temps = [
        f.lower(stack, x).compile().memory_analysis().temp_size_in_bytes  # type: ignore[union-attr]
        for f in (offload, recompute)
    ]
    assert temps[0] == temps[1]


def test_a_name_based_policy_selects_the_carry():
    # Keeping only the named carries is `remat=True`'s memory and values: the name is on
    # every leaf of the carry entering each layer.
    stack, x = _stack(), jax.random.normal(jax.random.key(1), (3, 8))
    keep = jax.checkpoint_policies.save_only_these_names(eqx_lean.LAYER_CARRY)
    kept, saved = _fold_grad(keep)(stack, x), _fold_grad(None)(stack, x)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(saved), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_remat_strings_are_checked():
    with pytest.raises(ValueError, match="'nested', 'offload'"):
        eqx_lean.fold(_stack(), jnp.zeros((3, 8)), remat="offloaded")  # type: ignore[arg-type]


# --- compiled for one H100: host bytes by hand, the context search ---------------------------

SMALL_GPU = dict(memory_fraction=0.0003)  # 24.3 MiB of an H100: about 4,000 tokens


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY_DECODER, model_type="mistral")))
    return path


@pytest.mark.parametrize(
    "changed, error, words",
    [
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(batch_size=4), ValueError, "multiple of the number of devices (8)"),
        (dict(multiple=0), ValueError, "`multiple`"),
        (dict(first=3000), ValueError, "`first` must be a multiple of `multiple` (2048)"),
        (dict(max_seq_len=1024), ValueError, "`max_seq_len`"),
        (dict(remat="offloaded"), ValueError, "'offload'"),
    ],
)
def test_longest_context_checks_before_compiling(changed, error, words):
    config = hf.DecoderConfig(**TINY_DECODER)
    arguments = dict(batch_size=8) | changed  # the suite's CPU target has 8 devices
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        hf.longest_context(config, "cpu", **arguments)


@needs_gpu_plugin
def test_cli_max_seq_prints_the_longest_and_its_host_memory(config_file, monkeypatch, capsys):
    # `hf.longest_context` (what `lora --max-seq` runs), with its answer checked against the
    # verdicts of its own compiles and its host bytes counted by hand.
    monkeypatch.setenv("EQX_LEAN_PLANNING_CHILD", "1")  # plan here, not in a child process
    argv = ["lora", "h100", "--config", str(config_file), "--rank", "4", "--remat", "offload"]
    argv += ["--max-seq", "--seq-step", "256", "--memory-fraction", "0.0003"]
    code = memory_cli_main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "remat offload" in out and "batch 1 x <longest> tokens" in out
    head = "longest sequence that fits: "
    line = next(line for line in out.splitlines() if line.startswith(head))
    longest = int(line[len(head) :].split(" ")[0].replace(",", ""))
    assert longest > 0 and longest % 256 == 0, out
    # Its own compiles: the answer fits, the next multiple does not, at most 8 of them.
    search = re.search(r"\((\d+) compiles: (.*)\)$", out, re.MULTILINE)
    assert search is not None and int(search.group(1)) <= 8, out
    verdicts = {
        int(size.replace(",", "")): verdict == "fits"
        for size, verdict in re.findall(r"([\d,]+) (fits|does not) \(", search.group(2))
    }
    assert verdicts[longest] and not verdicts[longest + 256], out
    # The carries of two layers, [1, longest, 64] bfloat16, in host memory.
    host = 2 * longest * 64 * 2
    shown = re.search(r"^host memory \(offloaded\)\s+([\d.]+) KiB$", out, re.MULTILINE)
    assert shown is not None and float(shown.group(1)) == host / 2**10, out


# --- the MLP's chunk by platform, and plans traced with the target's choices ----------------


@pytest.mark.parametrize(
    "platform, mlp, loss",
    [("cpu", 8, 64), ("gpu", 256, 256), ("cuda", 256, 256), ("tpu", 256, 64)],
)
def test_chunk_sizes_per_platform(platform, mlp, loss):
    tricks = Tricks.for_platform(platform)
    assert (tricks.mlp_chunk_bytes, tricks.loss_chunk_bytes) == (mlp * MiB, loss * MiB)


def test_a_trace_for_another_platform_takes_its_choices():
    # What the decoder reads while tracing: the CPU's chunk here, an H100's inside a plan's
    # trace for one (`tracing_for`, which `memory.plan` enters), whatever this machine is.
    config = hf.DecoderConfig(**dict(TINY_DECODER, intermediate_size=4096))
    x = jax.ShapeDtypeStruct((1, 16_384, config.hidden_size), jnp.bfloat16)
    per_position = config.intermediate_size * 2  # bfloat16: 8 KiB a position

    def chunk():
        found = []
        jax.eval_shape(lambda x: found.append(mlp_chunk(config, x, None)), x)
        return found[0]

    assert chunk() == 8 * MiB // per_position  # 1,024 positions a chunk on this CPU
    with platform_tricks.tracing_for("gpu"):
        assert platform_tricks.platform_of([]) == "gpu"
        assert chunk() is None  # 128 MiB in all: one chunk within a GPU's 256 MiB
    assert platform_tricks.platform_of([]) == jax.default_backend()
