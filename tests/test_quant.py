"""`eqx_lean.quant`: NF4 bit for bit against bitsandbytes 0.50.2 on CPU, int8 against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_lean
from eqx_lean.internal import DYNAMIC8, NF4
from eqx_lean.quant import QuantizedArray, quantize


torch = pytest.importorskip("torch")
bnb_functional = pytest.importorskip("bitsandbytes.functional")

_TORCH_DTYPES = {jnp.float32: torch.float32, jnp.bfloat16: torch.bfloat16}


def _bnb_nf4(x: np.ndarray, dtype, blocksize: int):
    """bitsandbytes' packed codes and block scales of `x` (given as float32 values)."""
    t = torch.from_numpy(np.array(x, np.float32)).to(_TORCH_DTYPES[dtype])
    packed, state = bnb_functional.quantize_4bit(t, blocksize=blocksize, quant_type="nf4")
    return packed.reshape(-1).numpy(), state.absmax.numpy(), state


def _values(shape, seed, dtype):
    """Normal values, with blocks of exact zeros and of ties on NF4's midpoints mixed in."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[: min(64, flat.size)] = 0.0  # an all-zero block: absmax 0
    midpoints = (NF4[:-1] + NF4[1:]) / np.float32(2)
    if flat.size >= 256:  # a block of values on the midpoints (absmax 1): the ties
        flat[128:143] = midpoints
        flat[143] = 1.0
    return np.array(jnp.asarray(x, dtype).astype(jnp.float32))


def test_codebooks_are_bitsandbytes():
    nf4 = bnb_functional.get_4bit_type("nf4", device="cpu").numpy().astype(np.float32)
    dynamic = bnb_functional.create_dynamic_map(signed=True).numpy().astype(np.float32)
    np.testing.assert_array_equal(NF4.view(np.uint32), nf4.view(np.uint32))
    np.testing.assert_array_equal(DYNAMIC8.view(np.uint32), dynamic.view(np.uint32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    ("shape", "blocksize"),
    [
        ((256, 512), 64),  # full blocks only
        ((96, 200), 64),  # 19200 values: full blocks
        ((37, 55), 64),  # 2035 values: a last partial block, an odd count
        ((3, 1000), 128),
        ((4, 7), 64),  # one partial block
    ],
)
def test_nf4_codes_and_scales_are_bitsandbytes(shape, blocksize, dtype):
    x = _values(shape, seed=sum(shape), dtype=dtype)
    q = quantize(jnp.asarray(x, dtype), blocksize=blocksize)
    codes, absmax, state = _bnb_nf4(x, dtype, blocksize)
    np.testing.assert_array_equal(np.asarray(q.codes), codes)
    np.testing.assert_array_equal(
        np.asarray(q.scales).view(np.uint32), absmax.astype(np.float32).view(np.uint32)
    )
    assert (q.tensor_shape, q.blocksize, q.scheme, q.dtype) == (shape, blocksize, "nf4", dtype)
    assert q.shape == shape and q.ndim == len(shape) and not q.double_quantized
    # Decoded: bitsandbytes' dequantize_4bit, bit for bit, in float32 and bfloat16.
    for out in (jnp.float32, jnp.bfloat16):
        state.dtype = _TORCH_DTYPES[out]  # the dtype bitsandbytes decodes to
        theirs = bnb_functional.dequantize_4bit(
            torch.from_numpy(codes).reshape(-1, 1), state, quant_type="nf4"
        )
        assert theirs.dtype == _TORCH_DTYPES[out]
        ours = np.asarray(q.dequantize(out).astype(jnp.float32))
        np.testing.assert_array_equal(ours, theirs.float().numpy(), err_msg=str(out))


def test_nf4_ties_take_the_lower_code():
    # Values exactly on a midpoint of the table (within a block whose absmax is 1).
    midpoints = (NF4[:-1] + NF4[1:]) / np.float32(2)
    x = np.zeros(64, np.float32)
    x[:15], x[15] = midpoints, 1.0
    q = quantize(jnp.asarray(x))
    codes = np.stack([np.asarray(q.codes) >> 4, np.asarray(q.codes) & 15], -1).reshape(-1)
    np.testing.assert_array_equal(codes[:15], np.arange(15))  # bin i's upper edge: code i
    np.testing.assert_array_equal(_bnb_nf4(x, jnp.float32, 64)[0], np.asarray(q.codes))


def test_nf4_stack_quantises_each_layer_on_its_own():
    # 48 x 41 = 30 full blocks and a partial one (the division path, under vmap).
    x = np.stack([_values((48, 41), seed=i, dtype=jnp.bfloat16) for i in range(3)])
    stack = quantize(jnp.asarray(x, jnp.bfloat16), batch_dims=1)
    assert stack.batch_shape == (3,) and stack.shape == (3, 48, 41)
    for i in range(3):
        codes, absmax, _ = _bnb_nf4(x[i], jnp.bfloat16, 64)
        np.testing.assert_array_equal(np.asarray(stack.codes[i]), codes)
        np.testing.assert_array_equal(np.asarray(stack.scales[i]), absmax)
    # A layer taken out of the stack (as `fold` slices it) is that layer's QuantizedArray.
    layer = jax.tree.map(lambda a: a[1], stack)
    np.testing.assert_array_equal(
        np.asarray(layer.dequantize(jnp.float32)),
        np.asarray(quantize(jnp.asarray(x[1], jnp.bfloat16)).dequantize(jnp.float32)),
    )
    # And it passes through jit as a pytree.
    jitted = jax.jit(lambda q: q.dequantize(jnp.bfloat16))(stack)
    assert jitted.shape == (3, 48, 41) and jitted.dtype == jnp.bfloat16


def test_nf4_bytes():
    q = quantize(jnp.ones((1024, 4096), jnp.bfloat16))
    # 4 bits per value and one float32 per 64 values: 4.5 bits per value.
    assert q.nbytes == 1024 * 4096 // 2 + 1024 * 4096 // 64 * 4


def _int8_reference(x: np.ndarray):
    """The scheme in NumPy: per-row absmax * float32(1/127), round half to even, clip."""
    rows = x.reshape(x.shape[0], -1).astype(np.float32)
    absmax = np.abs(rows).max(axis=1)
    scales = np.where(absmax > 0, absmax * np.float32(1 / 127), np.float32(1)).astype(np.float32)
    codes = np.clip(np.rint(rows / scales[:, None]), -127, 127).astype(np.int8)
    return codes.reshape(x.shape), scales


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_int8_matches_a_numpy_reference(dtype):
    x = _values((64, 96), seed=3, dtype=dtype)
    x[5] = 0.0  # a zero channel decodes to zeros
    q = quantize(jnp.asarray(x, dtype), "int8")
    codes, scales = _int8_reference(x)
    np.testing.assert_array_equal(np.asarray(q.codes), codes)
    np.testing.assert_array_equal(np.asarray(q.scales), scales)
    decoded = (codes.astype(np.float32) * scales[:, None]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(q.dequantize(jnp.float32)), decoded)
    assert not np.asarray(q.dequantize(jnp.float32))[5].any()
    # Within half a step of each channel's scale.
    assert np.all(np.abs(decoded - x) <= scales[:, None] / 2 + 1e-7)


def test_quantize_errors():
    with pytest.raises(ValueError, match="scheme must be one of"):
        quantize(jnp.ones((4, 4)), "nf3")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="floating array `x`"):
        quantize(jnp.ones((4, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"`batch_dims` must be an integer from 0 to 2; got 3\."):
        quantize(jnp.ones((4, 4)), batch_dims=3)
    with pytest.raises(ValueError, match=r"`blocksize` must be an integer of at least 1; got 0\."):
        quantize(jnp.ones((4, 4)), blocksize=0)
    with pytest.raises(ValueError, match="int8 needs tensors of at least one axis"):
        quantize(jnp.ones((4,)), "int8", batch_dims=1)


def test_public():
    assert eqx_lean.quant.QuantizedArray is QuantizedArray


def test_divide_exactly_is_one_rounding():
    from eqx_lean.internal import divide_exactly

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1000, 512)).astype(np.float32)
    s = (np.abs(rng.standard_normal(1000)) + 0.1).astype(np.float32)
    exact = x / s[:, None]
    # What XLA makes of a plain division by a broadcast divisor: a reciprocal and a product.
    rewritten = np.asarray(jax.jit(lambda x, s: x / s[:, None])(x, s))
    assert (rewritten != exact).sum() > 1000
    ours = np.asarray(jax.jit(lambda x, s: divide_exactly(x, s[:, None]))(x, s))
    np.testing.assert_array_equal(ours, exact)
    scalar = np.float32(3.7)
    np.testing.assert_array_equal(np.asarray(jax.jit(divide_exactly)(x, scalar)), x / scalar)
    # The barrier is XLA:CPU's workaround only: a GPU lowering is JAX's own division.
    traced = jax.jit(lambda x, s: divide_exactly(x, s[:, None])).trace(x, s)
    assert "optimization_barrier" in traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "optimization_barrier" not in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_nf4_scales_full_blocks_by_a_reciprocal_and_the_last_by_a_division():
    # x * (1 / a) and x / a fall on either side of the midpoint between codes 11 and 12.
    a, x = np.float32(1.779554009437561), np.float32(0.6928027272224426)
    assert x * (np.float32(1) / a) <= (NF4[11] + NF4[12]) / 2 < x / a
    values = np.zeros(66, np.float32)
    values[[0, 1, 64, 65]] = a, x, a, x  # a full block, then a partial block of two
    q = quantize(jnp.asarray(values))
    codes = np.stack([np.asarray(q.codes) >> 4, np.asarray(q.codes) & 15], -1).reshape(-1)
    assert (codes[1], codes[65]) == (11, 12)
    np.testing.assert_array_equal(np.asarray(q.codes), _bnb_nf4(values, jnp.float32, 64)[0])


def _bnb_blockwise(values: np.ndarray):
    """bitsandbytes' 8-bit dynamic-map codes and scales of `values` (blocks of 256, on CPU)."""
    codes, state = bnb_functional.quantize_blockwise(torch.from_numpy(values), blocksize=256)
    return codes.numpy(), state.absmax.numpy()


