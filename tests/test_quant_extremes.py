"""`eqx_lean.quant` at the ends of float32 and on non-finite values, against bitsandbytes 0.50.2
(NF4, its nested scales, its 8-bit dynamic map) and NumPy (int8): both keep subnormals, which
XLA:CPU flushes to zero.

Each test compiles one program per dtype: its cases are values, not shapes. Codes and scales
are compared bit for bit (a NaN as a NaN: its payload is not part of the format); decoded
values too, except where bitsandbytes' value is itself a float32 subnormal, which XLA:CPU
flushes to zero (`eqx_lean.quant._nf4`'s docstring).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_lean.internal import NF4, dynamic8_decode, dynamic8_encode
from eqx_lean.quant import DoubleQuantizedScales, quantize


torch = pytest.importorskip("torch")
bnb_functional = pytest.importorskip("bitsandbytes.functional")

_TORCH = {jnp.float32: torch.float32, jnp.bfloat16: torch.bfloat16}
_MIDPOINTS = ((NF4[:-1] + NF4[1:]) / np.float32(2)).astype(np.float32)
_LEAST_NORMAL = np.finfo(np.float32).tiny
_MAX = np.finfo(np.float32).max


@jax.jit
def _nf4(x):
    return quantize(x)


@jax.jit
def _nf4_nested(x):
    return quantize(x, double_quant=True)


def _as(x: np.ndarray, dtype) -> np.ndarray:
    """`x` rounded to `dtype`, as float32 values (torch rounds, not JAX: no flush here)."""
    return torch.from_numpy(np.asarray(x, np.float32)).to(_TORCH[dtype]).float().numpy()


def _bnb_nf4(x: np.ndarray, dtype, blocksize: int = 64, nested: bool = False):
    t = torch.from_numpy(np.asarray(x, np.float32)).to(_TORCH[dtype])
    packed, state = bnb_functional.quantize_4bit(
        t, blocksize=blocksize, quant_type="nf4", compress_statistics=nested
    )
    return packed, state


def _bnb_decoded(packed, state, out) -> np.ndarray:
    state.dtype = _TORCH[out]
    return bnb_functional.dequantize_4bit(packed, state, quant_type="nf4").float().numpy()


def _assert_same_floats(ours, theirs, err_msg: str = "") -> None:
    """Bit for bit, a NaN for a NaN."""
    ours = np.asarray(ours, np.float32).reshape(-1)
    theirs = np.asarray(theirs, np.float32).reshape(-1)
    nan = np.isnan(theirs)
    np.testing.assert_array_equal(np.isnan(ours), nan, err_msg=f"NaNs {err_msg}")
    np.testing.assert_array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32), err_msg)


def _assert_decoded(ours, theirs, err_msg: str = "") -> None:
    """As `_assert_same_floats`, but where bitsandbytes' value is a subnormal, ours is it or 0
    (flushed, on XLA:CPU)."""
    ours = np.asarray(ours).astype(np.float32).reshape(-1)  # ml_dtypes: exact, no flush
    theirs = np.asarray(theirs, np.float32).reshape(-1)
    tiny = (theirs != 0) & (np.abs(theirs) < _LEAST_NORMAL)
    assert np.all((ours[tiny] == 0) | (ours[tiny] == theirs[tiny])), err_msg
    _assert_same_floats(ours[~tiny], theirs[~tiny], err_msg)


def _probe_blocks(rng, scales: np.ndarray) -> np.ndarray:
    """A block of 64 values per scale `a`: `a` itself, each NF4 midpoint times `a` and its two
    float32 neighbours (there a code depends on the last bit of the scaled value, so on the
    exact reciprocal of `a`), and random values below `a`, with random signs."""
    a = scales.astype(np.float32)[:, None]
    on = (_MIDPOINTS[None, :] * a).astype(np.float32)
    probes = [a, on, np.nextafter(on, np.float32(np.inf)), np.nextafter(on, np.float32(-np.inf))]
    rest = (rng.uniform(-1, 1, (len(a), 64 - 46)).astype(np.float32) * a).astype(np.float32)
    blocks = np.concatenate([*probes, rest], axis=1)
    blocks = np.minimum(np.abs(blocks), a)  # a neighbour above a would change the scale
    return (blocks * rng.choice(np.array([-1, 1], np.float32), blocks.shape)).astype(np.float32)


def _scales_of(rng, exponents: np.ndarray) -> np.ndarray:
    """Random float32 values `m * 2^e`, `m` in [1, 2): subnormal below e = -126."""
    mantissas = rng.uniform(1, 2, len(exponents))
    return np.ldexp(mantissas, exponents).astype(np.float32)


# The full blocks of the range test: every exponent of float32 (subnormals included), and the
# two exponents whose reciprocals are subnormal (above 2^126) many times over.
_RANGE_EXPONENTS = np.concatenate([np.arange(-149, 128), np.repeat([126, 127], 200)])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("last_exponent", [-149, -135, -127, 0, 56, 126, 127])
def test_nf4_over_the_whole_float32_range_is_bitsandbytes(last_exponent, dtype):
    rng = np.random.default_rng(0)
    full = _probe_blocks(rng, _scales_of(rng, _RANGE_EXPONENTS)).reshape(-1)
    # The last block is partial (62 values, scaled by a division): its scale's exponent is the
    # case; bitsandbytes clamps a scale below 1e-38 to 1e-38 there.
    last = _probe_blocks(rng, _scales_of(rng, np.array([last_exponent])))[0, :62]
    x = _as(np.concatenate([full, last]), dtype)
    q = _nf4(jnp.asarray(x, dtype))
    packed, state = _bnb_nf4(x, dtype)
    np.testing.assert_array_equal(np.asarray(q.codes), packed.reshape(-1).numpy())
    _assert_same_floats(q.scales, state.absmax.numpy())
    for out in (jnp.float32, jnp.bfloat16):
        _assert_decoded(q.dequantize(out), _bnb_decoded(packed, state, out), str(out))


def _with(values: dict[int, float], size: int = 202) -> np.ndarray:
    """Normal values (3 full blocks of 64 and a partial one of 10), some replaced."""
    x = np.random.default_rng(1).standard_normal(size).astype(np.float32)
    for index, value in values.items():
        x[index] = value
    return x


_NAN, _INF = float("nan"), float("inf")
# Index 3 is in the first full block, 130 in the third, 197 in the partial block.
_NON_FINITE = {
    "nan in a full block": {3: _NAN},
    "nan in the partial block": {197: _NAN},
    "negative nan in both": {3: -_NAN, 197: -_NAN},
    "inf in a full block": {3: _INF},
    "inf in the partial block": {197: _INF},
    "-inf in both": {3: -_INF, 197: -_INF},
    "inf and nan in one block, float32 max and a subnormal in another": {
        130: _INF,
        131: _NAN,
        3: float(_MAX),
        4: 1e-45,
    },
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", _NON_FINITE, ids=list(_NON_FINITE))
def test_nf4_non_finite_values_are_bitsandbytes(case, dtype):
    # bitsandbytes' rule, which NF4 follows: a block holding a NaN has a NaN scale and codes 15
    # (all decode to NaN); a block holding an infinity has an infinite scale, and its values
    # scale to 0 (code 7, which decodes to NaN) but its infinities to NaN (code 15: +inf).
    x = _as(_with(_NON_FINITE[case]), dtype)
    q = _nf4(jnp.asarray(x, dtype))
    packed, state = _bnb_nf4(x, dtype)
    np.testing.assert_array_equal(np.asarray(q.codes), packed.reshape(-1).numpy())
    _assert_same_floats(q.scales, state.absmax.numpy())
    _assert_decoded(q.dequantize(jnp.float32), _bnb_decoded(packed, state, jnp.float32))
    # In bfloat16, bitsandbytes' CPU kernel rounds the NaN its partial block's scale holds
    # (all bits set) by an integer add that wraps to +0; it decodes NaN in float32, as here.
    nan_blocks = np.repeat(np.isnan(state.absmax.numpy()), 64)[: x.size]
    ours = np.asarray(q.dequantize(jnp.bfloat16).astype(jnp.float32))
    theirs = _bnb_decoded(packed, state, jnp.bfloat16).reshape(-1)
    assert np.isnan(ours[nan_blocks]).all()
    _assert_decoded(ours[~nan_blocks], theirs[~nan_blocks])


_SMALL = {
    "float32 max": (float(_MAX), -1.0),
    "a scale of 1e-38, the clamp": (1e-38, -1e-45),
    "subnormals": (5e-39, -1e-39),
    "zeros": (0.0, -0.0),
    "nan": (_NAN, 1.0),
    "-inf": (-_INF, 0.0),
}


@pytest.mark.parametrize("case", _SMALL, ids=list(_SMALL))
def test_nf4_two_values_in_blocks_of_32_are_bitsandbytes(case):
    # A tensor smaller than a block: one partial block, scaled by a division.
    x = np.array(_SMALL[case], np.float32)
    q = jax.jit(lambda x: quantize(x, blocksize=32))(jnp.asarray(x))
    packed, state = _bnb_nf4(x, jnp.float32, blocksize=32)
    np.testing.assert_array_equal(np.asarray(q.codes), packed.reshape(-1).numpy())
    _assert_same_floats(q.scales, state.absmax.numpy())
    _assert_decoded(q.dequantize(jnp.float32), _bnb_decoded(packed, state, jnp.float32))


def _blocks_scaled_by(scales: np.ndarray) -> np.ndarray:
    """One block of 64 values per scale, its largest magnitude exactly the scale."""
    rng = np.random.default_rng(2)
    x = rng.uniform(-1, 1, (len(scales), 64)).astype(np.float32)
    x[:, 7] = 1.0
    return (x * scales[:, None].astype(np.float32)).astype(np.float32).reshape(-1)


def _multiples(unit: float, count: int = 260) -> np.ndarray:
    """`count` block scales, each 1 to 8 times `unit` (a power of two): a sum of them is exact
    in any order, so that bitsandbytes' mean and ours are the same float32."""
    k = np.random.default_rng(3).integers(1, 9, count)
    return (k * np.float32(unit)).astype(np.float32)


