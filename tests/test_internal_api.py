"""Tests, benchmarks and the example reach eqx_lean's private modules only through
`eqx_lean.internal` (its `README.md` is the contract), and every name it re-exports is used.

Every `.py` file under `tests/`, `benchmarks/` and `examples/` is read with `ast`. An import, or
an attribute chain from an imported name, that reaches a module path of `eqx_lean` with a part
starting with `_` (`eqx_lean._core`, `eqx_lean.hf._model`, `from eqx_lean import _compat`,
`eqx_lean._io.load.Maps`), or a `_` name of a public module, fails the first test, which names
the file, the line and the import. `eqx_lean.internal` itself is the way in: what is reached
through it (its seam modules' patched attributes included) is not checked here.

Code inside strings is not code to `ast`: the scripts tests write out and run in a subprocess,
`textwrap.dedent` blocks and f-strings. Such a string is checked as well where it parses as
Python on its own (dedented, an f-string with each `{...}` read as `0`); one that does not, or
code built any other way at run time (`importlib.import_module`, `python -m eqx_lean.bench._worker`
on a command line), is not seen.
"""

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
INTERNAL = ROOT / "eqx_lean" / "internal" / "__init__.py"
CHECKED = ("tests", "benchmarks", "examples")

# Private paths allowed, each for a stated reason: (file, the import as `ast.unparse` gives it).
ALLOWED = {
    ("benchmarks/io_load.py", "from eqx_lean._core import chunks"): (
        "the fallback for `--code` checkouts older than `eqx_lean.internal`"
    ),
}


def _modules() -> set[str]:
    """Every module path of the package, from its files: `eqx_lean._io.load`, ..."""
    found = set()
    for file in (ROOT / "eqx_lean").rglob("*.py"):
        parts = list(file.relative_to(ROOT).with_suffix("").parts)
        found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


MODULES = _modules()


def _private(path: str) -> bool:
    return any(part.startswith("_") for part in path.split(".")[1:])


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _code_in_string(node: ast.expr) -> ast.Module | None:
    """The code in a string constant or f-string, where it parses on its own."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value
    elif isinstance(node, ast.JoinedStr):
        text = "".join(str(v.value) if isinstance(v, ast.Constant) else "0" for v in node.values)
    else:
        return None
    if "eqx_lean" not in text:
        return None
    try:
        return ast.parse(textwrap.dedent(text))
    except SyntaxError:
        return None


def _programs(tree: ast.Module, line: int = 0) -> Iterator[tuple[ast.Module, int]]:
    """The file's own code, then each string in it that parses as code (with its line)."""
    yield tree, line
    pieces = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr | ast.Constant) and id(node) not in pieces:
            code = _code_in_string(node)
            if code is not None and any(
                isinstance(n, ast.Import | ast.ImportFrom) for n in ast.walk(code)
            ):
                yield from _programs(code, line + node.lineno - 1)


def _chain(node: ast.Attribute) -> tuple[ast.expr, list[str]]:
    """`a.b.c` as `(a, ["b", "c"])`."""
    names = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        names.append(current.attr)
        current = current.value
    return current, names[::-1]


def _reached(path: str) -> str | None:
    """What a dotted path reaches that is private (`None`: nothing): a private module, or a `_`
    name of a public module."""
    parts = path.split(".")
    module = max(
        (".".join(parts[:n]) for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in MODULES),
        key=len,
        default=None,
    )
    if module is None or module == "eqx_lean.internal" or module.startswith("eqx_lean.internal."):
        return None
    if _private(module):
        return module
    rest = parts[len(module.split(".")) :]
    if rest and rest[0].startswith("_") and not _dunder(rest[0]):
        return f"{module}.{rest[0]}"
    return None


