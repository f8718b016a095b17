"""Run by `tests/test_plan_cpu.py` with `benchmarks/plan_vs_measured.py`'s environment (8
forced CPU devices): prints as one JSON line `plan_vs_measured.plan_arguments(small=True)`, the
small forward case's "cpu" plan beside the bytes of its inputs' shards.

Its own process, because the device count is fixed when JAX starts: the benchmark's cases run
with theirs (`plan_vs_measured.child_env()`), whatever the suite's process has.

    python tests/workers/plan_arguments.py  # in plan_vs_measured.child_env()
"""

import json
import sys
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import plan_vs_measured  # pyright: ignore[reportMissingImports]

    print(json.dumps(plan_vs_measured.plan_arguments(small=True)))


if __name__ == "__main__":
    main()
