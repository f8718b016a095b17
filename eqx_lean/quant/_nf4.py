"""NF4: 4-bit NormalFloat codes in blocks of a float32 scale each, bit for bit bitsandbytes'.

The format is bitsandbytes' `quantize_4bit(quant_type="nf4")` as its CPU backend computes it
(0.50.2), which `tests/test_quant.py` and `tests/test_quant_extremes.py` check against:

- the tensor is flattened (row-major) and cut into blocks of `blocksize` values; each block's
  scale is its largest magnitude, in float32 (NaN if the block holds a NaN);
- each value is scaled into [-1, 1] by `x * (1 / max(absmax, 1e-38))` in a full block and by
  `x / max(absmax, 1e-38)` in a last partial block (two roundings against one: they differ in
  the last bit), and clipped to [-1, 1]; a full block stores its `absmax`, the partial block
  the clamped one;
- its code is the index of the NF4 bin it falls in, the bins cut at the float32 midpoints of
  the sorted table; a value on a midpoint takes the lower code (a nearest-code `argmin` breaks
  such ties, and rounds differently near them); a NaN takes code 15;
- two codes per byte, the first of each pair in the high nibble; an odd count is padded with
  the code of zero.

All of it is IEEE float32 arithmetic with subnormals, as torch computes it, across the whole
float32 range: XLA:CPU flushes subnormals to zero, so the reciprocal of a scale above 2^126
(a subnormal) and the values of a block below 2^-126 are computed from their bits
(`eqx_lean.quant._ops.scale_rows`); a plain product would quantise such blocks to zeros.

Non-finite values follow bitsandbytes' rule, which is matched rather than refused (a check
would need the values on the host, and quantising also runs inside compiled programs, such as
a quantising load): a block holding a NaN has a NaN scale and all codes 15, and decodes to
NaN; a block holding an infinity (and no NaN) has an infinite scale, its finite values scale
to 0 (code 7: decoded, `0 * inf` is NaN) and its infinities to NaN (code 15: decoded, `+inf`,
whatever their sign).

Decoding is `table[code] * absmax` in float32, then rounded to nearest-even in the output
dtype. Two differences stay, both in what decoding gives, never in the codes and scales:

- a decoded value below 2^-126 (a float32 subnormal: only in blocks whose scale is below
  about 2^-122) is flushed to zero where the platform flushes (XLA:CPU), where bitsandbytes
  keeps it. Decoding runs in every quantised product, so it stays one plain product a value.
- bitsandbytes' bfloat16 CPU kernel rounds the NaN scale of a partial block (all bits set)
  with an integer add that wraps around, and decodes that block to +0 in bfloat16 (NaN in
  float32); here it decodes to NaN in every dtype.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

from ._codebooks import NF4
from ._ops import at_least, largest_magnitude, scale_rows


_NF4_BOUNDS = ((NF4[:-1] + NF4[1:]) / np.float32(2)).astype(np.float32)
# bitsandbytes' clamp of a block's largest magnitude before it scales by it: a subnormal.
_LEAST_SCALE = np.float32(1e-38)


def num_blocks(size: int, blocksize: int) -> int:
    """How many blocks of `blocksize` a tensor of `size` values has (the last may be partial)."""
    return -(-size // blocksize)


@functools.partial(jax.jit, static_argnames=("blocksize",))
def nf4_encode(
    x: Float[Array, "..."], blocksize: int
) -> tuple[UInt8[Array, " bytes"], Float[Array, " blocks"]]:
    """One tensor's packed NF4 codes and float32 block scales (see the module's docstring)."""
    flat = jnp.ravel(x).astype(jnp.float32)
    size = flat.shape[0]
    full = size - size % blocksize
    scaled, scales = [], []
    # IEEE float32 with subnormals throughout (`scale_rows`): XLA:CPU would flush the
    # reciprocal of a scale above 2^126, and values below 2^-126, to zero. A zero scale needs
    # no case of its own: its block scales by the clamped 1e-38 to zeros, as bitsandbytes'.
    if full:
        blocks = flat[:full].reshape(-1, blocksize)
        absmax = largest_magnitude(blocks)  # stored unclamped, as bitsandbytes stores it
        values = scale_rows(blocks, at_least(absmax, _LEAST_SCALE), reciprocal=True)
        scaled.append(jnp.clip(values, -1.0, 1.0).reshape(-1))
        scales.append(absmax)
    if full < size:
        rest = flat[None, full:]
        absmax = at_least(largest_magnitude(rest), _LEAST_SCALE)  # stored clamped
        values = scale_rows(rest, absmax, reciprocal=False)
        scaled.append(jnp.clip(values, -1.0, 1.0).reshape(-1))
        scales.append(absmax)
    values = jnp.concatenate(scaled)
    if size % 2:
        values = jnp.pad(values, (0, 1))
    # The number of midpoints strictly below a value: its bin, ties to the lower code; a NaN
    # (in a block with a NaN or an infinity) is above them all: code 15, as in bitsandbytes.
    # A search, not a 16-way comparison over the whole tensor.
    codes = jnp.searchsorted(jnp.asarray(_NF4_BOUNDS), values, side="left").astype(jnp.uint8)
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed, jnp.concatenate(scales)


@functools.partial(jax.jit, static_argnames=("shape", "blocksize", "dtype"))
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