def _scan(tree: ast.Module, line: int) -> Iterator[tuple[int, str, str | None, set[str]]]:
    """`(line, the import or chain, what private it reaches or None, internal names used)`
    for every import from `eqx_lean` and every attribute chain from a name bound by one."""
    bound: dict[str, str] = {}  # local name -> the dotted path it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "eqx_lean":
                    continue
                # The first binding: an import that binds the name again is checked itself.
                bound.setdefault(
                    alias.asname or "eqx_lean", alias.name if alias.asname else "eqx_lean"
                )
                yield line + node.lineno, ast.unparse(node), _reached(alias.name), set()
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "eqx_lean":
                continue
            used = set()
            for alias in node.names:
                path = f"{node.module}.{alias.name}"
                bound.setdefault(alias.asname or alias.name, path)
                if node.module == "eqx_lean.internal":
                    used.add(alias.name)
                reached = _reached(path)
                if reached is not None:
                    yield line + node.lineno, ast.unparse(node), reached, set()
            yield line + node.lineno, ast.unparse(node), None, used
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue  # only whole chains: `a.b.c`, not its `a.b`
        root, names = _chain(node)
        if not isinstance(root, ast.Name) or root.id not in bound:
            continue
        path = ".".join([bound[root.id], *names])
        used = set()
        if path.startswith("eqx_lean.internal."):
            used.add(path.split(".")[2])
        yield line + node.lineno, ast.unparse(node), _reached(path), used


def _files() -> list[Path]:
    """Every file checked: this one's strings are the check's own examples, so not it."""
    files = (file for folder in CHECKED for file in (ROOT / folder).rglob("*.py"))
    return sorted(file for file in files if file != Path(__file__).resolve())


def _findings() -> Iterator[tuple[str, int, str, str | None, set[str]]]:
    for file in _files():
        relative = str(file.relative_to(ROOT))
        for tree, line in _programs(ast.parse(file.read_text(), relative)):
            for found in _scan(tree, line):
                yield relative, *found


def reexports() -> dict[str, int]:
    """Every name `eqx_lean/internal/__init__.py` re-exports, with its line."""
    names = {}
    for node in ast.parse(INTERNAL.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                names[alias.asname or alias.name] = node.lineno
    return names


def test_nothing_reaches_into_a_private_module_but_through_eqx_lean_internal():
    allowed_seen = set()
    offences = set()
    for file, line, text, reached, _ in _findings():
        if reached is None:
            continue
        if (file, text) in ALLOWED:
            allowed_seen.add((file, text))
            continue
        offences.add(f"{file}:{line}: `{text}` reaches `{reached}`")
    assert not offences, (
        "Private eqx_lean modules reached other than through `eqx_lean.internal` (re-export the "
        "name there, see eqx_lean/internal/README.md):\n" + "\n".join(sorted(offences))
    )
    assert allowed_seen == set(ALLOWED), f"stale exceptions: {set(ALLOWED) - allowed_seen}"


def test_every_name_eqx_lean_internal_reexports_is_used():
    used = set().union(*(names for *_, names in _findings()))
    dead = {name: line for name, line in reexports().items() if name not in used}
    assert not dead, (
        "Names `eqx_lean.internal` re-exports that no test, benchmark or example uses "
        "(remove them): "
        + ", ".join(f"{name} (eqx_lean/internal/__init__.py:{line})" for name, line in dead.items())
    )


def test_the_check_sees_each_way_of_reaching_a_private_module():
    """The scanner on code written out here: each form is caught, `eqx_lean.internal` is not."""
    code = textwrap.dedent(
        '''
        import eqx_lean
        import eqx_lean._io.load
        import eqx_lean.hf as hf
        from eqx_lean import _compat, internal
        from eqx_lean.bench import __main__ as bench
        from eqx_lean.hf._model import make_block
        from eqx_lean.internal import fs
        eqx_lean._core.plan_build
        hf._model.init
        eqx_lean.hf._hidden
        fs._renameat2
        internal.chunks.HOST_WRITES
        eqx_lean.__file__
        SCRIPT = """
            from eqx_lean._core import chunks
        """
        '''
    )
    found = {}
    for tree, line in _programs(ast.parse(code)):
        for at, text, reached, _ in _scan(tree, line):
            if reached is not None:
                found[text] = (at, reached)
    assert found == {
        "import eqx_lean._io.load": (3, "eqx_lean._io.load"),
        "from eqx_lean import _compat, internal": (5, "eqx_lean._compat"),
        "from eqx_lean.bench import __main__ as bench": (6, "eqx_lean.bench.__main__"),
        "from eqx_lean.hf._model import make_block": (7, "eqx_lean.hf._model"),
        "eqx_lean._core.plan_build": (9, "eqx_lean._core"),
        "hf._model.init": (10, "eqx_lean.hf._model"),
        "eqx_lean.hf._hidden": (11, "eqx_lean.hf._hidden"),
        "from eqx_lean._core import chunks": (16, "eqx_lean._core.chunks"),
    }
