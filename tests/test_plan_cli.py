"""`python -m eqx_lean.memory lora|full`: `--quantize`, `--fit`, the full-parameter step and
usage errors; and the planners' refusals of bad sizes and mesh axes, before any compile.

The commands that plan run in this process, as the command's planning child runs them
(`EQX_LEAN_PLANNING_CHILD=1`; this process has the planning environment and the `plan` extra's
CUDA plugin), each once, and share JAX's in-memory caches. The usage errors run as the user
runs them, `python -m eqx_lean.memory` in a subprocess (and its child), three at a time,
started by a module fixture; each test reads its own. The expected argument bytes are counted
from the configuration by hand, and `--fit`'s answer is checked against the device memory the
fraction leaves, by hand.
"""

import contextlib
import importlib.util
import io
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from harness import TINY_DECODER, needs_gpu_plugin, subprocess_env

import eqx_lean
from eqx_lean.hf import (
    DecoderConfig,
    lora_config_of_rank,
    plan_lora_step,
    plan_train_step,
    step_memory,
)
from eqx_lean.internal import memory_cli_main, memory_targets


PROG = "python -m eqx_lean.memory"
RANK = 4
SEQ = 16  # the sizes of test_plan_hf's command, so its programs are in the session cache
H100_BYTES = 84978434048
# A per-device budget (332 KiB) between the planned peaks of batch 16 (287 KiB) and batch 24
# (383 KiB) of the tiny decoder's LoRA step on 8 H100s, with blockwise attention and the fused
# loss: `--fit` must search past its first two compiles (8 and 16) to find it.
FIT_FRACTION = "4.0e-6"

# What JAX's plugins print on stderr in an environment with the `plan` extra, whatever the
# command does: not the command's own words.
_PLUGIN_NOISE = re.compile(r"^(WARNING: All log messages before absl|[IWEF]\d{4} \d\d:\d\d:\d\d)")

# The commands' arguments after `python -m eqx_lean.memory`, by name; `{config}` is the
# tiny decoder's config.json.
STEP = ["8xh100", "--config", "{config}", "--seq-len", str(SEQ)]
# The commands that plan, run in this process.
PLANS: dict[str, list[str]] = {
    "qlora": ["lora", *STEP, "--rank", str(RANK), "--quantize", "nf4"],
    "full": ["full", *STEP],
    "fit": ["lora", *STEP, "--rank", str(RANK), "--fit", "--memory-fraction", FIT_FRACTION],
    "16 GPUs": ["lora", "2x8xh100", *STEP[1:], "--rank", str(RANK), "--batch", "16"]
    + ["--mesh", "data=2,fsdp=8"],
}
# The commands refused before planning, run in subprocesses as a user runs them.
COMMANDS: dict[str, list[str]] = {"argparse": ["full", *STEP, "--quantize", "nf4"]}
# Usage errors: the arguments, and words the one line on stderr must hold. They fail before
# any compile; a few kinds (argparse's own, the command's, the planners' checks run in the
# planning process, a target spec, the config file), the rest are checked in-process below.
USAGE_ERRORS: dict[str, tuple[list[str], str]] = {
    "zero batch": (["lora", *STEP, "--batch", "0"], "--batch must be an integer of at least 1"),
    "batch not a multiple": (
        ["lora", *STEP, "--batch", "12"],
        "batch_size 12 must be a multiple of the number of devices (8)",
    ),
    "16 GPUs in one host": (["lora", "16xh100", "--config", "{config}"], "'2x8xh100'"),
    "missing config": (["full", "8xh100", "--config", "{missing}"], "can't open"),
}


