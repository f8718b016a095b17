"""Loads racing saves in another process return one whole checkpoint, never a mix of two."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import subprocess_env


WORKER = Path(__file__).with_name("io_race.py")


def _race(tmp_path: Path, files: str, seconds: float) -> dict:
    path = str(tmp_path / "checkpoint")
    env = subprocess_env()
    saver = subprocess.Popen(
        [sys.executable, str(WORKER), "save", path, files, str(seconds + 30)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert saver.stdout is not None
        first = saver.stdout.readline()  # the loader starts once a checkpoint exists
        assert first.startswith("first save done"), saver.stderr.read() if saver.stderr else ""
        loader = subprocess.run(
            [sys.executable, str(WORKER), "load", path, str(seconds)],
            capture_output=True,
            text=True,
            env=env,
            timeout=seconds + 120,
        )
    finally:
        saver.kill()
        saver.wait()
    assert loader.returncode == 0, loader.stderr[-3000:]
    return json.loads(loader.stdout.strip().splitlines()[-1])


def _check(counts: dict) -> None:
    assert counts["mixed"] == 0, counts
    assert counts["other"] == 0, counts
    assert counts["whole"] >= 20, counts
    assert counts["whole"] >= counts["replaced"], counts


@pytest.mark.parametrize("files", ["single", "sharded"])
def test_loads_racing_saves_are_whole(tmp_path, files):
    _check(_race(tmp_path, files, seconds=5))


@pytest.mark.slow
@pytest.mark.parametrize("files", ["single", "sharded"])
def test_loads_racing_saves_are_whole_for_a_minute(tmp_path, files):
    _check(_race(tmp_path, files, seconds=60))