# 260 blocks: a full group of 256 scales and a partial one of 4.
_NESTED = {
    "subnormal scales": _blocks_scaled_by(_multiples(2.0**-140)),
    "scales around 2^-126": _blocks_scaled_by(_multiples(2.0**-128)),
    "one scale near float32 max": _blocks_scaled_by(
        np.concatenate([np.array([1.5 * 2.0**127], np.float32), _multiples(1.0, 259)])
    ),
    "a sum of scales over float32 max": _blocks_scaled_by(_multiples(2.0**124)),
    "zeros": np.zeros(260 * 64, np.float32),
    "nan": _blocks_scaled_by(_multiples(1.0)) * np.where(np.arange(260 * 64) == 100, _NAN, 1),
    "inf": _blocks_scaled_by(_multiples(1.0)) * np.where(np.arange(260 * 64) == 100, _INF, 1),
}


@pytest.mark.parametrize("case", _NESTED, ids=list(_NESTED))
def test_nf4_double_quantisation_extremes_are_bitsandbytes(case):
    x = _NESTED[case].astype(np.float32)
    q = _nf4_nested(jnp.asarray(x))
    packed, state = _bnb_nf4(x, jnp.float32, nested=True)
    nested = q.scale_bits
    assert isinstance(nested, DoubleQuantizedScales)
    # Stored: bitsandbytes' codes, nested codes, nested scales and offset, bit for bit.
    np.testing.assert_array_equal(np.asarray(q.codes), packed.reshape(-1).numpy())
    np.testing.assert_array_equal(np.asarray(nested.codes), state.absmax.numpy())
    _assert_same_floats(np.asarray(nested.absmax_bits).view(np.float32), state.state2.absmax)
    _assert_same_floats(np.asarray(nested.offset_bits).view(np.float32), state.offset)
    # Decoded scales, `dequantize_blockwise(...) + offset`: a product or sum below 2^-126 is
    # flushed on XLA:CPU, which moves a scale by less than 2^-126, and none of 2^-100 or more.
    theirs = (
        bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    ).numpy()
    ours = np.asarray(q.scales)
    large = ~(np.abs(theirs) < 2.0**-100)
    _assert_same_floats(ours[large], theirs[large])
    np.testing.assert_allclose(ours[~large], theirs[~large], rtol=0, atol=2.0**-126)
    decoded = _bnb_decoded(packed, state, jnp.float32).reshape(-1)
    if large.all():
        _assert_decoded(q.dequantize(jnp.float32), decoded)
    else:  # values of at most 2^-100, each off by less than 2^-125
        np.testing.assert_allclose(q.dequantize(jnp.float32), decoded, rtol=0, atol=2.0**-125)


