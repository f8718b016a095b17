"""Helpers of the quantisers: exact division, mapping over leading batch axes, and float32
arithmetic that keeps subnormals where XLA:CPU flushes them.

XLA:CPU runs every program with subnormal inputs read as zero and subnormal results flushed to
zero. bitsandbytes and NumPy keep them (IEEE gradual underflow), and the quantisers' block
scales reach them at both ends of float32: the reciprocal of a scale above 2^126 is a
subnormal (flushed, a whole block would scale to zeros), and a block of values below 2^-126 is
all subnormals. `largest_magnitude`, `at_least`, `scale_rows`, `multiply_exactly` and
`subtract_exactly` compute what IEEE float32 computes there, from the bits and with exact
power-of-two rescalings, on every platform. They serve the encoders, which run once per
weight; decoding, which runs at every product, stays plain float32 arithmetic.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, Float

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
    flat = x.reshape((math.prod(batch), *x.shape[batch_dims:]))  # not -1: 0 values reshape too
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


# Float32 bit fields, and the bits of a few float32 values.
_SIGN = np.uint32(0x80000000)
_MAGNITUDE = np.uint32(0x7FFFFFFF)
_EXPONENT = np.uint32(0x7F800000)
_MANTISSA = np.uint32(0x007FFFFF)
_INF = np.uint32(0x7F800000)
_TWO_56 = np.float32(2.0**56).view(np.uint32)
_TWO_62 = np.float32(2.0**62).view(np.uint32)
_TWO_126 = np.float32(2.0**126).view(np.uint32)
# Rescalings by 2^64 either way: exact for every value they are applied to below.
_UP, _DOWN = np.float32(2.0**64), np.float32(2.0**-64)
# The least subnormal, 2^-149, times 2^64.
_UNIT_UP = np.float32(2.0**-85)


def _bits(x: Array) -> Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


def _floats(bits: Array) -> Array:
    return lax.bitcast_convert_type(bits, jnp.float32)


def largest_magnitude(
    x: Float[Array, "*rows n"], *, skip_nan: bool = False
) -> Float[Array, "*rows"]:
    """The largest `|x|` along the last axis, compared as bits (which order non-negative
    floats as their values), so that subnormals count and a block of them is not a zero block.

    A NaN is the largest magnitude (torch's `max`, which bitsandbytes' 4-bit format uses), or,
    with `skip_nan`, is passed over (C's `fmax`, which its 8-bit CPU kernel uses: a block of
    NaNs then has a largest magnitude of 0).
    """
    magnitudes = _bits(x) & _MAGNITUDE
    if skip_nan:
        magnitudes = jnp.where(magnitudes > _INF, np.uint32(0), magnitudes)
    return _floats(jnp.max(magnitudes, axis=-1))


def at_least(x: Array, floor: np.float32) -> Array:
    """`max(x, floor)` for non-negative `x`, compared as bits (subnormals count); a NaN in `x`
    stays NaN, as in torch's `clamp(min=floor)`."""
    return _floats(jnp.maximum(_bits(x), floor.view(np.uint32)))


def up_exactly(x: Array) -> Array:
    """`x * 2^64`, exactly, for `|x| < 2^64`: a subnormal `x` (read as zero by a product on
    XLA:CPU) is rebuilt from its mantissa bits, an integer number of units 2^-149."""
    bits = _bits(x)
    tiny = (bits & _MANTISSA).astype(jnp.int32).astype(jnp.float32) * _UNIT_UP
    tiny = _floats(_bits(tiny) | (bits & _SIGN))
    return jnp.where((bits & _EXPONENT) == 0, tiny, x * _UP)


def _subnormal_reciprocal(bits: Array) -> Array:
    """The bits of `1 / d` in float32 for `d` (given by its bits) in `[2^126, 2^128)`: a
    subnormal (2^-126 itself at `d = 2^126`), whose bits are its number of units 2^-149.

    That number is `2^149 / d` rounded to the nearest integer, ties to even: `2^46 / m` or
    `2^45 / m` for `d`'s 24-bit significand `m`, divided here bit by bit in `uint32`. Dividing
    in float32 would round twice (to 24 bits, then to the subnormal's fewer), and differ at
    some `d`.
    """
    m = (bits & _MANTISSA) | np.uint32(1 << 23)
    # The numerator's leading bits, 2^23 (exponent field 253: d in [2^126, 2^127)) or 2^22;
    # the 23 bits below them are zeros, brought down one at a time.
    rem = jnp.where((bits >> 23) == 253, np.uint32(1 << 23), np.uint32(1 << 22))
    quotient = (rem >= m).astype(jnp.uint32)
    rem = rem - quotient * m

    def step(_: Any, state: tuple[Array, Array]) -> tuple[Array, Array]:
        rem, quotient = state
        rem = rem << 1  # below 2^25: rem < m < 2^24 before the shift
        bit = (rem >= m).astype(jnp.uint32)
        return rem - bit * m, (quotient << 1) | bit

    # A loop, not 23 unrolled steps: XLA would fuse those into every consumer of the result,
    # repeating the division for each value of a block (and compiling it for seconds).
    rem, quotient = lax.fori_loop(0, 23, step, (rem, quotient))
    # The remainder is never exactly half of `m` unless it is 0: `m` would divide 2^47.
    return quotient + ((rem << 1) > m).astype(jnp.uint32)