def _dynamic_map_probes() -> np.ndarray:
    """Scale-like values, plus values a few ulp either side of the edges of bitsandbytes' 65,536
    bins (where its table lookup and a nearest-code search disagree), in blocks led by 1.0."""
    rng = np.random.default_rng(7)
    scales = (np.abs(rng.standard_normal(256 * 64)) * 0.05).astype(np.float32)
    edges = ((np.arange(65535) + 0.5) / 65535 * 2 - 1).astype(np.float32).view(np.int32)
    near = np.concatenate([(edges + d).view(np.float32) for d in (-2, -1, 0, 1, 2)])
    near = near[np.isfinite(near) & (np.abs(near) <= 1)]
    near = np.concatenate([near, np.zeros(-len(near) % 255, np.float32)]).reshape(-1, 255)
    near = np.concatenate([np.ones((len(near), 1), np.float32), near], axis=1).reshape(-1)
    zeros = np.zeros(256, np.float32)  # an all-zero block
    tail = rng.standard_normal(100).astype(np.float32)  # a partial last block
    return np.concatenate([scales - scales.mean(), near, zeros, tail]).astype(np.float32)


def test_dynamic_map_codes_are_bitsandbytes():
    from eqx_lean.internal import dynamic8_decode, dynamic8_encode

    values = _dynamic_map_probes()
    codes, absmax = jax.jit(dynamic8_encode, static_argnums=1)(jnp.asarray(values), 256)
    theirs, their_absmax = _bnb_blockwise(values)
    np.testing.assert_array_equal(np.asarray(absmax), their_absmax)
    np.testing.assert_array_equal(np.asarray(codes), theirs)
    # Not a nearest-code search: that rule differs from bitsandbytes here.
    scaled = values.reshape(-1)[: len(values) // 256 * 256].reshape(-1, 256)
    scaled = scaled * (np.float32(1) / np.maximum(their_absmax[: len(scaled), None], 1e-30))
    nearest = np.abs(scaled.reshape(-1)[:, None] - DYNAMIC8[None, :]).argmin(axis=1)
    assert (nearest != theirs[: nearest.size]).sum() > 50
    # Decoded: bitsandbytes' dequantize_blockwise, bit for bit.
    state = bnb_functional.QuantState(
        absmax=torch.from_numpy(their_absmax),
        code=torch.from_numpy(DYNAMIC8.copy()),
        blocksize=256,
        dtype=torch.float32,
    )
    decoded = bnb_functional.dequantize_blockwise(torch.from_numpy(theirs), state).numpy()
    ours = np.asarray(dynamic8_decode(codes, absmax, 256))
    np.testing.assert_array_equal(ours.view(np.uint32), decoded.view(np.uint32))


@pytest.mark.parametrize("shape", [(512, 512), (37, 55), (4096, 40)])
def test_nf4_double_quantisation_is_bitsandbytes(shape):
    x = _values(shape, seed=5, dtype=jnp.bfloat16)
    t = torch.from_numpy(x).to(torch.bfloat16)
    packed, state = bnb_functional.quantize_4bit(
        t, blocksize=64, quant_type="nf4", compress_statistics=True
    )
    q = quantize(jnp.asarray(x, jnp.bfloat16), double_quant=True)
    assert q.double_quantized
    np.testing.assert_array_equal(np.asarray(q.codes), packed.reshape(-1).numpy())
    nested = q.scale_bits
    assert isinstance(nested, eqx_lean.quant.DoubleQuantizedScales)
    # The offset is a float32 mean: torch sums in another order, so it may differ in the last
    # bits. Given bitsandbytes' offset, the nested codes and scales are bitsandbytes' exactly.
    offset = np.asarray(nested.offset_bits).view(np.float32)
    assert abs(offset - state.offset.numpy()) <= 4 * np.spacing(np.float32(offset))
    single = quantize(jnp.asarray(x, jnp.bfloat16))
    absmax = np.asarray(single.scales)
    their_codes, their_absmax = _bnb_blockwise(absmax - state.offset.numpy())
    np.testing.assert_array_equal(state.absmax.numpy(), their_codes)
    from eqx_lean.internal import dynamic8_encode

    codes, absmax2 = dynamic8_encode(jnp.asarray(absmax - state.offset.numpy()), 256)
    np.testing.assert_array_equal(np.asarray(codes), their_codes)
    np.testing.assert_array_equal(np.asarray(absmax2), state.state2.absmax.numpy())
    # Decoding the stored form is bitsandbytes' dequantize_4bit, bit for bit, from its state.
    from eqx_lean.internal import float32_bits
    from eqx_lean.quant import DoubleQuantizedScales

    theirs = eqx_lean.quant.QuantizedArray(
        jnp.asarray(packed.reshape(-1).numpy()),
        DoubleQuantizedScales(
            jnp.asarray(state.absmax.numpy()),
            float32_bits(jnp.asarray(state.state2.absmax.numpy())),
            float32_bits(jnp.asarray(state.offset.numpy())),
        ),
        shape,
        "nf4",
        64,
        np.dtype(jnp.bfloat16),
    )
    decoded = bnb_functional.dequantize_4bit(packed, state).float().numpy()
    ours = np.asarray(theirs.dequantize(jnp.bfloat16).astype(jnp.float32))  # the state's dtype
    np.testing.assert_array_equal(ours, decoded)
    # And our own stored form decodes close to the single-quantised values.
    # 1 byte a block, 4 per (started) group of 256 blocks and 4 for the offset, against 4.
    blocks = single.scale_bits.shape[-1]
    assert q.scale_bits.nbytes == blocks + 4 * -(-blocks // 256) + 4
    # (A zero block's scale decodes near, not at, zero, as in bitsandbytes: its codes are 0.)
    assert np.abs(np.asarray(q.scales) - absmax).max() < 0.02 * absmax.max()


def test_quantized_array_is_not_an_array():
    q = quantize(jnp.ones((8, 64)), name="layers.mlp.up_proj.weight")
    for use in (lambda: q @ jnp.ones(64), lambda: jnp.ones(8) @ q, lambda: jnp.asarray(q)):
        with pytest.raises(TypeError, match=r"`layers.mlp.up_proj.weight` is a nf4-quantised"):
            use()
    with pytest.raises(TypeError, match="only eqx_lean.quant.QuantizedLinear"):
        _ = q * 2.0
    # No inexact leaf: gradients and optimizers pass it by.
    import equinox as eqx

    assert not any(eqx.is_inexact_array(x) for x in jax.tree.leaves(q))
    nested = quantize(jnp.ones((8, 64)), double_quant=True)
    assert not any(eqx.is_inexact_array(x) for x in jax.tree.leaves(nested))


def test_widen_exactly_reads_the_stored_values():
    from eqx_lean.internal import widen_exactly

    bits = np.arange(2**16, dtype=np.uint16)
    for dtype in (jnp.bfloat16, jnp.float16):
        x = jnp.asarray(bits.view(jnp.dtype(dtype)))
        want = np.asarray(x).astype(np.float32)
        got = np.asarray(jax.jit(widen_exactly)(x))
        finite = np.isfinite(want)
        np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
        assert np.array_equal(np.isnan(got), np.isnan(want)), dtype