def _dynamic_values(case: str) -> np.ndarray:
    """600 values (two blocks of 256 and a partial one) around 1e-3, with the case's values."""
    values = (np.random.default_rng(4).standard_normal(600) * 1e-3).astype(np.float32)
    if case == "near float32 max":
        values[[0, 1, 2, 3, 300]] = [_MAX, -3e38, 1e38, 1e-45, 1.5 * 2.0**126]
    elif case == "subnormal blocks":
        values = (values * np.float32(1e-36)).astype(np.float32)
    elif case == "reciprocals at the overflow":
        # Largest magnitudes 2^-128 (1 / it overflows: inf, so a 0 scales to NaN) and the
        # subnormal above it (1 / it is finite: a 0 scales to 0).
        values[:512] = 0
        values[[0, 1, 256, 257]] = [2.0**-128, -(2.0**-130), 2.0**-128 + 2.0**-149, -(2.0**-129)]
    elif case == "least subnormals":
        values[:256] = 0
        values[[0, 1]] = [1e-45, -1e-45]
    elif case == "nan, passed over":
        values[[0, 1, 300]] = [_NAN, -_NAN, _NAN]
    elif case == "all nan":
        values[:256] = _NAN
    elif case == "infinities":
        values[[0, 1, 2, 3, 300]] = [_INF, -_INF, 1.0, _NAN, -_INF]
    return values


