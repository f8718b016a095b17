"""Two helpers of the quantisers: exact division, and mapping over leading batch axes."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike

from .._platform import barrier_on_cpu


def divide_exactly(x: Array, divisor: ArrayLike) -> Array:
    """`x / divisor` rounded once, as IEEE division (and NumPy, and torch) rounds it.

    XLA:CPU rewrites a division by a broadcast value into a product with its reciprocal (two
    roundings): on 512,000 float32 quotients by a per-row divisor, 135,610 differ in the last
    bit. XLA:GPU keeps the division (an H100 compile-only plan shows a `divide` and no
    `multiply`). So on CPU only, the broadcast divisor goes behind an optimisation barrier,
    which keeps the division whole. Not under `vmap`: there an unbatched divisor is broadcast
    after the barrier, and rewritten again; quantisers map over layers with `lax.map`
    (`one_by_one`).
    """
    full = jnp.broadcast_to(divisor, jnp.broadcast_shapes(jnp.shape(x), jnp.shape(divisor)))
    return x / barrier_on_cpu(full)


def batched(fn: Callable[..., Any], batch_dims: int) -> Callable[..., Any]:
    """`fn` mapped over `batch_dims` leading axes (each tensor quantised on its own)."""
    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    return fn


def one_by_one(fn: Callable[[Array], Any], x: Array, batch_dims: int) -> Any:
    """`fn` applied to each tensor along `x`'s `batch_dims` leading axes, one after the other
    (`lax.map`): a stack is quantised with one layer's temporaries, not the whole stack's."""
    if batch_dims == 0:
        return fn(x)
    batch = x.shape[:batch_dims]
    flat = x.reshape((-1, *x.shape[batch_dims:]))
    out = jax.lax.map(fn, flat)
    return jax.tree.map(lambda o: o.reshape(batch + o.shape[1:]), out)


def widen_exactly(x: Array) -> Array:
    """`x` as float32, read from its bits: the values `x` holds in its own dtype.

    A plain `x.astype(float32)` lets XLA drop the rounding that made `x` (its "excess
    precision" simplification of a convert pair, on every platform): a layer drawn in float32
    and cast to bfloat16 in the same program, as `build_stacked` builds it, would be read at
    float32 precision, and quantised differently from the stored bfloat16 weights. Reading
    the bits leaves the rounding in place.
    """
    if x.dtype == jnp.bfloat16:
        bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
        return lax.bitcast_convert_type(bits, jnp.float32)
    if x.dtype == jnp.float16:
        bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
        sign = (bits >> 15) << 31
        exponent, mantissa = (bits >> 10) & 31, bits & 1023
        normal = sign | ((exponent + 112) << 23) | (mantissa << 13)
        special = sign | (255 << 23) | (mantissa << 13)  # inf and nan
        wide = lax.bitcast_convert_type(jnp.where(exponent == 31, special, normal), jnp.float32)
        # Subnormals (and zeros): mantissa * 2^-24, exact in float32.
        tiny = mantissa.astype(jnp.float32) * np.float32(2.0**-24)
        tiny = jnp.where(sign > 0, -tiny, tiny)
        return jnp.where(exponent == 0, tiny, wide)
    return x.astype(jnp.float32)


def halving_sum(values: Array) -> Array:
    """The sum of a vector in one fixed order, whatever program it is compiled in.

    `jnp.sum`'s order is XLA's choice, which differs between programs (a layer built alone by
    `build_stacked`, a stack quantised under `lax.map`), so the same scales could get offsets
    one ulp apart. Here the vector, padded with zeros to a power of two, is halved by
    elementwise adds of its two halves until one value is left: additions XLA does not
    reorder.
    """
    size = 1 << max(0, (values.shape[0] - 1).bit_length())
    values = jnp.pad(values, (0, size - values.shape[0]))
    while values.shape[0] > 1:
        half = values.shape[0] // 2
        values = values[:half] + values[half:]
    return values[0]
