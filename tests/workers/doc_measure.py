"""Run by `tests/test_docs.py`: runs getting started's code, read from stdin (its measure block,
alone or after its estimate block), as `__main__`, then prints what the measure block measured
and the bytes of the stack it built, as one line after the blocks' own output:

    EQX_LEAN_RESULTS:{"peak": <m.peak_bytes>, "stack": <bytes of mlps' arrays>}

The first argument names the code in tracebacks (the blocks' page and lines).

Its own process, because the figures are a process's memory: the page's claim is about what an
estimate earlier in the same process leaves resident, against a process that has done nothing
before the build.

    python tests/workers/doc_measure.py WHERE < CODE.py
"""

import json
import sys
from typing import Any


def main(where: str) -> None:
    # `python -c` puts the working directory first on `sys.path`; for this file it put this
    # folder there instead.
    sys.path[0] = ""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(sys.stdin.read(), where, "exec"), namespace)
    # Imported only now, after the blocks, which import them themselves: nothing of this file
    # runs before the blocks but the two imports of the standard library above.
    import equinox as eqx
    import jax

    measured, built = namespace["m"], namespace["mlps"]
    stack = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(built, eqx.is_array)))
    print("EQX_LEAN_RESULTS:" + json.dumps({"peak": measured.peak_bytes, "stack": stack}))


if __name__ == "__main__":
    main(sys.argv[1])
