"""8-bit blockwise codes on the signed dynamic map: how double quantisation stores NF4 scales.

QLoRA's double quantisation (bitsandbytes' `quantize_4bit(compress_statistics=True)`) keeps a
tensor's NF4 block scales as `absmax - offset`, `offset` their mean, quantised in blocks of 256
by `quantize_blockwise` on the signed dynamic map. Its CPU kernel (0.50.2,
`cquantize_blockwise_cpu_fp32`) does not search the map: it reads the code from a table of
65,536 bins, and `tests/test_quant.py` checks the codes here against it bit for bit:

- each block's scale is its largest magnitude (float32), NaNs passed over (C's `fmax`);
- a value is scaled by `x * (1 / absmax)`, clipped to [-1, 1], and put in bin
  `floor((v + 1) * 0.5 * 65535 + 0.5)`, all in IEEE float32 (subnormals kept, where XLA:CPU
  would flush them); a NaN takes code 0. So a block of zeros gets code 0 everywhere and scale
  0 (`0 * (1 / 0)` is NaN), a block with an infinity scales by 0 (its infinities to NaN);
- bin `i` holds the code nearest `-1 + 2 * i / 65535` (float32): the number of float32
  midpoints of the map strictly below it. So a value's code is the nearest code to its bin's
  centre, not always to itself: in 65,536 scales, about 100 codes differ from the nearest one.

Decoding is `map[code] * absmax` in float32, as bitsandbytes' `dequantize_blockwise` (a product
below 2^-126 is flushed to zero where the platform flushes, as XLA:CPU does).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

from ._codebooks import DYNAMIC8
from ._ops import largest_magnitude, scale_rows


_BINS = 65536


def _bin_codes() -> np.ndarray:
    """Bin `i`'s code, computed in float32 step by step as bitsandbytes builds its table."""
    midpoints = (np.float32(0.5) * (DYNAMIC8[:-1] + DYNAMIC8[1:])).astype(np.float32)
    index = np.arange(_BINS).astype(np.float32)
    centres = np.float32(-1) + (np.float32(2) * index) / np.float32(_BINS - 1)
    return np.searchsorted(midpoints, centres.astype(np.float32), side="left").astype(np.uint8)


_BIN_CODES = _bin_codes()


@functools.partial(jax.jit, static_argnames=("blocksize",))
def dynamic8_encode(
    x: Float[Array, " size"], blocksize: int
) -> tuple[UInt8[Array, " size"], Float[Array, " blocks"]]:
    """A flat float32 tensor's 8-bit dynamic-map codes and block scales (see the docstring)."""
    size = x.shape[0]
    blocks = -(-size // blocksize)
    # Zeros pad the last block: they change neither its largest magnitude nor its codes.
    padded = jnp.pad(x.astype(jnp.float32), (0, blocks * blocksize - size))
    padded = padded.reshape(blocks, blocksize)
    absmax = largest_magnitude(padded, skip_nan=True)
    # IEEE float32 with subnormals (`scale_rows`), as the kernel computes: a scale of 0 (or
    # below about 2^-128) has an infinite reciprocal, so its zeros scale to NaN.
    scaled = jnp.clip(scale_rows(padded, absmax, reciprocal=True), -1.0, 1.0)
    bins = ((scaled + 1.0) * 0.5 * np.float32(_BINS - 1) + 0.5).astype(jnp.uint16)
    codes = jnp.where(jnp.isnan(scaled), jnp.uint8(0), jnp.asarray(_BIN_CODES)[bins])
    return codes.reshape(-1)[:size], absmax


@functools.partial(jax.jit, static_argnames=("blocksize",))
def dynamic8_decode(
    codes: UInt8[Array, " size"], absmax: Float[Array, " blocks"], blocksize: int
) -> Float[Array, " size"]:
    """`map[code] * absmax` in float32: the values `dynamic8_encode` gave `codes` for."""
    size = codes.shape[0]
    values = jnp.asarray(DYNAMIC8)[codes]
    blocks = absmax.shape[0]
    padded = jnp.pad(values, (0, blocks * blocksize - size)).reshape(blocks, blocksize)
    return (padded * absmax[:, None]).reshape(-1)[:size]
