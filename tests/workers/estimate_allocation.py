"""Run by `tests/test_memory.py`: estimates building a stack of 64 `Linear(4096, 4096)` layers
in bfloat16 (4 GiB at float32 construction precision) and prints, as one JSON line, the
resident memory the estimate added over idle, its figures, and the arrays it left alive:

    {"peak": ..., "construction": ..., "final": ..., "predicted": ...,
     "new_arrays": ..., "new_bytes": ...}

Its own process, because the claim is about a process's resident memory (its high-water mark):
only a fresh process's peak is the estimate's alone.

    python tests/workers/estimate_allocation.py
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_lean
from eqx_lean.internal import peak_rss_bytes, rss_bytes


def make(key):
    return eqx.nn.Linear(4096, 4096, key=key)


def main() -> None:
    keys = jax.random.split(jax.random.key(0), 64)
    jax.block_until_ready(keys)
    idle = rss_bytes()
    before = {id(x) for x in jax.live_arrays()}
    e = eqx_lean.memory.estimate(make, keys, jnp.bfloat16)
    new = [x.nbytes for x in jax.live_arrays() if id(x) not in before]
    report = {
        "peak": peak_rss_bytes() - idle,
        "construction": e.construction_bytes,
        "final": e.final_bytes,
        "predicted": e.filter_jit_vmap_peak,
        "new_arrays": len(new),
        "new_bytes": sum(new),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
