"""No import cycle inside `eqx_lean`: its modules' import graph, read from the source with
`ast`, is acyclic.

An edge `a -> b` is an import of `b` by `a` at module level: at the top, or under a module-level
`if` (`if TYPE_CHECKING:` included), `try` or `with`, not inside a function or class. `from p
import n` is an edge to the module `p.n` where that is a module, else to `p`. Imports of the
package a module lives in are edges too, so a submodule importing names its package's
`__init__` re-exports counts.
"""

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest


pytestmark = pytest.mark.quick


PACKAGE = Path(__file__).resolve().parents[1] / "eqx_lean"


def modules(package: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Every module's dotted name: its file, and whether it is a package's `__init__`."""
    found = {}
    for file in sorted(package.rglob("*.py")):
        parts = list(file.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (file, is_package)
    return found


def module_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    def walk(statements: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
        for statement in statements:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                yield statement
            elif isinstance(statement, (ast.If, ast.With)):
                yield from walk(statement.body)
                yield from walk(getattr(statement, "orelse", []))
            elif isinstance(statement, ast.Try):
                yield from walk(statement.body)
                yield from walk(statement.orelse)
                yield from walk(statement.finalbody)
                for handler in statement.handlers:
                    yield from walk(handler.body)

    yield from walk(tree.body)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """`module -> the modules of the package it imports at module level`."""
    known = modules(package)
    graph = {}
    for name, (file, is_package) in known.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        edges = set()
        for node in module_level_imports(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names if alias.name in known}
                continue
            if node.level:
                base = here[: len(here) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in known:
                    edges.add(submodule)
                elif source in known:
                    edges.add(source)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path `[a, b, ..., a]`, or `None`."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == "open":
                return path[path.index(successor) :] + [successor]
            if successor not in state:
                cycle = visit(successor)
                if cycle:
                    return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_eqx_lean_has_no_import_cycle():
    graph = import_graph()
    assert "eqx_lean._core.chunks" in graph and "eqx_lean._platform" in graph
    assert "eqx_lean._core.chunk_plan" in graph["eqx_lean._core.chunks"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(
    "second",
    [
        "from .a import x\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
        "try:\n    import pkg.a\nexcept ImportError:\n    pass\n",
    ],
    ids=["from-import", "type-checking", "try"],
)
def test_a_cycle_is_found_through_each_form_of_import(tmp_path, second):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import y\nx = 1\n")
    (package / "b.py").write_text(second + "y = 2\n")
    (package / "c.py").write_text("def f():\n    from . import a  # inside a function: no edge\n")
    graph = import_graph(package)
    assert graph["pkg.c"] == set()
    assert find_cycle(graph) in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])


def test_an_acyclic_package_has_no_cycle(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .sub import leaf\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "leaf.py").write_text("from .. import other\n")
    (package / "other.py").write_text("import json\n")
    graph = import_graph(package)
    assert graph["pkg"] == {"pkg.sub.leaf"}
    assert graph["pkg.sub.leaf"] == {"pkg.other"}
    assert find_cycle(graph) is None
