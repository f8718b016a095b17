"""The child of `tests/test_io_load.py::test_load_overhead_is_independent_of_the_largest_tensor`:
one load in a fresh process, whose anonymous memory the parent samples from outside.

A fresh process because the figure is the process's own: its peak `RssAnon` while it loads,
over what it held idle, with nothing else having run in it first. It talks to the parent over
its pipes: it prints `idle` once JAX has started and waits for a line on stdin, loads, prints
`done <loaded bytes>` and waits for another line, so that the parent samples around the load
alone and reads the figure before the process exits.

    python tests/workers/load_memory.py CHECKPOINT host|compiled LAYERS ROWS COLUMNS VOCABULARY
"""

import json
import sys

import jax
import jax.numpy as jnp

import eqx_lean
from eqx_lean.internal import chunks


def main(path: str, mode: str, num_layers: int, rows: int, cols: int, vocab: int) -> None:
    chunks.HOST_WRITES = mode == "host"
    like = {
        "w": jax.ShapeDtypeStruct((num_layers, rows, cols), jnp.bfloat16),
        "embed": jax.ShapeDtypeStruct((vocab, cols), jnp.bfloat16),
    }
    names = {"w": "layers.{i}.w", "embed": "embed"}
    jax.devices()  # the backend started before the idle figure, not during the load
    print("idle", flush=True)
    sys.stdin.readline()
    loaded: dict[str, jax.Array] = eqx_lean.load_tensors(path, like, names)  # pyright: ignore[reportAssignmentType]
    jax.block_until_ready(loaded)
    print("done", json.dumps(sum(x.nbytes for x in loaded.values())), flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    path, mode, *shape = sys.argv[1:]
    if mode not in ("host", "compiled") or len(shape) != 4:
        sys.exit(__doc__)
    main(path, mode, *map(int, shape))