class Commands:
    """The commands, started now, three at a time (each is two Python processes, each of a few
    hundred MiB); `result(name)` waits for one."""

    def __init__(self, directory: Path, timeout: float):
        (directory / "config.json").write_text(json.dumps(dict(TINY_DECODER, model_type="mistral")))
        names = {"config": str(directory / "config.json"), "missing": str(directory / "no.json")}
        self.timeout = timeout
        commands = dict(COMMANDS) | {name: a for name, (a, _) in USAGE_ERRORS.items()}
        self.pool = ThreadPoolExecutor(max_workers=3)
        self.futures = {
            name: self.pool.submit(self._run, [a.format(**names) for a in arguments])
            for name, arguments in commands.items()
        }

    def _run(self, argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "eqx_lean.memory", *argv],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=self.timeout,
        )

    def result(self, name: str) -> tuple[int, str, str]:
        done = self.futures[name].result()
        return done.returncode, done.stdout, done.stderr

    def stop(self) -> None:
        self.pool.shutdown(cancel_futures=True)


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        pytest.skip("the plan-gpu extra (JAX's CUDA plugin) is not installed")
    started = Commands(tmp_path_factory.mktemp("plan_cli"), timeout=600)
    yield started
    started.stop()


class Plans:
    """The commands that plan, each run in this process on first use (`result(name)`)."""

    def __init__(self, directory: Path):
        self.config = directory / "config.json"
        self.config.write_text(json.dumps(dict(TINY_DECODER, model_type="mistral")))
        self.results: dict[str, tuple[int, str, str]] = {}

    def result(self, name: str) -> tuple[int, str, str]:
        if name not in self.results:
            argv = [a.format(config=str(self.config)) for a in PLANS[name]]
            out, err = io.StringIO(), io.StringIO()
            with (
                pytest.MonkeyPatch.context() as patch,
                contextlib.redirect_stdout(out),
                contextlib.redirect_stderr(err),
            ):
                patch.setenv("EQX_LEAN_PLANNING_CHILD", "1")  # plan here, as the child does
                code = memory_cli_main(argv)
            self.results[name] = (code, out.getvalue(), err.getvalue())
        return self.results[name]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    return Plans(tmp_path_factory.mktemp("plan_cli_plans"))


def _own_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line and not _PLUGIN_NOISE.match(line)]


def _bytes(text: str, row: str) -> float:
    """A row of a printed plan (`arguments  30.0 KiB`) in bytes, to the printed precision."""
    match = re.search(rf"^{re.escape(row)}\s+(-?[\d.]+) (B|KiB|MiB|GiB)$", text, re.MULTILINE)
    assert match is not None, (row, text)
    unit = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[match.group(2)]
    return float(match.group(1)) * unit


def _parameters(c: dict) -> tuple[int, int, int]:
    """(base parameters, of which in the decoder's linears, adapters of rank RANK)."""
    h, i, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    projections = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    linears = n * sum(a * b for a, b in projections)
    base = v * h + linears + n * 2 * h + h + v * h  # embedding, layers, final norm, LM head
    adapters = n * sum(RANK * (a + b) for a, b in projections)
    return base, linears, adapters


# --- the commands ------------------------------------------------------------------------


@needs_gpu_plugin
def test_quantize_plans_a_qlora_step(plans):
    code, out, err = plans.result("qlora")
    assert code == 0, err[-3000:]
    assert f"(rank {RANK}, all seven projections, nf4 base, remat true)" in out
    assert "plan for 8xh100 (8 x gpu), per device: fits" in out
    base, linears, adapters = _parameters(TINY_DECODER)
    ids = 8 * SEQ * 4 // 8
    # A bfloat16 base would be 2 bytes a parameter; NF4 is half a byte plus a scale per 64,
    # so the linears' bytes must shrink by well over half (by hand: 2 -> at most 0.6).
    bf16 = (2 * base + 3 * 4 * adapters) // 8 + ids
    quantized_at_most = bf16 - (2 - 0.6) * linears / 8
    assert _bytes(out, "arguments") <= quantized_at_most, (out, bf16, quantized_at_most)