_DYNAMIC = [
    "near float32 max",
    "subnormal blocks",
    "reciprocals at the overflow",
    "least subnormals",
    "nan, passed over",
    "all nan",
    "infinities",
]


@pytest.mark.parametrize("case", _DYNAMIC)
def test_dynamic_map_extremes_are_bitsandbytes(case):
    values = _dynamic_values(case)
    codes, absmax = jax.jit(dynamic8_encode, static_argnums=1)(jnp.asarray(values), 256)
    theirs, state = bnb_functional.quantize_blockwise(torch.from_numpy(values), blocksize=256)
    np.testing.assert_array_equal(np.asarray(codes), theirs.numpy())
    _assert_same_floats(absmax, state.absmax.numpy())
    decoded = bnb_functional.dequantize_blockwise(theirs, state).numpy()
    ours = jax.jit(dynamic8_decode, static_argnums=2)(codes, absmax, 256)
    _assert_decoded(ours, decoded)


def _int8_reference(x: np.ndarray):
    """int8 in NumPy: per-row absmax * float32(1/127) (1 for a zero row), round half to even."""
    absmax = np.abs(x).max(axis=1)
    scales = np.where(absmax > 0, absmax * np.float32(1 / 127), np.float32(1)).astype(np.float32)
    codes = np.clip(np.rint(x / scales[:, None]), -127, 127).astype(np.int8)
    return codes, scales


def test_int8_rows_at_the_ends_of_float32_are_numpy():
    # Rows whose scale (absmax / 127) is a subnormal: below 127 * 2^-126, about 1.5e-36; 200 of
    # them, with scales from 2^-148 to 2^-127, rounded to fewer bits than a normal product.
    boundary = 127 * 2.0**-126
    below = float(np.nextafter(np.float32(boundary), np.float32(0)))
    tiny = _scales_of(np.random.default_rng(5), -141 + np.arange(200) % 21)
    # And rows whose scale is near 2^62, where values reach 127 times it.
    absmax = [0, 1e-42, 5e-39, 1e-37, boundary, below, 1.0, 2.0**66, 2.0**68.9, _MAX]
    absmax = np.concatenate([np.array(absmax, np.float32), tiny])
    x = np.random.default_rng(5).uniform(-1, 1, (len(absmax), 96)).astype(np.float32)
    x[:, 0] = 1.0
    x = (x * absmax[:, None]).astype(np.float32)
    q = jax.jit(lambda x: quantize(x, "int8"))(jnp.asarray(x))
    codes, scales = _int8_reference(x)
    np.testing.assert_array_equal(np.asarray(q.codes), codes)
    _assert_same_floats(q.scales, scales)
    decoded = (codes.astype(np.float32) * scales[:, None]).astype(np.float32)
    _assert_decoded(q.dequantize(jnp.float32), decoded)
