"""`eqx_lean.use_compilation_cache`: where the cache goes and who decides, and a second run of
the command line that compiles nothing (counted by JAX's own monitoring events), each in a fresh
process: the cache is process-wide JAX configuration."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]

WORKERS = ROOT / "tests" / "workers"


def _python(worker: str, env: dict[str, str], *args: str, base: dict | None = None) -> str:
    """Runs `tests/workers/<worker>` with `args` in a fresh process; returns what it printed."""
    done = subprocess.run(
        [sys.executable, str(WORKERS / worker), *args],
        cwd=ROOT,
        env={**(base or os.environ), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _cache_dir(env: dict[str, str], *directory: str, base: dict | None = None) -> dict:
    """`use_compilation_cache(*directory)` in a fresh process with `env`: what it returned,
    what JAX was configured with, and the machine's key."""
    return json.loads(
        _python("compilation_cache_dir.py", env, *directory, base=base).splitlines()[-1]
    )


def _where(env: dict[str, str], *directory: str) -> dict:
    found = _cache_dir(env, *directory)
    return {"returned": found["returned"], "configured": found["configured"]}


def _counted_cli(env: dict[str, str], *args: str) -> str:
    """`python -m examples.mistral7b ARGS` in a fresh process; its output, then a JSON line of
    JAX's compilation-cache events (`tests/workers/counted_cli.py`)."""
    return _python("counted_cli.py", env, *args)


def test_the_default_directory_is_per_machine_and_private(tmp_path):
    unset = {k: v for k, v in os.environ.items() if k != "EQX_LEAN_COMPILATION_CACHE"}
    found = _cache_dir({"XDG_CACHE_HOME": str(tmp_path)}, base=unset)
    path, configured, key = found["returned"], found["configured"], found["machine_key"]
    assert path == configured == str(tmp_path / "eqx_lean" / "xla" / key)
    assert key.startswith("cpu-") and len(key) == len("cpu-") + 16
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


def test_the_environment_and_jax_s_own_setting_decide(tmp_path):
    assert _where({"EQX_LEAN_COMPILATION_CACHE": "off"}) == {"returned": None, "configured": None}
    assert _where({"EQX_LEAN_COMPILATION_CACHE": "0"})["returned"] is None
    chosen = str(tmp_path / "chosen")
    assert _where({"EQX_LEAN_COMPILATION_CACHE": chosen}) == {
        "returned": chosen,
        "configured": chosen,
    }
    # A cache JAX was told about (JAX_COMPILATION_CACHE_DIR) is kept.
    jax_own = str(tmp_path / "jax_own")
    got = _where({"EQX_LEAN_COMPILATION_CACHE": chosen, "JAX_COMPILATION_CACHE_DIR": jax_own})
    assert got == {"returned": jax_own, "configured": jax_own}
    # A directory passed in wins over the environment, even over "off".
    got = _where({"EQX_LEAN_COMPILATION_CACHE": "off"}, str(tmp_path / "passed"))
    assert got["returned"] == got["configured"] == str(tmp_path / "passed")


def test_a_second_run_of_the_command_line_compiles_nothing(tmp_path):
    """`build --preset tiny` twice on one cache: the first writes every program it compiles,
    the second finds each of them (JAX's `compile_requests_use_cache` = `cache_hits`) and
    prints the same greedy tokens; `--no-compilation-cache` uses none."""
    env = {"EQX_LEAN_COMPILATION_CACHE": str(tmp_path / "cache")}
    outputs = []
    for _ in range(2):
        out = _counted_cli(env, "build", "--preset", "tiny").splitlines()
        outputs.append((out[:-1], json.loads(out[-1])))
    (first_out, first), (second_out, second) = outputs
    assert first["cache_misses"] > 10 and first.get("cache_hits", 0) == 0, first
    assert second["compile_requests_use_cache"] == second["cache_hits"] > 10, second
    assert second.get("cache_misses", 0) == 0, second
    tokens = [[line for line in out if "greedy tokens" in line] for out in (first_out, second_out)]
    assert tokens[0] and tokens[0][0].split(" in ")[0] == tokens[1][0].split(" in ")[0]
    # Without the cache, JAX still counts requests, but reads and writes nothing.
    off = _counted_cli(env, "build", "--preset", "tiny", "--no-compilation-cache")
    counts = json.loads(off.splitlines()[-1])
    assert counts.get("cache_hits", 0) == counts.get("cache_misses", 0) == 0, counts


@pytest.mark.slow  # two fine-tuning processes
def test_a_second_finetune_compiles_nothing(tmp_path):
    import dataclasses

    import jax

    from eqx_lean.hf import DecoderConfig, init, save_hf

    tiny = DecoderConfig.tiny()
    config = dataclasses.replace(tiny, hidden_size=32, intermediate_size=64, vocab_size=256)
    save_hf(init(config, key=jax.random.key(0), std=0.2), tmp_path / "base")
    data = tmp_path / "data.txt"
    data.write_text("a second run compiles nothing. " * 20)
    args = ["finetune", "--checkpoint", str(tmp_path / "base"), "--data", str(data)]
    args += ["--seq-len", "16", "--batch-size", "2", "--steps", "3"]
    env = {"EQX_LEAN_COMPILATION_CACHE": str(tmp_path / "cache")}
    first = _counted_cli(env, *args).splitlines()
    second = _counted_cli(env, *args).splitlines()
    counts = json.loads(second[-1])
    assert counts["compile_requests_use_cache"] == counts["cache_hits"] > 0, counts
    losses = [[x.split(";")[0] for x in out if x.startswith("loss ")] for out in (first, second)]
    assert losses[0] and losses[0] == losses[1]
