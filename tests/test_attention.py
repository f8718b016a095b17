"""`eqx_lean.nn.attention` against a plain reference: every score materialised in float32, the
keys and values gathered per query head, `jax.nn.softmax`, differentiated by JAX itself; XLA's
plan of its gradient, which must not hold `[heads, seq, seq]` scores; and the decoder, whose
blockwise default must equal its eager reference.
"""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import mesh_of, pinned_to_cpu
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from eqx_lean import hf, lora
from eqx_lean.internal import platform_tricks
from eqx_lean.nn import attention


MiB = 2**20


def reference(q, k, v, *, causal=True, window=None, segment_ids=None, scale=None, cap=None):
    """Attention with every score held, in float32: query head `h` reads key/value head
    `h // groups` (gathered, as HF's `repeat_kv` lays them out)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    batch, seq, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    which = jnp.arange(heads) // groups
    k, v = k[:, :, which], v[:, :, which]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (head_dim**-0.5 if scale is None else scale)
    if cap is not None:
        s = jnp.tanh(s / cap) * cap
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    mask = np.ones((seq, seq), bool)
    if causal:
        mask &= j <= i
    if window is not None:
        mask &= i - j < window
    mask = jnp.asarray(mask)[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    s = jnp.where(mask, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


@functools.partial(jax.jit, static_argnames=("batch", "seq", "heads", "kv_heads", "dim", "dtype"))
def inputs(batch=2, seq=300, heads=4, kv_heads=2, dim=16, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(k[0], (batch, seq, heads, dim), dtype)
    kk = jax.random.normal(k[1], (batch, seq, kv_heads, dim), dtype)
    v = jax.random.normal(k[2], (batch, seq, kv_heads, dim), dtype)
    cotangent = jax.random.normal(k[3], (batch, seq, heads, dim), jnp.float32)
    # Packed rows: documents of varying lengths, ids increasing along each row.
    segments = jnp.cumsum(jax.random.bernoulli(k[4], 0.01, (batch, seq)), axis=1, dtype=jnp.int32)
    return q, kk, v, cotangent, segments


def relative_to_largest(got, expected) -> float:
    got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
    return float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))


def both(options, blocks):
    """One compiled program: the outputs and the q, k, v gradients of a weighted sum of each
    output, blockwise and reference."""
    ref_options = dict(options)
    if "logit_soft_cap" in ref_options:
        ref_options["cap"] = ref_options.pop("logit_soft_cap")

    @jax.jit
    def run(q, k, v, cotangent, segments):
        seg = {"segment_ids": segments} if options.get("segment_ids") else {}
        ours = {**options, **seg, "block_q": blocks[0], "block_k": blocks[1]}
        theirs = {**ref_options, **seg}

        got, got_vjp = jax.vjp(lambda q, k, v: attention(q, k, v, **ours), q, k, v)
        want, want_vjp = jax.vjp(lambda q, k, v: reference(q, k, v, **theirs), q, k, v)
        got_grads = got_vjp(cotangent.astype(got.dtype))
        want_grads = want_vjp(cotangent)
        return got, want, got_grads, want_grads

    return run


CASES = {
    # name: (options, (block_q, block_k), seq, heads, kv_heads)
    "causal": ({}, (128, 96), 1024, 4, 4),
    "window": ({"window": 100}, (64, 80), 1024, 4, 2),
    "grouped-query, scaled": ({"scale": 0.5}, (None, None), 300, 8, 2),
    "soft-capped": ({"logit_soft_cap": 2.0, "scale": 0.7}, (64, 40), 300, 4, 2),
    "packed": ({"segment_ids": True}, (64, 40), 1024, 4, 2),
    "packed, windowed, capped": (
        {"segment_ids": True, "window": 37, "logit_soft_cap": 5.0},
        (32, 48),
        300,
        4,
        1,
    ),
    "not causal, packed": ({"causal": False, "segment_ids": True}, (64, 40), 300, 4, 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_equals_the_materialised_reference(name):
    """Forward within 1e-6 of the reference's largest magnitude, the q, k and v gradients
    within 1e-5 of theirs, with blocks that do not divide the sequence."""
    options, blocks, seq, heads, kv_heads = CASES[name]
    q, k, v, cotangent, segments = inputs(seq=seq, heads=heads, kv_heads=kv_heads)
    got, want, got_grads, want_grads = both(options, blocks)(q, k, v, cotangent, segments)
    assert relative_to_largest(got, want) <= 1e-6
    for g, w in zip(got_grads, want_grads, strict=True):
        assert relative_to_largest(g, w) <= 1e-5


def test_bfloat16_inputs_accumulate_in_float32():
    """bfloat16 in and out, float32 inside: within bfloat16's rounding of the float32
    reference on the same (bfloat16) inputs, and closer to it than bfloat16 scores would be."""
    q, k, v, cotangent, segments = inputs(seq=512, dtype=jnp.bfloat16)
    got, want, got_grads, want_grads = both({"window": 200}, (64, 64))(q, k, v, cotangent, segments)
    assert got.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in got_grads)
    assert relative_to_largest(got, want) <= 8e-3
    for g, w in zip(got_grads, want_grads, strict=True):
        assert relative_to_largest(g, w) <= 2e-2


def test_blocks_outside_the_window_are_skipped_not_masked():
    """Values that no query of a block can see are never read: NaN there (which a masked
    product, `0 * NaN`, would spread) leaves the outputs and gradients of every query that
    cannot see them finite, including with a traced window."""
    q, k, v, cotangent, _ = inputs(batch=1, seq=64, heads=2, kv_heads=1)

    @jax.jit
    def run(q, k, v, window):
        v = v.at[:, :8].set(jnp.nan)  # key block 0; queries from 16 on never see it

        def f(q, k, v):
            out = attention(q, k, v, window=window, block_q=8, block_k=8)
            return jnp.sum(out[:, 16:] * cotangent[:, 16:]), out

        return jax.grad(f, (0, 1), has_aux=True)(q, k, v)

    (dq, dk), out = run(q, k, v, jnp.int32(8))
    assert np.isnan(np.asarray(out[:, :8])).all()
    assert np.isfinite(np.asarray(out[:, 16:])).all()
    # (Queries 8-15 see both blocks, so the keys of block 1 get NaN from them: not asserted.)
    assert np.isfinite(np.asarray(dq[:, 16:])).all() and np.isfinite(np.asarray(dk[:, 16:])).all()


def test_a_traced_window_equals_a_static_one():
    q, k, v, _, _ = inputs(seq=200)

    @jax.jit
    def run(q, k, v, windows):
        # A window beyond the sequence too: the decoder's "full attention" layers (int32's
        # largest), traced in the same layer scan as its windowed ones.
        def one(_, w):
            return None, attention(q, k, v, window=w, block_q=32, block_k=24)

        traced = lax.scan(one, None, windows)[1]
        return traced, reference(q, k, v, window=50), reference(q, k, v)

    traced, windowed, full = run(q, k, v, jnp.asarray([50, 2**31 - 1], jnp.int32))
    assert relative_to_largest(traced[0], windowed) <= 1e-6
    assert relative_to_largest(traced[1], full) <= 1e-6


def test_the_gradient_never_holds_the_scores():
    """XLA:CPU's plan (compile only) at 1 x 8,192 tokens, 8 heads of 32 over 2 key/value
    heads, where one float32 `[heads, seq, seq]` copy of the scores is 2 GiB: the gradient's
    temporaries stay under 64 MiB (the inputs are 12 MiB)."""
    seq = 8192
    shapes = (
        jax.ShapeDtypeStruct((1, seq, 8, 32), jnp.float32),
        jax.ShapeDtypeStruct((1, seq, 2, 32), jnp.float32),
        jax.ShapeDtypeStruct((1, seq, 2, 32), jnp.float32),
    )
    grad = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, window=4096)), (0, 1, 2))
    analysis = jax.jit(grad).lower(*shapes).compile().memory_analysis()
    assert analysis is not None
    assert analysis.temp_size_in_bytes <= 64 * MiB


def test_the_narrow_decoders_adapter_gradient_at_16k_tokens():
    """Issue 43's bar, XLA:CPU's plan (compile only, CPU choices): the adapter gradient of the
    fused `next_token_loss` (`remat=True`) of a narrow Llama-3-shaped decoder (hidden 256,
    intermediate 896, 2 layers, 4 heads over 2, vocab 128,256, float32, LoRA rank 16 on all
    seven projections) at 1 x 16,384 tokens holds at most 512 MiB of temporaries (361 MiB
    measured; 659 with 32 MiB MLP chunks and the norms' residuals kept, 17,787 with eager
    attention: `docs/benchmarks.md`)."""
    config = hf.DecoderConfig(
        vocab_size=128_256,
        hidden_size=256,
        intermediate_size=896,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500_000.0,
        sliding_window=None,
        model_type="llama",
        dtype="float32",
    )
    seven = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lora_config = lora.LoraConfig(r=16, lora_alpha=32, target_modules=seven)
    model = jax.eval_shape(
        lambda: lora.add_lora(
            hf.init(config, key=jax.random.key(0)), lora_config, key=jax.random.key(1)
        )
    )
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))

    def loss_of(adapters, frozen, ids):
        return hf.next_token_loss(eqx.combine(adapters, frozen), ids, remat=True)

    ids = jax.ShapeDtypeStruct((1, 16_384), jnp.int32)
    with pinned_to_cpu(), platform_tricks.tracing_for("cpu"):
        compiled = jax.jit(jax.grad(loss_of)).lower(adapters, frozen, ids).compile()
    analysis = compiled.memory_analysis()
    assert analysis is not None
    assert analysis.temp_size_in_bytes <= 512 * MiB, analysis.temp_size_in_bytes / MiB


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_a_sharded_batch_gives_the_unsharded_values(axis_type):
    q, k, v, cotangent, segments = inputs(batch=4, seq=96)
    mesh = mesh_of((2,), ("data",), axis_type)

    @jax.jit
    def f(q, k, v, segments):
        def loss(q, k, v):
            out = attention(q, k, v, window=40, segment_ids=segments, block_q=32, block_k=32)
            return jnp.sum(out * cotangent)

        return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)

    expected = f(q, k, v, segments)
    placed = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v, segments)]
    with jax.set_mesh(mesh):
        value, grads = f(*placed)
    np.testing.assert_allclose(float(value), float(expected[0]), rtol=1e-6)
    for got, want in zip(grads, expected[1], strict=True):
        assert relative_to_largest(got, want) <= 1e-6


def test_arguments_are_checked():
    def shaped(*shape, dtype=jnp.float32) -> Any:
        return jax.ShapeDtypeStruct(shape, dtype)

    q, k, v = shaped(2, 16, 4, 8), shaped(2, 16, 2, 8), shaped(2, 16, 2, 8)
    with pytest.raises(ValueError, match="multiple of `k`'s"):
        attention(shaped(2, 16, 3, 8), k, v)
    with pytest.raises(ValueError, match="batch, sequence and head size"):
        attention(q, shaped(2, 8, 2, 8), shaped(2, 8, 2, 8))
    with pytest.raises(TypeError, match="one floating dtype"):
        attention(
            q, shaped(2, 16, 2, 8, dtype=jnp.bfloat16), shaped(2, 16, 2, 8, dtype=jnp.bfloat16)
        )
    with pytest.raises(ValueError, match="`window` needs `causal=True`"):
        attention(q, k, v, causal=False, window=4)
    with pytest.raises(ValueError, match="`window` must be an integer of at least 1"):
        attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="`segment_ids` must be None or integers"):
        attention(q, k, v, segment_ids=shaped(2, 8, dtype=jnp.int32))
    with pytest.raises(ValueError, match="`logit_soft_cap` must be a finite number above 0"):
        attention(q, k, v, logit_soft_cap=0.0)
    with pytest.raises(TypeError, match="`block_q` must be None or an integer"):
        attention(q, k, v, block_q=True)


def test_the_decoder_refuses_an_unknown_attention():
    """The decoder's blockwise default is checked against transformers by the families' parity
    tests (windows shorter than their sequences, Qwen2's per-layer windows traced in the layer
    scan); `attention="eager"` is its reference. A name it does not know is refused before
    anything is traced."""
    model = jax.eval_shape(lambda: hf.init(hf.DecoderConfig.tiny(), key=jax.random.key(0)))
    ids: Any = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    with pytest.raises(ValueError, match='`attention` must be "blockwise" or "eager"'):
        model(ids, attention="flash")
    with pytest.raises(ValueError, match='`attention` must be "blockwise" or "eager"'):
        hf.next_token_loss(model, ids, attention="flash")
