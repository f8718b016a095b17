"""`eqx_lean.nn.positionwise` and the decoder's chunked MLP: the same values as the function on
the whole sequence (the oracle), in the forward pass and the gradient, with and without
padding, on Explicit mesh axes; a chunk's intermediates only, measured by XLA's plan; and every
bad argument refused by name."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import MICRO_DECODER, mesh_of
from jax.sharding import NamedSharding, PartitionSpec as P

from eqx_lean import hf
from eqx_lean.internal import chunk_positions, mlp_chunk
from eqx_lean.nn import positionwise


HIDDEN, WIDE = 8, 32


def _weights() -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(0))
    return (
        jax.random.normal(k1, (HIDDEN, WIDE)) / 3,
        jax.random.normal(k2, (WIDE, HIDDEN)) / 6,
    )


def _mlp(w: tuple[jax.Array, jax.Array], x: jax.Array) -> jax.Array:
    return jax.nn.silu(x @ w[0]) @ w[1]


def _x(batch: int = 2, seq: int = 24) -> jax.Array:
    return jax.random.normal(jax.random.key(1), (batch, seq, HIDDEN))


@pytest.mark.parametrize("chunk", [8, 7, 24, 100])
def test_values_and_gradients_equal_the_whole_sequence(chunk):
    # 8 divides 24 (three chunks); 7 does not (four chunks, the last padded); 24 and 100 are
    # one chunk, `fn` on the whole input.
    w, x = _weights(), _x()

    def chunked(w, x):
        return positionwise(lambda h, key: _mlp(w, h), x, chunk=chunk)

    def loss(f, w, x):
        return jnp.sum(jnp.sin(f(w, x)))

    np.testing.assert_allclose(jax.jit(chunked)(w, x), _mlp(w, x), rtol=1e-6, atol=1e-6)
    got = jax.jit(jax.grad(lambda w, x: loss(chunked, w, x), argnums=(0, 1)))(w, x)
    want = jax.grad(lambda w, x: loss(_mlp, w, x), argnums=(0, 1))(w, x)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_each_chunk_draws_its_own_key():
    x, key = jnp.zeros((1, 12, 2)), jax.random.key(5)

    def noise(h, key):
        return h + jax.random.normal(key, h.shape)

    got = positionwise(noise, x, chunk=4, key=key)
    for i in range(3):
        want = jax.random.normal(jax.random.fold_in(key, i), (1, 4, 2))
        np.testing.assert_array_equal(got[:, 4 * i : 4 * i + 4], want)
    # Without a key, `fn` gets `key=None`.
    seen = []
    positionwise(lambda h, key: seen.append(key) or h, x, chunk=4)
    assert seen and all(k is None for k in seen)


def test_gradient_holds_one_chunk_of_intermediates():
    # A [1, 4096, 4096] float32 intermediate is 64 MiB; in chunks of 256 positions, 4 MiB.
    w1 = jnp.zeros((64, 4096))
    w2 = jnp.zeros((4096, 64))
    x = jax.ShapeDtypeStruct((1, 4096, 64), jnp.float32)

    def grad_temp(chunk: int | None) -> int:
        def loss(w, x):
            def f(h, key):
                return _mlp(w, h)

            y = f(x, None) if chunk is None else positionwise(f, x, chunk=chunk)
            return jnp.sum(y)

        analysis = jax.jit(jax.grad(loss)).lower((w1, w2), x).compile().memory_analysis()
        assert analysis is not None
        return analysis.temp_size_in_bytes

    # The backward holds a few copies of the intermediate (pre-activation, activation, their
    # cotangents): five of 64 MiB whole, five of one chunk's 4 MiB (a sixteenth) chunked, and
    # the input-sized buffers (1 MiB each) beside them.
    whole, chunked = grad_temp(None), grad_temp(256)
    assert whole >= 4 * 64 * 2**20, whole
    assert chunked <= whole / 16 + 2 * 2**20, (whole, chunked)


@pytest.mark.cpu_mesh
def test_rows_sharded_over_explicit_axes():
    mesh = mesh_of((4,), ("data",))
    w = _weights()
    x = jax.device_put(_x(batch=4, seq=20), NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda x: positionwise(lambda h, key: _mlp(w, h), x, chunk=6))(x)
    assert got.sharding.spec[0] == "data"
    np.testing.assert_allclose(got, _mlp(w, jnp.asarray(np.asarray(x))), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(chunk=0), ValueError, "`chunk`"),
        (dict(chunk=True), TypeError, "`chunk`"),
        (dict(chunk=2.0), TypeError, "`chunk`"),
        (dict(fn=3), TypeError, "`fn` must be callable"),
        (dict(x=jnp.zeros((4, 8))), ValueError, "`x` must be an array of shape [batch, seq"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, error, words):
    arguments = dict(fn=lambda h, key: h, x=_x(), chunk=4) | kwargs
    with pytest.raises(error, match=words.replace("[", r"\[")):
        positionwise(arguments.pop("fn"), arguments.pop("x"), **arguments)


CONFIG = hf.DecoderConfig(**MICRO_DECODER)


@pytest.fixture(scope="module")
def model():
    return hf.init(CONFIG, key=jax.random.key(0), norm_std=0.1)


def test_decoder_mlp_in_chunks_equals_the_whole_sequence(model):
    # MICRO_DECODER's MLP widens 16 to 24 float32: 2 x 24 x 4 = 192 bytes a position for two
    # rows. 1,000 bytes is 5 positions a chunk: 23 positions (prime) in five chunks, the last
    # padded by two.
    ids = jax.random.randint(jax.random.key(1), (2, 23), 0, CONFIG.vocab_size)

    @eqx.filter_jit
    def run(model, chunk_bytes):
        loss, grads = eqx.filter_value_and_grad(hf.next_token_loss)(
            model, ids, mlp_chunk_bytes=chunk_bytes
        )
        return loss, grads, model(ids, mlp_chunk_bytes=chunk_bytes)

    whole, chunked = run(model, None), run(model, 1000)
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-6)
    np.testing.assert_allclose(chunked[2], whole[2], atol=1e-6)
    for g, e in zip(jax.tree.leaves(chunked[1]), jax.tree.leaves(whole[1]), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7)


def test_decoder_chunks_only_what_exceeds_the_budget(model):
    x = jnp.zeros((2, 21, CONFIG.hidden_size), jnp.float32)
    assert mlp_chunk(CONFIG, x, None) is None  # 8 KiB: one chunk
    assert mlp_chunk(CONFIG, x, 1000) == 3  # 5 positions fit; 3 divides 21
    assert mlp_chunk(CONFIG, x, 192 * 7) == 7
    ids = jnp.zeros((2, 21), jnp.int32)
    for bad, error in ((0, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="`mlp_chunk_bytes`"):
            model(ids, mlp_chunk_bytes=bad)


def test_chunk_positions_prefers_divisors_and_spreads_the_rest():
    assert chunk_positions(131_072, 28_672, 256 * 2**20) == 8192  # an 8B's MLP: 16 chunks
    assert chunk_positions(100, 1, 30) == 25  # a divisor within half of 30
    assert chunk_positions(97, 1, 30) == 25  # 97 is prime: 4 chunks of 25, 3 padded
    assert chunk_positions(10, 1, 1000) == 10
    assert chunk_positions(10, 5000, 1000) == 1


def test_long_sequence_plan_is_linear_not_widened():
    # The 1 x 4,096-token MLP of a decoder with a wide intermediate, planned (compile only):
    # chunked, its gradient's temporaries stay within a fraction of the unchunked ones.
    config = dataclasses.replace(CONFIG, intermediate_size=2048, num_hidden_layers=1)
    model = eqx.filter_eval_shape(lambda: hf.init(config, key=jax.random.key(0)))
    ids = jax.ShapeDtypeStruct((1, 4096), jnp.int32)

    def temp(chunk_bytes):
        grad = jax.jit(
            lambda m, ids: eqx.filter_grad(hf.next_token_loss)(m, ids, mlp_chunk_bytes=chunk_bytes)
        )
        analysis = grad.lower(model, ids).compile().memory_analysis()
        assert analysis is not None
        return analysis.temp_size_in_bytes

    whole, chunked = temp(2**40), temp(2**20)
    # The intermediate is 32 MiB unchunked (4,096 x 2,048 float32), 1 MiB a chunk.
    assert whole >= 64 * 2**20, whole
    assert chunked <= whole / 3, (whole, chunked)
