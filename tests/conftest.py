import os
import shutil
import tempfile


# The suite runs on CPU (its tolerances are XLA:CPU's). Set before JAX starts: JAX's CUDA plugin
# (the `plan-gpu` extra) compiles for GPUs this machine lacks only in a process started so.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A run on an accelerator (`JAX_PLATFORMS=cuda`, benchmarks/gpu_tests.sh) keeps the CPU beside
# it: the tests marked `cpu_mesh` run on its eight forced devices (harness.pinned_to_cpu).
if os.environ["JAX_PLATFORMS"] and "cpu" not in os.environ["JAX_PLATFORMS"].split(","):
    os.environ["JAX_PLATFORMS"] += ",cpu"
# libtpu (the `plan-tpu` extra) would otherwise lock out every other process that compiles for
# a TPU slice while this one lives: the test workers and subprocesses.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The commands the tests run (`python -m examples.mistral7b ...`) keep a persistent compilation
# cache in ~/.cache by default: not from the tests (tests/test_compilation_cache.py sets its own).
os.environ["EQX_LEAN_COMPILATION_CACHE"] = "off"

from harness import (  # noqa: E402
    CACHED_COMPILE_SECONDS,
    COMPILATION_CACHE_VARIABLES,
    FRESH_COMPILES,
    at_xla_default_optimization,
    compilation_cache_variables,
    on_cpu,
    pinned_to_cpu,
    platform_skip_reason,
    uses_test_optimization,
    with_test_optimization,
)


# LLVM's optimisation level 1 for the suite's XLA:CPU programs and those of the processes it
# starts (measured: harness.OPTIMIZATION_FLAG), set before JAX's backend reads `XLA_FLAGS`;
# only where the suite runs on the CPU alone (a GPU run compiles as a user's would).
if uses_test_optimization(os.environ):
    os.environ["XLA_FLAGS"] = with_test_optimization(os.environ.get("XLA_FLAGS", ""))


# One persistent compilation cache for the test session: both pytest-xdist workers and every
# process a test starts inherit it through the environment. The controller, which imports this
# file first, creates it, and removes it at the end. `EQX_LEAN_TEST_COMPILATION_CACHE=off`
# runs the session without one (to measure what it saves).
_SESSION_CACHE = "EQX_LEAN_TEST_COMPILATION_CACHE"
_OWN_CACHE = _SESSION_CACHE not in os.environ
if _OWN_CACHE:
    os.environ[_SESSION_CACHE] = tempfile.mkdtemp(prefix="eqx_lean-tests-xla-")
if os.environ[_SESSION_CACHE] != "off":
    cache = compilation_cache_variables(os.environ[_SESSION_CACHE], CACHED_COMPILE_SECONDS)
    os.environ.update(cache)

