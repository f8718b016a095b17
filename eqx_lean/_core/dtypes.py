"""The dtype policy: the dtype each array leaf of a layer is stored with (`leaf_dtype`, the
checks of `dtype=`), the ready-made rules of `eqx_lean.dtypes`, and the one dtype resolver of
the package.

A plain rule `(path, leaf) -> dtype | None` sees one leaf, so it can only match names: a rule
looking for `"norm"` in the path misses GPT-2's `ln_1`, silently. The rules here are resolved
against the whole tree a function was given (`resolve_dtypes`), so they can match by module
type, and a rule that matches nothing in that tree is an error instead of a no-op.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeAlias, TypeGuard, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .rules import (
    PATH_CONVENTION,
    DtypeRule,
    KeyPath,
    TreeDtypeRule,
    describe_raised,
    rule_error,
)


# --- the dtype of one leaf -----------------------------------------------------------------------

DtypeLike: TypeAlias = Any
DtypePolicy: TypeAlias = DtypeLike | DtypeRule | TreeDtypeRule | None


def is_floating(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _as_floating_dtype(value: Any, what: str) -> np.dtype:
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(
            f"{what} must be a floating dtype such as jnp.bfloat16; got {value!r}."
        ) from e
    if not is_floating(dtype):
        raise ValueError(
            f"{what} must be a floating dtype such as jnp.bfloat16 (integer, boolean, complex and "
            f"key-typed leaves are never cast); got {dtype}."
        )
    return dtype


def check_dtype_policy(dtype: DtypePolicy, argument: str = "`dtype`") -> DtypePolicy:
    """Validates a `dtype` argument (or another `argument` that takes the same forms) eagerly,
    so a bad one fails before anything is built."""
    if dtype is None or isinstance(dtype, TreeDtypeRule) or _is_rule(dtype):
        return dtype
    return _as_floating_dtype(dtype, argument)


def _is_rule(dtype: DtypePolicy) -> TypeGuard[DtypeRule]:
    # Dtype-likes such as `jnp.bfloat16` are callable too, so "callable" alone is not the test.
    if not callable(dtype):
        return False
    try:
        jnp.dtype(cast(Any, dtype))
    except TypeError:
        return True
    return False


def leaf_dtype(dtype: DtypePolicy, path: KeyPath, leaf: jax.ShapeDtypeStruct) -> tuple[Any, bool]:
    """The dtype and weak type that `leaf` is stored with under the policy `dtype`.

    Only floating leaves are ever cast; a cast drops the weak type, exactly as `x.astype(dtype)`.
    """
    weak = bool(getattr(leaf, "weak_type", False))
    if dtype is None or not is_floating(leaf.dtype):
        return jnp.dtype(leaf.dtype), weak
    if isinstance(dtype, TreeDtypeRule):
        raise TypeError(
            f"{type(dtype).__name__} must be bound to its tree first (`resolve_dtypes`)."
        )
    if _is_rule(dtype):
        try:
            chosen = dtype(path, leaf)
        except Exception as e:
            raise rule_error(
                e,
                f"The `dtype` rule raised {describe_raised(e)} for leaf "
                f"{jax.tree_util.keystr(path)} ({leaf.dtype}{list(leaf.shape)}). "
                f"{PATH_CONVENTION} A dtype rule sees one layer's ShapeDtypeStruct for a "
                "stacked leaf.",
            ) from e
        if chosen is None:
            return leaf.dtype, weak
        where = f"the `dtype` rule's result for leaf {jax.tree_util.keystr(path)}"
        return _as_floating_dtype(chosen, where), False
    return jnp.dtype(cast(Any, dtype)), False


# --- rules resolved against the whole tree ---------------------------------------------------


def _is_array_like(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _bind_otherwise(
    otherwise: DtypePolicy,
    tree: Any,
    paths: Sequence[KeyPath],
    structs: Sequence[jax.ShapeDtypeStruct],
) -> Any:
    if isinstance(otherwise, TreeDtypeRule):
        return otherwise.bind(tree, paths, structs)
    return otherwise


def _apply(otherwise: Any, path: KeyPath, leaf: jax.ShapeDtypeStruct) -> DtypeLike | None:
    """What a bound `otherwise` chooses for one leaf: `None` keeps its dtype."""
    if otherwise is None or not _is_rule(otherwise):
        return otherwise
    return otherwise(path, leaf)


def _children(node: Any) -> list[Any]:
    """The direct children of a pytree node (none for a leaf)."""
    children = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0]
    return [] if children == [node] else children


def _module_types(tree: Any) -> list[type]:
    """Every module class in `tree`, in the order first met."""
    found: list[type] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, eqx.Module) and type(node) not in found:
            found.append(type(node))
        if not _is_array_like(node):
            stack.extend(reversed(_children(node)))
    return found


def _type_names(types: Sequence[type]) -> str:
    return ", ".join(t.__qualname__ for t in types)


@dataclasses.dataclass(frozen=True)
class ForModules(TreeDtypeRule):
    """The rule `eqx_lean.dtypes.for_modules` returns."""

    types: tuple[type, ...]
    dtype: Any
    otherwise: Any = None

    def bind(
        self, tree: Any, paths: Sequence[KeyPath], structs: Sequence[jax.ShapeDtypeStruct]
    ) -> DtypeRule:
        types = self.types
        inside: set[KeyPath] = set()
        matched = 0
        is_match = lambda x: isinstance(x, types)  # noqa: E731
        for prefix, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_match)[0]:
            if isinstance(node, types):
                matched += 1
                for sub, leaf in jax.tree_util.tree_flatten_with_path(node)[0]:
                    if _is_array_like(leaf):
                        inside.add((*prefix, *sub))
        if not matched:
            raise ValueError(self._no_match(tree))
        otherwise = _bind_otherwise(self.otherwise, tree, paths, structs)
        dtype = self.dtype

        def rule(path: KeyPath, leaf: jax.ShapeDtypeStruct) -> DtypeLike | None:
            return dtype if path in inside else _apply(otherwise, path, leaf)

        return rule

    def _no_match(self, tree: Any) -> str:
        present = _module_types(tree)
        message = (
            f"`eqx_lean.dtypes.for_modules({_type_names(self.types)}, ...)` matches no module of "
            "the tree it was given: it holds no instance of "
            f"{'that type' if len(self.types) == 1 else 'those types'}, so the rule would choose "
            f"nothing. The tree's modules are of types: {_type_names(present) or 'none'}."
        )
        for wanted in self.types:
            for other in present:
                if other.__qualname__ == wanted.__qualname__ and other is not wanted:
                    message += (
                        f" Its {other.__qualname__} is {other.__module__}.{other.__qualname__}, "
                        f"a different class from the {wanted.__module__}.{wanted.__qualname__} "
                        "the rule names."
                    )
        return message + (
            " Name the classes the model uses, or pass a plain dtype to functions whose tree has "
            "none of them."
        )


@dataclasses.dataclass(frozen=True)
class ForVectors(TreeDtypeRule):
    """The rule `eqx_lean.dtypes.for_vectors` returns."""

    dtype: Any
    otherwise: Any = None

    def bind(
        self, tree: Any, paths: Sequence[KeyPath], structs: Sequence[jax.ShapeDtypeStruct]
    ) -> DtypeRule:
        if not any(is_floating(s.dtype) and len(s.shape) <= 1 for s in structs):
            shapes = sorted({str(list(s.shape)) for s in structs if is_floating(s.dtype)})
            raise ValueError(
                "`eqx_lean.dtypes.for_vectors(...)` matches no leaf of the tree it was given: "
                "no floating leaf has at most one dimension (per layer, for a stacked leaf), so "
                f"the rule would choose nothing. The floating leaves' shapes: "
                f"{', '.join(shapes) or 'none'}. Pass a plain dtype to functions whose tree has "
                "no vectors."
            )
        otherwise = _bind_otherwise(self.otherwise, tree, paths, structs)
        dtype = self.dtype

        def rule(path: KeyPath, leaf: jax.ShapeDtypeStruct) -> DtypeLike | None:
            return dtype if len(leaf.shape) <= 1 else _apply(otherwise, path, leaf)

        return rule


def for_modules(
    types: type | tuple[type, ...], dtype: DtypeLike, *, otherwise: DtypePolicy = None
) -> TreeDtypeRule:
    """A dtype rule by module type: every floating leaf inside a module of `types` gets `dtype`.

    Matching by type, not by name, cannot miss a norm because of how its attribute is called
    (`norm`, `ln_1`, `input_layernorm`): "keep every LayerNorm in float32" is

    ```python
    dtype = eqx_lean.dtypes.for_modules(eqx.nn.LayerNorm, jnp.float32, otherwise=jnp.bfloat16)
    blocks = eqx_lean.build_stacked(make_block, keys, dtype)
    ```

    It is resolved against the tree each function is given (one layer in `build_stacked`,
    `allocate_stacked`, `stack` and `memory.estimate`; `like` in `load_stacked` and
    `load_tensors`), and works wherever `dtype=` is taken. If that tree holds no instance of
    `types`, the function raises a `ValueError` that lists the module types the tree does hold:
    a rule that matches nothing is a mistake (a class of the same name from another module, say),
    never a silent no-op. [`eqx_lean.memory.describe`][] shows the dtype every leaf gets.

    **Arguments:**

    - `types`: a module class, or a tuple of them (as for `isinstance`); subclasses match too.
        A leaf matches when any module on its path is an instance.
    - `dtype`: the floating dtype for the leaves of those modules, such as `jnp.float32`.
    - `otherwise`: the dtype policy for every other leaf: `None` keeps its dtype (the default),
        a floating dtype casts it, and a rule (a function `(path, leaf) -> dtype | None`, or
        another rule of `eqx_lean.dtypes`) chooses.

    **Returns:**

    A dtype rule for any `dtype=` argument of eqx_lean.
    """
    as_tuple = types if isinstance(types, tuple) else (types,)
    if not as_tuple or not all(isinstance(t, type) for t in as_tuple):
        raise TypeError(
            "`types` must be a module class or a non-empty tuple of classes, such as "
            f"`eqx.nn.LayerNorm` or `(eqx.nn.LayerNorm, eqx.nn.RMSNorm)`; got {types!r}."
        )
    return ForModules(
        as_tuple, _as_floating_dtype(dtype, "`dtype`"), check_dtype_policy(otherwise, "`otherwise`")
    )


def for_vectors(dtype: DtypeLike, *, otherwise: DtypePolicy = None) -> TreeDtypeRule:
    """A dtype rule by rank: every floating leaf of at most one dimension gets `dtype`.

    Norm weights, biases and scalar scales are vectors or scalars; weight matrices are not. So
    "norms and biases in float32, the rest in bfloat16" is

    ```python
    dtype = eqx_lean.dtypes.for_vectors(jnp.float32, otherwise=jnp.bfloat16)
    ```

    A stacked leaf counts by one layer's shape (a stacked norm weight of shape `(L, d)` is a
    vector), as every dtype rule sees it. If no floating leaf of the tree a function is given
    is a vector or a scalar, the function raises a `ValueError` instead of doing nothing.

    **Arguments:**

    - `dtype`: the floating dtype for vectors and scalars, such as `jnp.float32`.
    - `otherwise`: the dtype policy for every other leaf, as for
        [`eqx_lean.dtypes.for_modules`][].

    **Returns:**

    A dtype rule for any `dtype=` argument of eqx_lean.
    """
    return ForVectors(
        _as_floating_dtype(dtype, "`dtype`"), check_dtype_policy(otherwise, "`otherwise`")
    )


def resolve_dtypes(
    dtype: DtypePolicy,
    tree: Any,
    paths: Sequence[KeyPath],
    structs: Sequence[jax.ShapeDtypeStruct],
) -> list[tuple[Any, bool]]:
    """Each leaf's stored dtype and weak type under the policy `dtype`: the one dtype resolver.

    **Arguments:**

    - `dtype`: `None`, a floating dtype, a rule `(path, leaf) -> dtype | None`, or a
        `TreeDtypeRule` (resolved here against `tree`).
    - `tree`: the tree the function was given (a layer, or `like`), for rules by module type.
    - `paths`, `structs`: its array leaves' key paths and the leaves as rules see them (one
        layer's shape for a stacked leaf).

    **Returns:**

    `(dtype, weak_type)` per leaf.
    """
    rule = dtype.bind(tree, paths, structs) if isinstance(dtype, TreeDtypeRule) else dtype
    return [leaf_dtype(rule, path, leaf) for path, leaf in zip(paths, structs, strict=True)]
