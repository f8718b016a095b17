"""NF4: 4-bit NormalFloat codes in blocks of a float32 scale each, bit for bit bitsandbytes'.

The format is bitsandbytes' `quantize_4bit(quant_type="nf4")` as its CPU backend computes it
(0.50.2), which `tests/test_quant.py` checks against:

- the tensor is flattened (row-major) and cut into blocks of `blocksize` values; each block's
  scale is its largest magnitude, in float32;
- each value is scaled into [-1, 1] by `x * (1 / absmax)` in a full block and by `x / absmax`
  in a last partial block (two roundings against one: they differ in the last bit), with
  `absmax` clamped to at least 1e-38 there, and clipped to [-1, 1];
- its code is the index of the NF4 bin it falls in, the bins cut at the float32 midpoints of
  the sorted table; a value on a midpoint takes the lower code (a nearest-code `argmin` breaks
  such ties, and rounds differently near them);
- two codes per byte, the first of each pair in the high nibble; an odd count is padded with
  the code of zero.

Decoding is `table[code] * absmax` in float32, then rounded to nearest-even in the output
dtype. One difference stays: a block whose largest magnitude is a float32 subnormal (below
1.2e-38) is a zero block here, as XLA:CPU flushes subnormals, where bitsandbytes scales it.
"""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

from ._codebooks import NF4
from ._ops import divide_exactly


_NF4_BOUNDS = ((NF4[:-1] + NF4[1:]) / np.float32(2)).astype(np.float32)


def num_blocks(size: int, blocksize: int) -> int:
    """How many blocks of `blocksize` a tensor of `size` values has (the last may be partial)."""
    return -(-size // blocksize)


def nf4_encode(
    x: Float[Array, "..."], blocksize: int
) -> tuple[UInt8[Array, " bytes"], Float[Array, " blocks"]]:
    """One tensor's packed NF4 codes and float32 block scales (see the module's docstring)."""
    flat = jnp.ravel(x).astype(jnp.float32)
    size = flat.shape[0]
    full = size - size % blocksize
    scaled, scales = [], []
    # bitsandbytes clamps a zero absmax to 1e-38 before scaling: a subnormal, which XLA:CPU
    # flushes to zero (1 / 0, then 0 * inf = NaN). A zero block scales to zeros directly; the
    # clamped scale a partial block stores is selected, not computed, so it keeps its bits.
    if full:
        blocks = flat[:full].reshape(-1, blocksize)
        absmax = jnp.max(jnp.abs(blocks), axis=1)
        inverse = jnp.where(absmax > 0, 1.0 / absmax, np.float32(0))
        scaled.append(jnp.clip(blocks * inverse[:, None], -1.0, 1.0).reshape(-1))
        scales.append(absmax)
    if full < size:
        rest = flat[full:]
        absmax = jnp.max(jnp.abs(rest))
        positive = absmax > 0
        divided = divide_exactly(rest, jnp.where(positive, absmax, np.float32(1)))
        scaled.append(jnp.clip(jnp.where(positive, divided, np.float32(0)), -1.0, 1.0))
        scales.append(jnp.where(positive, absmax, np.float32(1e-38))[None])
    values = jnp.concatenate(scaled)
    if size % 2:
        values = jnp.pad(values, (0, 1))
    # The number of midpoints strictly below a value: its bin, ties to the lower code. A
    # search, not a 16-way comparison over the whole tensor.
    codes = jnp.searchsorted(jnp.asarray(_NF4_BOUNDS), values, side="left").astype(jnp.uint8)
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed, jnp.concatenate(scales)


def nf4_decode(
    packed: UInt8[Array, " bytes"],
    absmax: Float[Array, " blocks"],
    shape: tuple[int, ...],
    blocksize: int,
    dtype: jnp.dtype,
) -> Array:
    """The tensor of `shape` that `nf4_encode` gave `packed` and `absmax` for, in `dtype`."""
    size = int(np.prod(shape, dtype=np.int64))
    codes = jnp.stack([packed >> 4, packed & 0xF], axis=-1).reshape(-1)[:size]
    values = jnp.asarray(NF4)[codes]
    blocks = num_blocks(size, blocksize)
    padded = jnp.pad(values, (0, blocks * blocksize - size)).reshape(blocks, blocksize)
    decoded = (padded * absmax[:, None]).reshape(-1)[:size]
    return decoded.astype(dtype).reshape(shape)
