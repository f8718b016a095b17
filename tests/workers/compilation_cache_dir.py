"""Run by `tests/test_compilation_cache.py`: calls `eqx_lean.use_compilation_cache()`, or
`use_compilation_cache(DIRECTORY)` given one argument, and prints as JSON what it returned, the
cache directory JAX was then configured with, and this machine's key:

    {"returned": "/path" or null, "configured": "/path" or null, "machine_key": "cpu-..."}

Its own process, because the compilation cache is process-wide JAX configuration that the
environment (`EQX_LEAN_COMPILATION_CACHE`, `JAX_COMPILATION_CACHE_DIR`, `XDG_CACHE_HOME`) decides
when the call is first made: each case needs a process that has not made it yet.

    python tests/workers/compilation_cache_dir.py [DIRECTORY]
"""

import json
import sys

import jax

import eqx_lean
from eqx_lean.internal import machine_key


def main(arguments: list[str]) -> None:
    path = eqx_lean.use_compilation_cache(*arguments)
    # JAX defines its configuration's attributes at run time: pyright cannot see them.
    configured = jax.config.jax_compilation_cache_dir  # pyright: ignore[reportAttributeAccessIssue]
    print(
        json.dumps(
            {
                "returned": None if path is None else str(path),
                "configured": configured,
                "machine_key": machine_key(),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
