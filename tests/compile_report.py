"""Where the suite's time goes: each test's XLA backend compiles, their seconds and its wall time,
written as a report a developer can sort, and a budget of backend compiles per test file that
fails the run when a file goes over it.

XLA's backend compilation is most of the suite's in-process time, and the number of programs a
file compiles is deterministic where its seconds are not (they moved 2.7x with the machine's
load on one day): so the budget is in compiles, and seconds are reported, never asserted. A hit
of the persistent compilation cache still counts (JAX emits the compile event around the cache
lookup), and every test file starts with JAX's and eqx_lean's in-memory caches empty
(`conftest.py`), so a file's count does not depend on which files ran before it on its worker.
Programs compiled by the processes a test starts are not counted (their time is in the test's
wall seconds).

`conftest.py` imports the hooks below by name. Under pytest-xdist each worker counts its own
tests' compiles and sends them with the test reports (`user_properties`); the controller adds
them up, writes the report and checks the budgets.

- The report: `test-reports/compiles.json` (every test and every file: compiles, compile
    seconds, wall seconds; and every compiled program's name, with its compiles and seconds
    over the run) and `test-reports/compiles.txt` (the tests, by wall time); the terminal
    summary names the 20 most expensive tests and every file over its budget.
- The budgets: `tests/compile_budgets.json`, each test file's backend compiles in the default
    tier. A file that ran whole (the default tier's markers, no `-k`, no node ids, no
    `--deselect`, no `--lf`) fails the run when it compiles more than
    `max(1.1 x budget, budget + 5)`. A change that adds tests raises its files' budgets in the
    same commit: `python -m pytest -n 2 --update-compile-budgets` rewrites them from the run.
- Distribution: `--dist loadfile` (in `addopts`), each file whole on one worker; a run spread
    otherwise (`--dist load`) is reported but not judged against the budgets.
- Collection order: files run heaviest first (by the wall seconds the budget file records), so
    that under `--dist loadfile` no long file starts last on a worker.
"""

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, cast

import jax
import pytest


ROOT = Path(__file__).resolve().parents[1]
BUDGETS = Path(__file__).with_name("compile_budgets.json")
REPORT_DIR = ROOT / "test-reports"
# The markers of the tier the budgets are for: the default tier (`addopts` in pyproject.toml).
DEFAULT_MARKEXPR = "not slow and not docs"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_PROPERTY = "compile_report"


class _Compiles:
    """XLA backend compiles of this process and their seconds, since it started, in all and
    by the compiled function's name (`jit(write_layers)`, `jit(convert_element_type)`: an
    eager operation is a program of its own)."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.programs: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])

    def __call__(self, event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == _COMPILE_EVENT:
            self.count += 1
            self.seconds += duration_secs
            program = self.programs[str(kwargs.get("fun_name", "?"))]
            program[0] += 1
            program[1] += duration_secs


_COUNTER = _Compiles()
# This process's state: where the counter stood when each test's current phase began, and (in
# the controller) every test's totals.
_PHASE_START: dict[str, tuple[int, float]] = {}
_TESTS: dict[str, dict[str, Any]] = defaultdict(
    lambda: {"compiles": 0, "compile_s": 0.0, "wall_s": 0.0, "failed": False}
)
_PROBLEMS: list[str] = []


def allowed(budget: int) -> int:
    """The most compiles a file whose budget is `budget` may make before the run fails."""
    return max(int(budget * 1.1), budget + 5)


def load_budgets() -> dict[str, Any]:
    """`{"markexpr": ..., "files": {file: {"compiles": n, "wall_s": s}}}`."""
    if not BUDGETS.exists():
        return {"markexpr": DEFAULT_MARKEXPR, "files": {}}
    return json.loads(BUDGETS.read_text())


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _is_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


# --- the hooks (imported by conftest.py) ------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-compile-budgets",
        action="store_true",
        help="rewrite tests/compile_budgets.json from this run's files that ran whole",
    )


def pytest_configure(config: pytest.Config) -> None:
    jax.monitoring.register_event_duration_secs_listener(_COUNTER)
    if _is_controller(config):  # before the workers start: no part of an earlier run is merged
        for stale in REPORT_DIR.glob("programs-*.json"):
            stale.unlink()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Heaviest files first (their recorded wall seconds; unrecorded files after, in their
    order), each file's tests in their own order: every worker collects the same order."""
    weights = {name: entry["wall_s"] for name, entry in load_budgets()["files"].items()}
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(_file_of(item.nodeid), len(first_seen))

    def cost(item: pytest.Item) -> tuple[float, int]:
        name = _file_of(item.nodeid)
        return -weights.get(name, 0.0), first_seen[name]

    items.sort(key=cost)  # stable: a file's tests keep their order


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _PHASE_START[item.nodeid] = (_COUNTER.count, _COUNTER.seconds)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """Each phase's report (setup, call, teardown) carries the compiles made during it: a
    module fixture's compiles go to the test that first asked for it."""
    outcome = yield
    report = outcome.get_result()
    count, seconds = _PHASE_START.get(item.nodeid, (_COUNTER.count, _COUNTER.seconds))
    compiled = {"compiles": _COUNTER.count - count, "compile_s": _COUNTER.seconds - seconds}
    report.user_properties.append((_PROPERTY, compiled))
    _PHASE_START[item.nodeid] = (_COUNTER.count, _COUNTER.seconds)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _TESTS[report.nodeid]
    entry["wall_s"] += report.duration
    entry["failed"] = entry["failed"] or report.failed
    for name, value in report.user_properties:
        if name == _PROPERTY:
            compiled = cast(dict[str, Any], value)
            entry["compiles"] += compiled["compiles"]
            entry["compile_s"] += compiled["compile_s"]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    REPORT_DIR.mkdir(exist_ok=True)
    worker = getattr(config, "workerinput", {}).get("workerid", "controller")
    # Each process's programs, merged by the controller (its workers end first).
    programs = json.dumps(dict(_COUNTER.programs))
    (REPORT_DIR / f"programs-{worker}.json").write_text(programs + "\n")
    if not _is_controller(config) or not _TESTS:
        return
    files = _per_file()
    _write_report(files)
    budgets = load_budgets()
    whole = _whole_files(config, set(files), budgets)
    _PROBLEMS[:] = over_budget(files, whole, budgets)
    if config.getoption("update_compile_budgets"):
        _write_budgets(budgets, files, whole)
    elif _PROBLEMS and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not _is_controller(config) or not _TESTS:
        return
    write = terminalreporter.write_line
    terminalreporter.section("the 20 most expensive tests (all: test-reports/compiles.txt)")
    for line in _table(20):
        write(line)
    if _PROBLEMS:
        terminalreporter.section("compile budgets exceeded (tests/compile_budgets.json)")
        for line in _PROBLEMS:
            write(line)
        write(
            "Let the tests share their programs, or raise the file's budget in the same commit "
            "(`--update-compile-budgets`) and say by how much in the issue's note."
        )


