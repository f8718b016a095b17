"""A compilation cache directory that cannot be used: `eqx_lean.use_compilation_cache` refuses it
with an error naming it and what must be true, and leaves JAX's configuration alone; the
example's command line, which turns the cache on by default, warns in one line and runs
uncached. In fresh processes (`tests/workers/`): the cache is process-wide JAX configuration,
and the permission cases run without root's capabilities (`workers/unprivileged.py`), since
root writes past file permissions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, subprocess_env


WORKERS = REPO / "tests" / "workers"
UNAVAILABLE = 77  # workers/unprivileged.py: the capabilities could not be dropped
# Every variable that decides the cache's directory, unset: each case sets its own.
_UNSET = ("EQX_LEAN_COMPILATION_CACHE", "XDG_CACHE_HOME", "JAX_COMPILATION_CACHE_DIR")


def _unprivileged(
    worker: str, *args: str, env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess:
    """`tests/workers/<worker> ARGS` in a fresh process held by file permissions, as an
    ordinary user is, started in `cwd` (where a relative cache directory would land); skips
    where root's capabilities cannot be dropped."""
    command = [sys.executable, str(WORKERS / "unprivileged.py"), sys.executable]
    done = subprocess.run(
        [*command, str(WORKERS / worker), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode == UNAVAILABLE:
        pytest.skip(done.stderr.strip())
    return done


def _environment(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in subprocess_env().items() if k not in _UNSET}
    return {**env, **variables}


@pytest.fixture
def places(tmp_path) -> dict[str, Path]:
    """A file, a dangling symbolic link, a directory nobody may write in (mode 0500) and a home
    directory nobody may write in."""
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    for name in ("read_only", "home"):
        (tmp_path / name).mkdir(mode=0o500)
    (tmp_path / "cwd").mkdir()
    return {name: tmp_path / name for name in ("file", "dangling", "read_only", "home", "cwd")}


def test_an_unusable_directory_is_refused_saying_why(places):
    file, dangling, read_only, home = (str(places[k]) for k in list(places)[:4])
    unset: dict[str, str | None] = dict.fromkeys(_UNSET)
    cases = [
        {"directory": file, "environment": unset},
        {"directory": f"{file}/cache", "environment": unset},
        {"directory": dangling, "environment": unset},
        {"directory": f"{dangling}/cache", "environment": unset},
        {"directory": read_only, "environment": unset},
        {"directory": f"{read_only}/cache", "environment": unset},
        {"directory": None, "environment": {**unset, "EQX_LEAN_COMPILATION_CACHE": file}},
        # The default directory, under a read-only home; a relative XDG_CACHE_HOME is ignored,
        # as the XDG specification says.
        {"directory": None, "environment": {**unset, "HOME": home}},
        {"directory": None, "environment": {**unset, "HOME": home, "XDG_CACHE_HOME": "rel"}},
    ]
    cases_json = json.dumps(cases)
    done = _unprivileged(
        "compilation_cache_refusals.py", cases_json, env=_environment(), cwd=places["cwd"]
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    # A refused call turns nothing on.
    assert [r["configured"] for r in results] == [None] * len(cases)
    errors = [r["error"] for r in results]
    assert all(e is not None and "\n" not in e for e in errors), errors
    must = "must be a directory this process can create, list and write files in, but"
    passed = "(passed to use_compilation_cache)"
    expected = [
        f"{file} {passed} {must} {file} exists and is not a directory. Pass another directory.",
        f"{file}/cache {passed} {must} {file} exists and is not a directory.",
        f"{dangling} {passed} {must} {dangling} is a symbolic link to {places['file'].parent}"
        "/missing, which does not exist.",
        f"{dangling}/cache {passed} {must} {dangling} is a symbolic link to",
        f"{read_only} {passed} {must} {read_only}",
        f"{read_only}/cache {passed} {must} {read_only}/cache could not be created",
        f"{file} (from EQX_LEAN_COMPILATION_CACHE) {must} {file} exists and is not a directory. "
        "Set EQX_LEAN_COMPILATION_CACHE to another directory, or to off",
        f"{home}/.cache/eqx_lean/xla/cpu-",
        f"{home}/.cache/eqx_lean/xla/cpu-",
    ]
    for error, start in zip(errors, expected, strict=True):
        assert error.startswith(f"The compilation cache's directory {start}"), (error, start)
    for error in errors[4:6]:
        assert "(Permission denied)" in error, error
    assert not os.listdir(places["cwd"])
    for error in errors[7:]:
        assert f"(the default) {must} {home}/.cache could not be created" in error, error
        assert error.endswith(
            "Set EQX_LEAN_COMPILATION_CACHE to another directory, or to off "
            "to run without the cache."
        ), error


@pytest.mark.parametrize("cause", ["read-only home", "variable names a file"])
def test_the_command_line_warns_and_runs_uncached(places, cause):
    """`python -m examples.mistral7b build --preset tiny` with its default cache directory
    under a read-only `$HOME`, or `EQX_LEAN_COMPILATION_CACHE` naming a file: one line of
    warning naming the directory and why, and the whole command, run without the cache."""
    if cause == "read-only home":
        env, named = _environment(HOME=str(places["home"])), f"{places['home']}/.cache"
    else:
        env = _environment(EQX_LEAN_COMPILATION_CACHE=str(places["file"]))
        named = str(places["file"])
    done = _unprivileged("counted_cli.py", "build", "--preset", "tiny", env=env, cwd=places["cwd"])
    assert done.returncode == 0, done.stdout + done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, done.stderr
    assert warnings[0].startswith("warning: running without a compilation cache. "), warnings
    assert f"{named} exists and is not a directory" in warnings[0] or (
        f"{named} could not be created (Permission denied)" in warnings[0]
    ), warnings
    out = done.stdout.splitlines()
    assert any("greedy tokens" in line for line in out), done.stdout
    # JAX read and wrote no cache entry (it counts requests even with the cache off).
    counts = json.loads(out[-1])
    assert counts.get("cache_hits", 0) == counts.get("cache_misses", 0) == 0, counts
    assert not os.listdir(places["home"]) and not os.listdir(places["cwd"])