import jax  # noqa: E402
import pytest  # noqa: E402
from compile_report import (  # noqa: E402, F401  (pytest's hooks, found here by name)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_logreport as compile_report_logreport,
    pytest_runtest_makereport,
    pytest_runtest_setup,
    pytest_sessionfinish,
    pytest_terminal_summary,
)


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
# Eight CPU devices in the suite's own process, for the sharding tests: read once, when JAX's
# CPU backend starts, so it is set here, before any test runs. A config option, not
# `XLA_FLAGS`, so that the subprocesses the tests start (fresh-process memory figures, kills,
# races) keep their one device unless they ask for more.
jax.config.update("jax_num_cpu_devices", 8)
# XLA:GPU computes float32 dots in TF32 unless told otherwise (measured on the H100: float32
# logits 0.019-0.038 from transformers', docs/benchmarks.md); the suite's float32 parity checks
# against torch, loops and NumPy mean full float32, as on the CPU, where this changes nothing.
if os.environ["JAX_PLATFORMS"] != "cpu" and not on_cpu():  # (no backend started for "cpu")
    jax.config.update("jax_default_matmul_precision", "highest")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """The compile report's hook; and, with `EQX_LEAN_TEST_FAILURE_LOG` set (as
    `benchmarks/gpu_tests.sh` sets it), each failure's or error's message appended
    to that file as it happens, by the controlling process: a run cut short keeps them (xdist
    prints tracebacks only at the end)."""
    compile_report_logreport(report)
    path = os.environ.get("EQX_LEAN_TEST_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        crash = getattr(report.longrepr, "reprcrash", None)
        lines = [line for line in report.longreprtext.splitlines() if line.strip()]
        message = crash.message if crash is not None else (lines[-1] if lines else "")
        message = " ".join(message.split())
        with open(path, "a") as file:
            file.write(f"{report.nodeid} ({report.when}): {message[:400]}\n")


_PLATFORM_MARKERS = ("xla_cpu", "private_jax")


def pytest_itemcollected(item: pytest.Item) -> None:
    """The tests marked `xla_cpu` or `private_jax` are skipped, with the reason, where what
    they assert does not hold by design (`harness.platform_skip_reason`)."""
    marked = [name for name in _PLATFORM_MARKERS if item.get_closest_marker(name) is not None]
    reason = platform_skip_reason(marked) if marked else None
    if reason is not None:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """The tests marked `cpu_mesh` run (setup, call and teardown, so their module fixtures too)
    on the CPU platform's eight devices where the default backend is not the CPU."""
    if item.get_closest_marker("cpu_mesh") is None:
        return (yield)
    with pinned_to_cpu():
        return (yield)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ[_SESSION_CACHE], ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def empty_in_memory_caches():
    """Each test file starts without the programs earlier files compiled in this process (the
    session's persistent cache may still have them): its compile count, budgeted in
    `compile_budgets.json`, is then the same whichever files ran before it on its worker
    (measured: 7 % more compiles over the default tier, most of them cheap)."""
    import eqx_lean

    jax.clear_caches()
    eqx_lean.clear_caches()


@pytest.fixture(autouse=True)
def fresh_compiles_where_measured(request, monkeypatch):
    """The tests `harness.FRESH_COMPILES` names start their processes without the session's
    compilation cache and at XLA's default optimisation level: their memory figures and
    compile counts are a user's first run's."""
    if request.node.nodeid.startswith(FRESH_COMPILES):
        for name in COMPILATION_CACHE_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        default = at_xla_default_optimization(dict(os.environ))
        for name in ("XLA_FLAGS", "EQX_LEAN_TEST_XLA_DEFAULT"):
            monkeypatch.setenv(name, default[name])


@pytest.fixture
def getkey():
    """Returns a function producing fresh, distinct keys; mirrors Equinox's own fixture."""
    counter = iter(range(2**31))
    return lambda: jax.random.key(next(counter))


class CompileCounter:
    """Counts XLA backend compilations (through `jax.monitoring`)."""

    def __init__(self):
        self.count = 0

    def __call__(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


@pytest.fixture
def compiles():
    """A `CompileCounter` listening while the test runs."""
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    yield counter
    jax.monitoring.unregister_event_duration_listener(counter)


@pytest.fixture
def when_load_files_are_open(monkeypatch):
    """`install(action)`: runs `action()` once, when a load's first try has opened every file
    of the checkpoint and not yet checked that no save replaced it (where a save landing is
    the hardest to notice). Returns the list of what `action` returned, to check it ran."""
    from eqx_lean.internal import snapshot

    live = snapshot._Opener.live
    ran: list = []

    def install(action):
        def action_then_check(opener):
            if not ran:
                ran.append(action())
            return live(opener)

        monkeypatch.setattr(snapshot._Opener, "live", action_then_check)
        return ran

    return install


@pytest.fixture
def no_allocation(monkeypatch):
    """Fails the test if a load allocates a buffer (`eqx_lean._io.load._allocate`, a seam):
    for the checks that must refuse a checkpoint before any memory is spent on it."""
    from eqx_lean.internal import io_load

    def fail(*args, **kwargs):
        raise AssertionError("a buffer was allocated")

    monkeypatch.setattr(io_load, "_allocate", fail)
