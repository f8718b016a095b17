"""int8, symmetric, one float32 scale per output channel (a weight's first axis).

A channel's scale is its largest magnitude times `float32(1 / 127)` (1 where the channel is all
zeros, so that it decodes to zeros): a product, since XLA rewrites a division by a constant
into one anyway, and a product rounds the same everywhere. Its codes are `round(x / scale)` to
nearest-even (a true division: the divisor is not a constant), within [-127, 127]. All of it in
IEEE float32 with subnormals, as NumPy computes it: the scale of a channel below about 1.5e-36
is a subnormal, which XLA:CPU would flush to zero (and the channel with it).
Decoding is `code * scale` in float32, rounded to nearest-even in the output dtype; a subnormal
scale is read exactly (a product rescaled by 2^64 and back), so that its codes decode to what
they stand for. A value below 2^-126 that a product gives is still flushed to zero where the
platform flushes (XLA:CPU).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int8

from ._ops import largest_magnitude, multiply_exactly, scale_rows, up_exactly


@jax.jit
def int8_encode(
    x: Float[Array, " out *rest"],
) -> tuple[Int8[Array, " out *rest"], Float[Array, " out"]]:
    """One weight's int8 codes and float32 per-output-channel scales."""
    values = x.astype(jnp.float32)
    # The row length spelled out, not -1: a weight with no rows (shape (0, n)) has one.
    rows = values.reshape(values.shape[0], math.prod(values.shape[1:]))
    absmax = largest_magnitude(rows)
    # Compared as bits: XLA:CPU reads a subnormal as zero.
    positive = lax.bitcast_convert_type(absmax, jnp.uint32) > 0
    scales = jnp.where(positive, multiply_exactly(absmax, 1 / 127), np.float32(1))
    scaled = jnp.round(scale_rows(rows, scales, reciprocal=False))
    # A row holding a NaN or an infinity has a NaN or infinite scale, and its values scale to
    # NaN (x / NaN, inf / inf) or 0: codes 0 throughout, as bitsandbytes' `int8_vectorwise_quant`
    # gives them on CPU, chosen here rather than left to the float-to-int conversion of a NaN.
    # The row decodes to NaN (0 times a NaN or an infinity), as bitsandbytes' does.
    codes = jnp.clip(jnp.where(jnp.isnan(scaled), np.float32(0), scaled), -127, 127)
    codes = codes.astype(jnp.int8)
    return codes.reshape(x.shape), scales


@functools.partial(jax.jit, static_argnames=("dtype",))
def int8_decode(
    codes: Int8[Array, " out *rest"], scales: Float[Array, " out"], dtype: jnp.dtype
) -> Array:
    """The weight `int8_encode` gave `codes` and `scales` for, in `dtype`."""
    # A subnormal scale (its exponent bits 0) times 2^64 is normal and exact; the product
    # times 2^-64 then rounds as the product itself, wherever that is normal. Elsewhere both
    # factors are 1: the plain product.
    exponent = lax.bitcast_convert_type(scales, jnp.uint32) & np.uint32(0x7F800000)
    subnormal = exponent == 0
    scaled = jnp.where(subnormal, up_exactly(scales), scales)
    after = jnp.where(subnormal, np.float32(2.0**-64), np.float32(1))
    width = math.prod(codes.shape[1:])
    rows = codes.reshape(codes.shape[0], width).astype(jnp.float32) * scaled[:, None]
    rows = rows * after[:, None]
    return rows.astype(dtype).reshape(codes.shape)