@needs_gpu_plugin
def test_full_parameter_step(plans):
    code, out, err = plans.result("full")
    assert code == 0, err[-3000:]
    assert out.startswith("Full-parameter step (AdamW on every weight, remat true)")
    assert f"batch 8 x {SEQ} tokens" in out
    base, _, _ = _parameters(TINY_DECODER)
    # bfloat16 weights and AdamW's two bfloat16 moments, all sharded over 8 devices, the token
    # ids split by rows, and the optimizer's int32 step count, replicated.
    by_hand = 3 * 2 * base // 8 + 8 * SEQ * 4 // 8 + 4
    assert abs(_bytes(out, "arguments") - by_hand) <= 0.05 * 2**10, (out, by_hand)
    # The weights and the moments are donated: updated in place.
    assert _bytes(out, "donated outputs (alias)") <= -(3 * 2 * base // 8) + 0.05 * 2**10


@needs_gpu_plugin
def test_fit_finds_the_largest_batch(plans):
    code, out, err = plans.result("fit")
    assert code == 0, err[-3000:]
    head = r"^largest batch that fits: (\d+) \(multiples of 8 up to 4096; (\d+) compiles: (.*)\)$"
    found = re.search(head, out, re.MULTILINE)
    assert found is not None, out
    batch, compiles = int(found.group(1)), int(found.group(2))
    tried = {
        int(b): (verdict == "fits", float(kib) * 2**10)
        for b, verdict, kib in re.findall(r"(\d+) (fits|does not) \(([\d.]+) KiB\)", found[3])
    }
    assert len(tried) == compiles <= 5, out
    # Each verdict is the printed peak against the memory the fraction leaves, by hand.
    memory = int(H100_BYTES * float(FIT_FRACTION))
    for b, (fits, peak) in tried.items():
        assert fits == (peak <= memory) and abs(peak - memory) > 2**10, (b, out)
    # The answer fits, and the next multiple of the devices does not: the largest batch.
    assert batch >= 16 and tried[batch][0] and not tried[batch + 8][0], out
    assert "plan for 8xh100 (8 x gpu), per device: fits" in out


@needs_gpu_plugin
def test_sixteen_gpus_as_two_hosts_of_eight(plans):
    """16 H100s plan as 2 hosts of 8 (an H100 SXM host holds 8), whatever the mesh over them."""
    code, out, err = plans.result("16 GPUs")
    assert code == 0, err[-3000:]
    assert "plan for 2x8xh100 (16 x gpu), per device: fits" in out


@pytest.mark.parametrize("name", sorted(USAGE_ERRORS))
def test_usage_errors_are_one_line_and_exit_2(commands, name):
    code, out, err = commands.result(name)
    expected = USAGE_ERRORS[name][1]
    lines = _own_lines(err)
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"{PROG} "), lines
    assert ": error: " in lines[0] and expected in lines[0], lines
    assert out == ""


def test_argparse_errors_stay_argparse_errors(commands):
    """`--quantize` is LoRA's: a full step refuses it as argparse refuses any unknown option."""
    code, out, err = commands.result("argparse")
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert _own_lines(err)[-1].endswith("unrecognized arguments: --quantize nf4"), err


# --- the same checks in-process: every usage error, each before any compile ----------------


@needs_gpu_plugin
@pytest.mark.parametrize(
    "arguments, expected",
    [
        (["--batch", "-8"], "--batch must be an integer of at least 1; got -8."),
        (["--seq-len", "0"], "--seq-len must be an integer of at least 1; got 0."),
        (["--rank", "0"], "--rank must be an integer of at least 1; got 0."),
        (["--mesh", "fsdp"], "--mesh must be name=size,...; got 'fsdp'."),
        (["--mesh", "data=-2,fsdp=-4"], "size of axis 'data' in `mesh_axes` must be an integer"),
        (["--mesh", "data=2,fsdp=2"], "hold 4 devices; target '8xh100' has 8"),
        (["--mesh", "model=8"], "mesh_axes names must be 'data' and 'fsdp'"),
        (["--mesh", "data=2,data=4"], "names in `mesh_axes` must name each axis once"),
        (["--memory-fraction", "2"], "memory_fraction must be in (0, 1], got 2.0."),
        (["--max-batch", "64"], "--max-batch applies with --fit only."),
        (["--fit", "--max-batch", "4"], "--max-batch must be at least the number of devices (8)"),
        (["--quantize", "NF4"], "`quantize` must be None, 'nf4', 'int8'"),
        (["--max-seq", "--fit"], "--max-seq and --fit search different sizes"),
        (["--max-seq", "--seq-len", "64"], "--max-seq searches the sequence length"),
        (["--seq-step", "512"], "--seq-step applies with --max-seq only."),
        (["--max-seq", "--seq-step", "0"], "--seq-step must be an integer of at least 1; got 0."),
    ],
)
def test_every_usage_error_in_process(arguments, expected, tmp_path, monkeypatch, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(TINY_DECODER, model_type="mistral")))
    monkeypatch.setenv("EQX_LEAN_PLANNING_CHILD", "1")  # plan here, not in a child process
    code = memory_cli_main(["lora", "8xh100", "--config", str(config), *arguments])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith(f"{PROG} lora: error: ") and err.count("\n") == 1, err
    assert expected in err


