"""How the scripts here run one measurement in a fresh process, and read its result; the token
ids their workers feed a model."""

import json
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any


def run_json(command: Sequence[str], env: Mapping[str, str] | None = None) -> Any:
    """Runs `command` and returns the JSON value on the last line of its standard output.

    Raises `RuntimeError` with the end of its standard error if it exits with an error.
    """
    done = subprocess.run(list(command), capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def tokens(vocab_size: int, seq: int) -> list[int]:
    """`seq` token ids below `vocab_size`, the same in every process (seeded): the one input the
    workers of every method (JAX or torch) run a model on."""
    import numpy as np

    return np.random.default_rng(0).integers(0, vocab_size, size=seq).tolist()
