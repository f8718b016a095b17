"""The suite compiles its XLA:CPU programs at LLVM's optimisation level 1 (`conftest.py`,
measured in `harness.OPTIMIZATION_FLAG`'s comment); users compile at XLA's default. The
library's bitwise claims are checked here again at XLA's default level, in a pytest process of
their own: `build_stacked` against `filter_vmap` and a cast, sharded builds against the
unsharded one, and `fold`'s adapter gradients against a Python loop."""

import os
import subprocess
import sys

import pytest
from harness import (
    REPO,
    TEST_OPTIMIZATION,
    at_xla_default_optimization,
    subprocess_env,
    uses_test_optimization,
)


# The cases that LLVM's level 0 broke (measured): level 1 passes them, and so must XLA's default.
AT_XLA_DEFAULT = [
    "tests/test_build.py::test_bitwise_parity_with_filter_vmap[make_block-bfloat16]",
    "tests/test_build.py::test_bitwise_parity_with_filter_vmap[make_block-float16]",
    "tests/test_policy.py::test_sharded_values_equal_the_unsharded_build[block/bfloat16/8]",
    "tests/test_lora.py::test_adapter_gradients_through_fold_equal_a_python_loop_and_are_lean",
]


def test_the_suite_compiles_at_level_1_on_the_cpu():
    if not uses_test_optimization(os.environ):
        pytest.skip("the suite runs at XLA's default level here (not on the CPU alone, or asked)")
    assert TEST_OPTIMIZATION in os.environ["XLA_FLAGS"].split()
    assert (
        TEST_OPTIMIZATION not in at_xla_default_optimization(dict(os.environ))["XLA_FLAGS"].split()
    )


def test_bitwise_claims_hold_at_xla_default_optimization():
    env = at_xla_default_optimization(subprocess_env())
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *AT_XLA_DEFAULT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]
