"""The child of `tests/test_io.py::test_save_killed_midway_leaves_previous_checkpoint_loadable`:
a save slowed down enough to be killed (SIGKILL) in the middle.

A process because the test kills it: a kill leaves what a crash leaves, which no exception in
the test's own process can. Each write of the save sleeps half a second after it lands; after
the third, the child prints `writing`, the parent's cue to kill it. Were it not killed, it
would print `finished`.

    python tests/workers/slow_save.py CHECKPOINT
"""

import sys
import time

import jax.numpy as jnp

import eqx_lean
from eqx_lean.internal import fs


# What the test saved first and the save it kills: 6 layers, 64-byte files, one layer each.
NAMES = {"w": "layers.{i}.w"}
MAX_SHARD_BYTES = 64


def main(path: str) -> None:
    writes = 0

    def slow_write(when: str, op: str, paths: tuple[str, ...]) -> None:
        nonlocal writes
        if (when, op) != ("after", "write"):
            return
        writes += 1
        if writes == 3:
            print("writing", flush=True)
        time.sleep(0.5)

    new = {"w": -jnp.ones((6, 4, 4), jnp.float32)}
    with fs.hooked(slow_write):
        eqx_lean.save_stacked(path, new, NAMES, max_shard_bytes=MAX_SHARD_BYTES)
    print("finished", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
