"""Dtype policies: which dtype each array leaf of a layer is stored in."""

from collections.abc import Callable
from typing import Any, TypeAlias, TypeGuard, cast

import jax
import jax.numpy as jnp
import numpy as np


DtypeLike: TypeAlias = Any
KeyPath: TypeAlias = tuple[Any, ...]
DtypeRule: TypeAlias = Callable[[KeyPath, jax.ShapeDtypeStruct], DtypeLike | None]
DtypePolicy: TypeAlias = DtypeLike | DtypeRule | None


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


def check_dtype_policy(dtype: DtypePolicy) -> DtypePolicy:
    """Validates a `dtype` argument eagerly, so a bad one fails before anything is built."""
    if dtype is None or _is_rule(dtype):
        return dtype
    return _as_floating_dtype(dtype, "`dtype`")


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
    if _is_rule(dtype):
        chosen = dtype(path, leaf)
        if chosen is None:
            return leaf.dtype, weak
        where = f"the `dtype` rule's result for leaf {jax.tree_util.keystr(path)}"
        return _as_floating_dtype(chosen, where), False
    return jnp.dtype(cast(Any, dtype)), False
