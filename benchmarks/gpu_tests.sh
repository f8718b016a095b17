#!/usr/bin/env bash
# The default tier on a lent GPU machine, the GPU as JAX's default backend (issue 46).
#
#     bash benchmarks/gpu_tests.sh [pytest arguments]   # from the source tree; writes to $OUT
#
# (`GPU_TESTS_PLATFORMS=cpu WORKERS=2 bash benchmarks/gpu_tests.sh tests/test_x.py` tries the
# script itself on a CPU machine.)
#
# The suite's conftest.py sets JAX_PLATFORMS=cpu unless it is set, so a plain `pytest` on a GPU
# machine tests the CPU. Here JAX_PLATFORMS=cuda: conftest.py adds the CPU beside it (the tests
# marked `cpu_mesh` run on its eight forced devices), skips the `xla_cpu` tests and, JAX 0.11
# being outside `_compat.TESTED_JAX_SERIES`, the `private_jax` ones, each with its reason, and
# sets float32 matmuls to full precision (XLA:GPU's default is TF32). No preallocation: 14
# workers share one GPU. The compile budgets are XLA:CPU's (a GPU compiles other programs):
# their messages at the end are not failures of the code.
#
# Made for a machine lent for a few minutes (JAX 0.11.x, pytest-xdist and torch installed, no
# network, 16 cores): the tier took 166 s on the H200 when it ran on the CPU; the whole
# script stops itself at TIER_TIMEOUT seconds (default 270), keeping the log it has.
set -u
OUT="${OUT:-gpu-tests}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
export JAX_PLATFORMS="${GPU_TESTS_PLATFORMS:-cuda}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Each failure's last traceback line, written as it happens (tests/conftest.py).
export EQX_LEAN_TEST_FAILURE_LOG="$PWD/$OUT/failure-messages.txt"
case "$OUT" in /*) EQX_LEAN_TEST_FAILURE_LOG="$OUT/failure-messages.txt" ;; esac
{
    date -u
    git rev-parse HEAD 2>/dev/null || true
    "$PYTHON" -c "import jax, equinox; print('jax', jax.__version__, 'equinox', equinox.__version__, jax.devices())"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

start=$(date +%s)
timeout -k 10 "${TIER_TIMEOUT:-270}" "$PYTHON" -m pytest -n "${WORKERS:-14}" --dist loadfile -p no:cacheprovider \
    -v -rfEs --tb=short "$@" >"$OUT/tier.log" 2>&1
status=$?
echo "pytest exit status $status after $(($(date +%s) - start)) s" | tee -a "$OUT/tier.log"
# What came back, short: the summary line, and each failure and error with its first message.
grep -E "^(FAILED|ERROR) " "$OUT/tier.log" | cut -c1-300 >"$OUT/failures.txt"
touch "$OUT/failure-messages.txt"
grep -E "^SKIPPED " "$OUT/tier.log" | cut -c1-300 >"$OUT/skips.txt"
grep -E "^=+ .* in [0-9.]+s" "$OUT/tier.log" | tail -n 1
echo "failures and errors: $(wc -l <"$OUT/failures.txt"), skip lines: $(wc -l <"$OUT/skips.txt")"
cat "$OUT/failures.txt"
echo "messages, as they happened (failure-messages.txt): $(wc -l <"$OUT/failure-messages.txt")"
exit 0
