"""The "cpu" plan against measured resident memory on 8 forced CPU devices.

`benchmarks/plan_vs_measured.py` holds the cases; each runs in a fresh process (the device
count is fixed when JAX starts). The slow test holds every full-size case to 10 %; the fast
one checks the planning on a small case: below about 1 GiB the runtime's fixed overhead
(30-170 MiB per compiled program measured on the small cases) outweighs XLA's figures, so a
measured peak is no test of the plan there.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
WORKER = Path(__file__).with_name("workers") / "plan_arguments.py"
sys.path.insert(0, str(BENCHMARKS))

import plan_vs_measured  # noqa: E402  # pyright: ignore[reportMissingImports]


def test_plan_arguments_are_the_shards():
    """The small forward case's plan, in a fresh process with the benchmark's 8 devices
    (`tests/workers/plan_arguments.py`)."""
    done = subprocess.run(
        [sys.executable, str(WORKER)],
        cwd=BENCHMARKS,
        env=plan_vs_measured.child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    assert plan["devices"] == plan_vs_measured.DEVICES
    # XLA's argument bytes, summed over the devices, are the bytes of the inputs' shards.
    assert plan["argument"] == plan["shard_bytes"]
    config = plan_vs_measured._config(small=True)
    batch, seq, dim = plan_vs_measured._batch_shape(small=True)
    assert plan["output"] == batch * seq * dim * 4  # the float32 activations, sharded
    assert plan["alias"] == 0
    stack = plan["shard_bytes"] - batch * seq * dim * 4
    per_device_temp = plan["temp"] // plan["devices"]
    # Each device gathers whole layers (ZeRO-3), and casts them to float32 to multiply: at least
    # one layer, but not several float32 copies of the whole stack.
    assert stack // config.num_layers <= per_device_temp < 3 * stack
    assert plan["program"] == plan["output"] - plan["alias"] + plan["temp"]


_LORA_MISSES = pytest.mark.xfail(
    reason="measured +12.9 to +14.2 % over the plan: beyond XLA's temporaries, compiling the "
    "step leaves 200 MiB resident and running it 350 MiB more; about 150 MiB of it is glibc's "
    "per-thread arenas (+9.4 % with MALLOC_ARENA_MAX=1; docs/benchmarks.md)",
    strict=True,
)
_CASES = [pytest.param(c, marks=_LORA_MISSES) if c == "lora" else c for c in plan_vs_measured.CASES]


@pytest.mark.slow
@pytest.mark.parametrize("case", _CASES)
def test_plan_within_ten_percent(case):
    row = plan_vs_measured.run_case(case)
    print(plan_vs_measured.report(row))
    assert max(row["final"], row.get("plan_argument", 0)) >= 2**30  # at least 1 GiB
    assert abs(row["error"]) <= plan_vs_measured.TOLERANCE, plan_vs_measured.report(row)
