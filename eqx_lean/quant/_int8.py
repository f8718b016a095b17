"""int8, symmetric, one float32 scale per output channel (a weight's first axis).

A channel's scale is its largest magnitude times `float32(1 / 127)` (1 where the channel is all
zeros, so that it decodes to zeros): a product, since XLA rewrites a division by a constant
into one anyway, and a product rounds the same everywhere. Its codes are `round(x / scale)` to
nearest-even (a true division: the divisor is not a constant), within [-127, 127].
Decoding is `code * scale` in float32, rounded to nearest-even in the output dtype.
"""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int8

from ._ops import divide_exactly


def int8_encode(
    x: Float[Array, " out *rest"],
) -> tuple[Int8[Array, " out *rest"], Float[Array, " out"]]:
    """One weight's int8 codes and float32 per-output-channel scales."""
    values = x.astype(jnp.float32)
    rows = values.reshape(values.shape[0], -1)
    absmax = jnp.max(jnp.abs(rows), axis=1)
    scales = jnp.where(absmax > 0, absmax * np.float32(1 / 127), np.float32(1))
    codes = jnp.clip(jnp.round(divide_exactly(rows, scales[:, None])), -127, 127)
    codes = codes.astype(jnp.int8)
    return codes.reshape(x.shape), scales


def int8_decode(
    codes: Int8[Array, " out *rest"], scales: Float[Array, " out"], dtype: jnp.dtype
) -> Array:
    """The weight `int8_encode` gave `codes` and `scales` for, in `dtype`."""
    rows = codes.reshape(codes.shape[0], -1).astype(jnp.float32) * scales[:, None]
    return rows.astype(dtype).reshape(codes.shape)
