"""The test session's persistent compilation cache (`conftest.py`) is safe to share: processes
writing one entry at once leave a whole one, and an entry cut short (a process killed while
writing it) is compiled again, with a warning, never a failure or another program's result.

JAX 0.10.2 writes an entry in place; the session uses the cache's locking mode (a size limit),
in which every read and write of an entry holds a file lock. Here every program is written (the
session writes only those that took half a second to compile: these take milliseconds).
"""

import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from harness import ProcessJob, compilation_cache_variables, print_results, subprocess_env


PROGRAMS = 6


def _expected() -> list[float]:
    """What the worker's programs compute, by NumPy in float64 (rounded like float32 below)."""
    x = np.arange(64, dtype=np.float64)
    return [float(np.sum(np.sin(x * (i + 1))) + i) for i in range(PROGRAMS)]


def _runs(cache: Path, processes: int) -> list[dict]:
    # The session's settings, every program written (these compile in milliseconds).
    env = {**subprocess_env(), **compilation_cache_variables(str(cache), min_compile_seconds=0)}
    commands = [[sys.executable, __file__]] * processes
    job = ProcessJob(commands, devices=1, timeout=120, env=env)
    return job.results()


def _assert_values(result: dict) -> None:
    np.testing.assert_allclose(result["values"], _expected(), rtol=1e-5, atol=1e-4)


def test_writers_at_once_then_a_reader_hits_every_entry(tmp_path):
    cache = tmp_path / "xla"
    writers = _runs(cache, processes=2)
    for result in writers:
        _assert_values(result)
        assert (result["compiles"], result["unreadable"]) == (PROGRAMS, 0)
    (reader,) = _runs(cache, processes=1)
    _assert_values(reader)
    assert (reader["compiles"], reader["hits"], reader["unreadable"]) == (PROGRAMS, PROGRAMS, 0)


def test_an_entry_cut_short_is_compiled_again(tmp_path):
    cache = tmp_path / "xla"
    (first,) = _runs(cache, processes=1)
    entries = sorted(p for p in cache.iterdir() if p.name.endswith("-cache"))
    assert len(entries) == PROGRAMS
    for entry in entries:
        data = entry.read_bytes()
        entry.write_bytes(data[: len(data) // 2])
    (again,) = _runs(cache, processes=1)
    _assert_values(first)
    _assert_values(again)
    assert again["hits"] == 0  # every cut entry was read, refused and compiled again
    assert again["unreadable"] == PROGRAMS and first["unreadable"] == 0


def _compile_and_run() -> None:
    """One process of the tests above (`python tests/test_session_cache.py`): compiles and runs
    `PROGRAMS` small programs with the persistent cache its environment names, and prints the
    values, the compiles and cache hits JAX reported, and the entries it could not read. In a
    process of its own: JAX opens its persistent cache once per process."""
    counts = {"compiles": 0, "hits": 0}

    def on_duration(event: str, duration_secs: float, **kwargs: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            counts["compiles"] += 1

    def on_event(event: str, **kwargs: object) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            counts["hits"] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    values = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(PROGRAMS):
            # A different constant makes a different program (and cache entry) for each `i`.
            program = jax.jit(lambda x, i=i: jnp.sum(jnp.sin(x * (i + 1))) + i)
            values.append(float(program(np.arange(64, dtype=np.float32))))
    unreadable = sum("Error reading persistent compilation cache" in str(w.message) for w in caught)
    print_results({"values": values, "unreadable": unreadable, **counts})


if __name__ == "__main__":
    _compile_and_run()