# --- the report and the budgets ---------------------------------------------------------------


def _per_file() -> dict[str, dict[str, Any]]:
    files: dict[str, dict[str, Any]] = {}
    for nodeid, entry in _TESTS.items():
        f = files.setdefault(
            _file_of(nodeid),
            {"tests": 0, "compiles": 0, "compile_s": 0.0, "wall_s": 0.0, "failed": False},
        )
        f["tests"] += 1
        f["compiles"] += entry["compiles"]
        f["compile_s"] += entry["compile_s"]
        f["wall_s"] += entry["wall_s"]
        f["failed"] = f["failed"] or entry["failed"]
    return files


def _table(limit: int | None = None) -> list[str]:
    rows = sorted(_TESTS.items(), key=lambda kv: -kv[1]["wall_s"])[:limit]
    lines = [f"{'wall s':>8} {'compile s':>9} {'compiles':>8}  test"]
    for nodeid, e in rows:
        lines.append(f"{e['wall_s']:8.1f} {e['compile_s']:9.1f} {e['compiles']:8d}  {nodeid}")
    return lines


def _programs() -> dict[str, list[float]]:
    """Compiles and seconds by program name, over this run's processes."""
    merged: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for part in REPORT_DIR.glob("programs-*.json"):
        for name, (count, seconds) in json.loads(part.read_text()).items():
            merged[name][0] += count
            merged[name][1] += seconds
        part.unlink()
    return dict(sorted(merged.items(), key=lambda kv: -kv[1][1]))


def _write_report(files: dict[str, dict[str, Any]]) -> None:
    programs = _programs()
    report = {"tests": dict(_TESTS), "files": files, "programs": programs}
    (REPORT_DIR / "compiles.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [*_table(), "", f"{'compile s':>9} {'compiles':>8}  program (all files)"]
    lines += [f"{seconds:9.1f} {count:8d}  {name}" for name, (count, seconds) in programs.items()]
    (REPORT_DIR / "compiles.txt").write_text("\n".join(lines) + "\n")


def _whole_files(config: pytest.Config, files: set[str], budgets: dict[str, Any]) -> set[str]:
    """The files of which this run selected every default-tier test (none when the run's
    selection is not the default tier's, or is narrowed by keyword, last failures or
    deselection)."""
    option = config.option
    if (option.markexpr or "").strip() != budgets["markexpr"] or option.keyword:
        return set()
    # Under pytest-xdist's other modes a file's tests are spread over the workers, each of which
    # compiles the programs they share: the count is then the schedule's, not the file's
    # (measured: tests/test_hf_families.py 152 under `--dist load`, 120-124 whole on a worker).
    if getattr(option, "dist", "no") not in ("no", "loadfile"):
        return set()
    if getattr(option, "lf", False) or getattr(option, "deselect", None):
        return set()
    here = config.invocation_params.dir
    partial = set()
    for arg in config.args:
        if "::" in arg:
            path = (here / arg.split("::", 1)[0]).resolve()
            partial.add(path.relative_to(config.rootpath).as_posix())
    return files - partial


def over_budget(
    files: dict[str, dict[str, Any]], whole: set[str], budgets: dict[str, Any]
) -> list[str]:
    """A sentence for each file that ran whole and compiled more than its budget allows."""
    problems = []
    for name in sorted(whole):
        found = files[name]["compiles"]
        budget = budgets["files"].get(name, {}).get("compiles")
        if budget is None:
            problems.append(f"{name}: {found} backend compiles, and no budget for it")
        elif found > allowed(budget):
            problems.append(
                f"{name}: {found} backend compiles, over its budget of {budget} "
                f"(at most {allowed(budget)} allowed)"
            )
    return problems


def _write_budgets(
    budgets: dict[str, Any], files: dict[str, dict[str, Any]], whole: set[str]
) -> None:
    updated = dict(budgets["files"])
    for name in whole:
        if not files[name]["failed"]:
            updated[name] = {
                "compiles": files[name]["compiles"],
                "wall_s": round(files[name]["wall_s"], 1),
            }
    content = {"markexpr": budgets["markexpr"], "files": dict(sorted(updated.items()))}
    BUDGETS.write_text(json.dumps(content, indent=1) + "\n")
