"""Run by `tests/test_compilation_cache_directory.py`: calls `eqx_lean.use_compilation_cache`
once per case, each with its own directory argument and environment, and prints as JSON, per
case, the message of the `OSError` it raised (or `null`) and the cache directory JAX was
configured with afterwards:

    [{"error": "The compilation cache's directory ...", "configured": null}, ...]

Its own process, because the compilation cache is process-wide JAX configuration: a case that
wrongly turned the cache on would turn it on for the test's whole process. One process serves
every case, since a refused call changes nothing (which `configured` checks). The environment
variables are read when the call is made, so each case sets its own.

    python tests/workers/compilation_cache_refusals.py CASES_JSON

`CASES_JSON`: a list of `{"directory": "/path" or null, "environment": {"NAME": "value" or
null (unset)}}`.
"""

import json
import os
import sys

import jax

import eqx_lean


def main(cases: list[dict]) -> None:
    results = []
    for case in cases:
        for name, value in case["environment"].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        arguments = [] if case["directory"] is None else [case["directory"]]
        try:
            eqx_lean.use_compilation_cache(*arguments)
            error = None
        except OSError as e:
            error = str(e)
        # JAX defines its configuration's attributes at run time: pyright cannot see them.
        configured = jax.config.jax_compilation_cache_dir  # pyright: ignore[reportAttributeAccessIssue]
        results.append({"error": error, "configured": configured})
    print(json.dumps(results))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