def scale_rows(
    x: Float[Array, "*rows n"], divisor: Float[Array, "*rows"], *, reciprocal: bool
) -> Float[Array, "*rows n"]:
    """Each row of `x` scaled by its `divisor` (non-negative, inf or NaN), as IEEE float32
    computes it with subnormals: `x * (1 / divisor)` (two roundings) if `reciprocal`, else
    `x / divisor` (one). The values may be up to 127 times their divisor (int8's codes).

    Exact wherever the result's magnitude is at least 2^-62; smaller results (which no code
    boundary of the quantisers is near) may come out as zero or a few ulps off. Both operands
    are rescaled by 2^64: up where `divisor < 2^56` (so that subnormals become normal, with
    `up_exactly`), down elsewhere, which changes no rounding of a normal result. A reciprocal
    that is a subnormal (`divisor > 2^126`) is computed from the bits
    (`_subnormal_reciprocal`); one that overflows (`divisor` below about 2^-128, or 0) is
    `inf`.
    """
    magnitude = _bits(divisor) & _MAGNITUDE
    up = magnitude < _TWO_56
    x_scaled = jnp.where(up[..., None], up_exactly(x), x * _DOWN)
    d_scaled = jnp.where(up, up_exactly(divisor), divisor * _DOWN)
    if not reciprocal:
        return divide_exactly(x_scaled, d_scaled[..., None])
    inverse = np.float32(1) / d_scaled  # 1 / divisor times 2^64 (up) or 2^-64 (down)
    inverse = jnp.where(up & (inverse >= _UP), np.float32(np.inf), inverse)
    subnormal = (magnitude > _TWO_126) & (magnitude < _INF)
    units = _subnormal_reciprocal(jnp.where(subnormal, magnitude, _TWO_126))
    inverse = jnp.where(subnormal, units.astype(jnp.float32) * _UNIT_UP, inverse)
    return x_scaled * inverse[..., None]


def _split(x: Array) -> tuple[Array, Array]:
    """A normal float32 as the sum of its 12 leading significant bits and the rest (exactly)."""
    high = _floats(_bits(x) & np.uint32(0xFFFFF000))
    return high, x - high


def multiply_exactly(x: Array, c: float) -> Array:
    """`x * c` for non-negative `x` (inf, NaN) and a constant `0 < c <= 1`, rounded as IEEE
    float32 rounds it, a subnormal product included (XLA:CPU flushes it to zero).

    A product below 2^-126 is a whole number of units 2^-149: the exact product of `x` in
    those units (normal after `up_exactly`) and `c` is `p + e`, `p` its float32 rounding and
    `e` the error, computed exactly from 12-bit halves of both (Dekker's product: each partial
    product is exact, so no contraction into a fused multiply-add changes it). Rounding `p` to
    an integer rounds the product itself, except where `p` falls on a half that the product
    does not: there `e` says which way.
    """
    constant = np.float32(c)
    assert 0 < constant <= 1, c
    c_high = np.uint32(constant.view(np.uint32) & 0xFFFFF000).view(np.float32)
    c_low = np.float32(constant - c_high)
    units = up_exactly(x) * np.float32(2.0**85)  # x / 2^-149, exact where the product is tiny
    p = units * constant
    u_high, u_low = _split(units)
    e = (u_high * c_high - p) + u_high * c_low + u_low * c_high + u_low * c_low
    whole = jnp.floor(p)
    past_half = (p - whole == 0.5) & (e != 0)
    rounded = jnp.where(past_half, whole + (e > 0).astype(jnp.float32), jnp.round(p))
    # At most 2^23 units: 2^-126, the least normal, whose bits are that same number.
    tiny = _floats(rounded.astype(jnp.uint32))
    return jnp.where(p < np.float32(2.0**23), tiny, x * constant)


def down_exactly(x: Array) -> Array:
    """`x * 2^-64` rounded to float32's grid (to nearest, ties to even), as an IEEE product
    rounds it: a subnormal result (flushed by a product on XLA:CPU) is built from its bits.
    Exact where `x` is 2^64 times a float32 value (the inverse of `up_exactly`)."""
    magnitude = jnp.abs(x)
    units = jnp.round(magnitude * np.float32(2.0**85)).astype(jnp.uint32)  # at most 2^23
    tiny = _floats(units | (_bits(x) & _SIGN))
    return jnp.where(magnitude < np.float32(2.0**-62), tiny, x * _DOWN)


def subtract_exactly(a: Array, b: Array) -> Array:
    """`a - b` as IEEE float32 computes it, subnormal operands and differences included.

    Below 2^62 both are subtracted 2^64 times larger, which rounds a normal difference the same
    and keeps a subnormal one (always exact); a larger operand leaves no subnormal term that
    could matter.
    """
    small = ((_bits(a) & _MAGNITUDE) < _TWO_62) & ((_bits(b) & _MAGNITUDE) < _TWO_62)
    return jnp.where(small, down_exactly(up_exactly(a) - up_exactly(b)), a - b)
