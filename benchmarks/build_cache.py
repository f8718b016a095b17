"""What reuse by content costs and saves: tracing `make_layer` on every call, against compiling.

`build_stacked` traces `make_layer` afresh on every call (JAX's own trace cache is keyed on the
function object, which would freeze the Python state `make_layer` reads) and looks its compiled
writes up by the traced program's content. This prints, for a block of each preset:

- the time to trace one block (`eqx_lean.internal.trace_layer`), median of 20;
- the time of a first `build_stacked` (compiles its writes), and of a second one with a fresh
  `lambda` of the same content (compiles nothing), side by side in one process.

    python benchmarks/build_cache.py [--preset default|large|mistral7b] [--build]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import eqx_lean
from eqx_lean.internal import PRESETS, Block, trace_layer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--build", action="store_true", help="also time two builds (allocates)")
    args = parser.parse_args()
    config = PRESETS[args.preset]
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)

    times = []
    for _ in range(20):
        start = time.perf_counter()
        trace_layer(lambda k: Block(config, key=k), key)
        times.append(time.perf_counter() - start)
    print(f"{args.preset}: trace one block: {1e3 * statistics.median(times):.1f} ms (median of 20)")

    if args.build:
        keys = jax.block_until_ready(jax.random.split(jax.random.key(0), config.num_layers))
        for label in ("first build (compiles)", "second build, fresh lambda (cached)"):
            start = time.perf_counter()
            built = eqx_lean.build_stacked(lambda k: Block(config, key=k), keys, jnp.bfloat16)
            jax.block_until_ready(built)
            print(f"{args.preset}: {label}: {time.perf_counter() - start:.2f} s")
            del built


if __name__ == "__main__":
    main()
