"""The documentation: the site builds with `mkdocs build --strict`, every public name has an API
entry, and every notebook in `docs/notebooks/` runs top to bottom."""

import ast
import os
import pathlib
import subprocess
import sys

import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 240


def _exports(module_file: pathlib.Path, qualname: str) -> list[str]:
    """Public names of a module, by the project's convention: `from ._x import name as name`
    re-exports, public submodules re-exported the same way (expanded), and, in a public module
    file, its own top-level public functions and classes."""
    tree = ast.parse(module_file.read_text())
    names = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                if alias.asname != alias.name or alias.name.startswith("_"):
                    continue
                if node.module is None:  # `from . import init as init`: a public submodule
                    package = module_file.parent
                    submodule = package / f"{alias.name}.py"
                    if not submodule.exists():
                        submodule = package / alias.name / "__init__.py"
                    names += _exports(submodule, f"{qualname}.{alias.name}")
                else:
                    names.append(f"{qualname}.{alias.name}")
        elif isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
            if not module_file.name.startswith("_") or module_file.name == "__init__.py":
                names.append(f"{qualname}.{node.name}")
    return names


def _public_names() -> list[str]:
    names = _exports(ROOT / "eqx_lean" / "__init__.py", "eqx_lean")
    memory = ROOT / "eqx_lean" / "memory.py"
    if memory.exists() and "eqx_lean.memory" not in {n.rsplit(".", 1)[0] for n in names}:
        names += _exports(memory, "eqx_lean.memory")
    return sorted(set(names))


def _mkdocs_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["NO_MKDOCS_2_WARNING"] = "1"  # Material's banner, printed on every build
    return env


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    pytest.importorskip("mkdocs", reason="the docs extra is needed: pip install '.[test]'")
    pytest.importorskip("mkdocstrings_handlers.python")
    site_dir = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        env=_mkdocs_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return site_dir


def test_site_builds_strict(site: pathlib.Path):
    for page in ["index.html", "faq/index.html", "how-it-works/index.html", "api/build/index.html"]:
        assert (site / page).is_file(), page


def test_public_names_include_the_known_core():
    names = _public_names()
    for expected in ["eqx_lean.build_stacked", "eqx_lean.fold", "eqx_lean.init.chunked"]:
        assert expected in names


def test_every_public_name_has_an_api_entry(site: pathlib.Path):
    api_html = "".join(p.read_text() for p in (site / "api").rglob("index.html"))
    missing = [name for name in _public_names() if f'id="{name}"' not in api_html]
    assert not missing, f"public names without an entry in docs/api/: {missing}"


def test_notebooks_are_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    assert NOTEBOOKS, "docs/notebooks/ holds no notebooks"
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type == "code":
                assert not cell.outputs, f"{path.name}: cell {index} has outputs; clear them"
                assert cell.execution_count is None, f"{path.name}: cell {index} was executed"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    # The kernel (and any process a notebook starts) imports this checkout's `eqx_lean` and
    # `examples`, whatever is installed.
    monkeypatch.setenv("PYTHONPATH", _mkdocs_env()["PYTHONPATH"])
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}},
    )
    client.execute()
