"""The compile budgets of `tests/compile_report.py`: which files are judged, and when one fails."""

import json

from compile_report import BUDGETS, DEFAULT_MARKEXPR, allowed, load_budgets, over_budget


def test_a_file_may_go_ten_percent_or_five_compiles_over_its_budget():
    assert [allowed(b) for b in (0, 10, 50, 51, 200)] == [5, 15, 55, 56, 220]


def test_twenty_new_programs_in_a_file_fail_it():
    budgets = {"markexpr": DEFAULT_MARKEXPR, "files": {"tests/test_a.py": {"compiles": 100}}}
    files = {"tests/test_a.py": {"compiles": 100}, "tests/test_b.py": {"compiles": 3}}
    assert over_budget(files, {"tests/test_a.py"}, budgets) == []
    files["tests/test_a.py"]["compiles"] = 120
    (problem,) = over_budget(files, {"tests/test_a.py"}, budgets)
    assert problem == (
        "tests/test_a.py: 120 backend compiles, over its budget of 100 (at most 110 allowed)"
    )
    # A file that did not run whole is not judged; a new file without a budget is.
    assert over_budget(files, set(), budgets) == []
    (new,) = over_budget(files, {"tests/test_b.py"}, budgets)
    assert new == "tests/test_b.py: 3 backend compiles, and no budget for it"


def test_every_test_file_has_a_budget_for_the_default_tier():
    budgets = load_budgets()
    assert budgets["markexpr"] == DEFAULT_MARKEXPR
    paths = list(BUDGETS.parent.glob("test_*.py"))
    files = {p.name for p in paths}
    budgeted = {name.removeprefix("tests/") for name in budgets["files"]}
    # Files whose every test is in another tier (a module-wide docs mark) have none.
    docs_only = {p.name for p in paths if "\npytestmark = pytest.mark.docs\n" in p.read_text()}
    assert {"test_docs.py", "test_install.py", "test_docstrings.py"} <= docs_only
    assert files - docs_only == budgeted, sorted(files.symmetric_difference(budgeted))
    for entry in json.loads(BUDGETS.read_text())["files"].values():
        assert entry["compiles"] >= 0 and entry["wall_s"] >= 0


def test_the_default_tier_is_what_pyproject_selects(pytestconfig):
    """The budgets are for the tier `addopts` selects: a change to one is a change to both."""
    addopts = pytestconfig.getini("addopts")
    assert addopts[addopts.index("-m") + 1] == DEFAULT_MARKEXPR, addopts