def test_a_bad_config_file_is_a_usage_error(tmp_path, monkeypatch, capsys):
    config = tmp_path / "config.json"
    config.write_text("{not json")
    monkeypatch.setenv("EQX_LEAN_PLANNING_CHILD", "1")
    assert memory_cli_main(["full", "cpu", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{PROG} full: error: ") and err.count("\n") == 1, err


# --- the planners' refusals ------------------------------------------------------------------


@pytest.mark.parametrize(
    "shapes, names, error, expected",
    [
        ((-2, -4), ("a", "b"), ValueError, "`axis_shapes`[0] must be an integer of at least 1"),
        ((True, 8), ("a", "b"), TypeError, "`axis_shapes`[0] must be an integer"),
        ((8.0,), ("a",), TypeError, "`axis_shapes`[0] must be an integer"),
        ((), (), ValueError, "`axis_shapes` must hold at least one axis"),
        ((2, 4), ("a", "a"), ValueError, "`axis_names` must name each axis once; ['a']"),
        ((8,), ("",), TypeError, "`axis_names`[0] must be a non-empty string"),
        ((2, 4), ("a",), ValueError, "`axis_names` has 1 names for the 2 sizes"),
        ((2, 2), ("a", "b"), ValueError, "must equal the number of devices"),
        ("8", ("a",), TypeError, "`axis_shapes` must be a sequence"),
    ],
)
def test_target_mesh_refuses_bad_axes(shapes, names, error, expected, compiles):
    target = eqx_lean.memory.target("cpu")
    assert len(target.devices) == 8
    with pytest.raises(error) as refused:
        target.mesh(shapes, names)
    assert expected in str(refused.value)
    assert compiles.count == 0


def test_memory_fraction_is_a_number_not_a_bool():
    with pytest.raises(TypeError, match="`memory_fraction` must be a finite number; got True"):
        eqx_lean.memory.target("cpu", memory_fraction=True)


STEP_REFUSALS = [
    (dict(batch_size=0), ValueError, "`batch_size` must be an integer of at least 1; got 0."),
    (dict(batch_size=-8), ValueError, "`batch_size` must be an integer of at least 1; got -8."),
    (dict(batch_size=True), TypeError, "`batch_size` must be an integer"),
    (dict(batch_size=8.0), TypeError, "`batch_size` must be an integer"),
    (dict(seq_len=0), ValueError, "`seq_len` must be an integer of at least 1; got 0."),
    (dict(seq_len=-1), ValueError, "`seq_len` must be an integer of at least 1; got -1."),
    (dict(mesh_axes=[]), ValueError, "`mesh_axes` must hold at least one (name, size) pair"),
    (dict(mesh_axes="fsdp"), TypeError, "`mesh_axes` must be a sequence of (name, size) pairs"),
    (dict(mesh_axes=[("fsdp",)]), TypeError, "`mesh_axes` entries must be (name, size) pairs"),
    (dict(mesh_axes=[("fsdp", -8)]), ValueError, "axis 'fsdp' in `mesh_axes` must be an integer"),
    (dict(mesh_axes=[("fsdp", True)]), TypeError, "axis 'fsdp' in `mesh_axes` must be an"),
    (
        dict(mesh_axes=[("data", 2), ("data", 4)]),
        ValueError,
        "names in `mesh_axes` must name each axis once; ['data']",
    ),
    (dict(mesh_axes=[("data", 2), ("fsdp", 2)]), ValueError, "`mesh_axes` (2, 2) hold 4 devices"),
]


@pytest.mark.parametrize("planner", [plan_lora_step, plan_train_step])
@pytest.mark.parametrize("changed, error, expected", STEP_REFUSALS)
def test_step_plans_refuse_bad_sizes_and_axes(planner, changed, error, expected, compiles):
    arguments: dict[str, Any] = dict(batch_size=8, seq_len=8) | changed
    with pytest.raises(error) as refused:
        planner(DecoderConfig(**TINY_DECODER), "cpu", **arguments)
    assert expected in str(refused.value)
    assert compiles.count == 0


@pytest.mark.parametrize(
    "changed, error, expected",
    [
        (dict(batch_size=0), ValueError, "`batch_size` must be an integer of at least 1; got 0."),
        (dict(batch_size=True), TypeError, "`batch_size` must be an integer"),
        (dict(seq_len=-8), ValueError, "`seq_len` must be an integer of at least 1; got -8."),
    ],
)
def test_step_memory_refuses_bad_sizes(changed, error, expected, compiles):
    arguments: dict[str, Any] = dict(batch_size=2, seq_len=8) | changed
    with pytest.raises(error) as refused:
        step_memory(DecoderConfig(**TINY_DECODER), lora_config_of_rank(RANK), **arguments)
    assert expected in str(refused.value)
    assert compiles.count == 0


@pytest.mark.parametrize("shape", [(0, 8), (8, 0), (-1, 8)])
def test_plan_train_step_refuses_an_empty_or_negative_batch(shape, compiles):
    model = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    ids = jax.ShapeDtypeStruct(shape, jnp.int32)
    with pytest.raises(ValueError) as refused:
        eqx_lean.memory.plan_train_step(
            lambda m, x: jnp.sum(m["w"]) * x.size, model, optax.sgd(1.0), ids, target="cpu"
        )
    assert f"batch argument [0] has shape {shape}" in str(refused.value)
    assert compiles.count == 0


@pytest.mark.parametrize(
    "changed, expected",
    [
        (dict(batch_multiple=True), "`batch_multiple` must be an integer"),
        (dict(max_batch=True), "`max_batch` must be an integer"),
        (dict(batch_multiple=8, max_batch=4), "`max_batch` must be an integer of at least 8"),
    ],
)
def test_fit_refuses_bool_sizes(changed, expected):
    with pytest.raises((TypeError, ValueError)) as refused:
        eqx_lean.memory.fit(
            lambda remat: lambda m, x: jnp.sum(m["w"]),
            {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)},
            optax.sgd(1.0),
            lambda b: (jax.ShapeDtypeStruct((b, 8), jnp.float32),),
            target="cpu",
            **changed,
        )
    assert expected in str(refused.value)


# --- 16 GPUs ---------------------------------------------------------------------------


@needs_gpu_plugin
def test_sixteen_gpus_are_two_hosts_of_eight_in_one_of_sixteen_never(compiles):
    """The mesh over 2 hosts of 8 may take any shape, `1x1x16` included (the command above
    plans on one); one host of 16 is refused, naming the spec to write instead."""
    where = eqx_lean.memory.target("2x8xh100")
    assert len(where.devices) == 16
    assert {d.process_index for d in where.devices} == {0, 1}
    assert where.mesh((1, 1, 16), ("a", "b", "fsdp")).shape == {"a": 1, "b": 1, "fsdp": 16}
    with pytest.raises(ValueError, match="'2x8xh100'"):
        eqx_lean.memory.target("16xh100")
    assert memory_targets.MAX_GPUS_PER_HOST == 8
    assert compiles.count == 0
