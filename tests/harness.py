"""What many test files share: bitwise assertions, keys and meshes over the suite's devices.

Imported as `from harness import ...` (pytest puts `tests/` on `sys.path`, as it does for the
worker modules beside this file). Fixtures live in `conftest.py`; plain helpers live here.

The suite's own process has eight CPU devices (`conftest.py` sets `jax_num_cpu_devices`), so
a test takes the first `n` of them for an `n`-device mesh; the subprocesses that tests start
keep one device unless they ask for more.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def keys_of(n: int, seed: int = 0) -> jax.Array:
    """`n` typed keys split from `jax.random.key(seed)`, ready (not a pending computation)."""
    return jax.block_until_ready(jax.random.split(jax.random.key(seed), n))


def bits(x: Any) -> np.ndarray:
    """`x`'s bytes as unsigned integers of its item size, so that equality is bitwise (NaNs and
    signed zeros included); integer and boolean arrays as they are."""
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind in "fcV" else x


def arrays(tree: Any) -> list[Any]:
    """The array leaves of `tree`, in order."""
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def assert_bitwise_equal(actual: Any, expected: Any) -> None:
    """`actual` is `expected`: the same tree structure, the same type (shape, dtype and, on
    Explicit mesh axes, sharding) of every array leaf, the same bits, and equal other leaves.
    Shape-dtype structs compare by shape and dtype."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    leaves = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    for i, (a, b) in enumerate(leaves):
        if isinstance(b, jax.ShapeDtypeStruct):
            assert (a.shape, a.dtype) == (b.shape, b.dtype), (i, a, b)
        elif eqx.is_array(b):
            assert jax.typeof(a) == jax.typeof(b), (i, jax.typeof(a), jax.typeof(b))
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"leaf {i}")
        else:
            assert a == b, (i, a, b)


def mesh_of(
    shape: Sequence[int], names: Sequence[str], axis_type: AxisType = AxisType.Explicit
) -> Mesh:
    """A mesh of `shape` over the first `prod(shape)` of this process's devices, every axis of
    `axis_type` (JAX's default, Explicit, unless given)."""
    devices = jax.devices()[: int(np.prod(shape))]
    assert len(devices) == int(np.prod(shape)), f"{shape} needs more than {len(devices)} devices"
    return jax.make_mesh(tuple(shape), tuple(names), (axis_type,) * len(shape), devices=devices)
