"""What every user rule of eqx_lean shares: the path convention, the error a failing rule is
re-raised as, and the base of dtype rules that need the whole tree."""

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax


KeyPath: TypeAlias = tuple[Any, ...]
DtypeRule: TypeAlias = Callable[[KeyPath, jax.ShapeDtypeStruct], Any]


class TreeDtypeRule:
    """A dtype rule that needs the whole tree, not one leaf, to choose (such as "the leaves of
    every LayerNorm"): `bind` resolves it against the tree a function was given, returning a
    plain rule `(path, leaf) -> dtype | None`. The ready-made rules of `eqx_lean.dtypes`."""

    def bind(
        self, tree: Any, paths: Sequence[KeyPath], structs: Sequence[jax.ShapeDtypeStruct]
    ) -> DtypeRule:
        """The plain rule for the array leaves `paths` of `tree`; `structs` are the leaves as
        rules see them (one layer's shape for a stacked leaf)."""
        raise NotImplementedError


PATHS_DOC = "'Paths in rules and name functions' in docs/getting-started.md"
PATH_CONVENTION = (
    "Rules and name functions get each leaf's key path relative to the tree they are given: "
    "one layer in build_stacked, allocate_stacked, stack, memory.estimate and memory.describe "
    "(what `make_layer` returns), the stacked module in load_stacked, save_stacked, fold and "
    "scan (the same paths as one layer's), the whole model `like` or `tree` in load_tensors and "
    f"save_tensors; see {PATHS_DOC}."
)


class _RuleKeyError(KeyError):
    # A KeyError prints its argument's repr; this one prints the sentence as it is.
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def rule_error(error: BaseException, message: str) -> Exception:
    """An exception of `error`'s kind carrying `message`, to raise `from error`.

    A user's rule raising a `KeyError` (a name map without the path it was given) says nothing
    about which leaf, argument or path convention was involved; `message` does. Builtin
    exception types are kept, so that callers catching them still do; others become a
    `ValueError`.
    """
    if isinstance(error, KeyError):
        return _RuleKeyError(message)
    kind = type(error)
    if kind.__module__ == "builtins":
        try:
            same_kind = kind(message)
        except Exception:
            same_kind = None
        if isinstance(same_kind, Exception):
            return same_kind
    return ValueError(message)


def describe_raised(error: BaseException) -> str:
    """`KeyError: '.ln_1.weight'`: what a user's rule raised, as Python prints it."""
    text = str(error)
    if isinstance(error, KeyError) and not isinstance(error, _RuleKeyError) and error.args:
        text = repr(error.args[0])
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
