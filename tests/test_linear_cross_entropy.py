"""`eqx_lean.nn.linear_cross_entropy` against a plain reference: materialised float32 logits and
`jax.nn.log_softmax`, differentiated by JAX itself; and XLA's plan of its gradient, which must
not hold the `[tokens, vocab]` logits.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import mesh_of
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from eqx_lean.internal import platform_tricks
from eqx_lean.nn import linear_cross_entropy


MiB = 2**20
STATIC = ("ignore_index", "logit_soft_cap", "chunk_bytes", "reduction")
fused_loss = jax.jit(linear_cross_entropy, static_argnames=STATIC)


def reference(hidden, weight, labels, *, bias=None, cap=None, ignore_index=-100):
    """The textbook loss: every logit in float32, `log_softmax`, the counted targets' mean."""
    logits = jnp.einsum("...h,vh->...v", hidden, weight).astype(jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32).reshape((1,) * (logits.ndim - 1) + (-1,))
    if cap is not None:
        logits = jnp.tanh(logits / cap) * cap
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    counted = labels != ignore_index
    safe = jnp.where(counted, labels, 0)
    picked = jnp.take_along_axis(log_probs, safe[..., None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(counted, picked, 0.0)) / jnp.sum(counted).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("batch", "seq", "hidden", "vocab", "seed"))
def inputs(batch=2, seq=37, hidden=16, vocab=50, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (batch, seq, hidden))
    w = jax.random.normal(k[1], (vocab, hidden))
    b = jax.random.normal(k[2], (vocab,))
    labels = jax.random.randint(k[3], (batch, seq), 0, vocab)
    # Two rows, two masks: a prompt of 10 in the first, of 3 in the second.
    labels = labels.at[0, :10].set(-100).at[1, :3].set(-100)
    return h, w, b, labels


plain_loss = jax.jit(reference)


def relative_to_largest(got, expected) -> float:
    got, expected = np.asarray(got), np.asarray(expected)
    return float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))


# 5 positions a chunk (37 positions: 8 chunks, the last padded), so chunks and padding matter.
CHUNK = 2 * 50 * 4 * 5


@pytest.mark.parametrize("cap", [None, 3.0], ids=["no-cap", "soft-cap"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_loss_and_gradients_equal_the_materialised_reference(cap, with_bias):
    h, w, b, labels = inputs()
    bias = b if with_bias else None
    argnums = (0, 1, 2) if with_bias else (0, 1)

    def fused(h, w, bias):
        return linear_cross_entropy(h, w, labels, bias=bias, logit_soft_cap=cap, chunk_bytes=CHUNK)

    def plain(h, w, bias):
        return reference(h, w, labels, bias=bias, cap=cap)

    with jax.default_matmul_precision("highest"):
        loss, grads = jax.jit(jax.value_and_grad(fused, argnums=argnums))(h, w, bias)
        expected, expected_grads = jax.jit(jax.value_and_grad(plain, argnums=argnums))(h, w, bias)
    assert abs(float(loss) / float(expected) - 1) <= 1e-6
    for got, want in zip(grads, expected_grads, strict=True):
        assert relative_to_largest(got, want) <= 1e-6


def test_a_tied_head_gets_the_gradient_of_both_its_uses():
    """The embedding is also the head: its gradient sums the lookup's and the head's."""
    _, embedding, _, labels = inputs()
    ids = jax.random.randint(jax.random.key(7), labels.shape, 0, embedding.shape[0])

    def fused(embedding):
        return linear_cross_entropy(jnp.tanh(embedding[ids]), embedding, labels, chunk_bytes=CHUNK)

    def plain(embedding):
        return reference(jnp.tanh(embedding[ids]), embedding, labels)

    with jax.default_matmul_precision("highest"):
        loss, grad = jax.jit(jax.value_and_grad(fused))(embedding)
        expected, expected_grad = jax.jit(jax.value_and_grad(plain))(embedding)
    assert abs(float(loss) / float(expected) - 1) <= 1e-6
    assert relative_to_largest(grad, expected_grad) <= 1e-6


def test_the_sum_and_what_no_counted_token_gives():
    h, w, _, labels = inputs()
    fused_sum = fused_loss(h, w, labels, reduction="sum", chunk_bytes=CHUNK)
    counted = float(jnp.sum(labels != -100))
    np.testing.assert_allclose(float(fused_sum), float(plain_loss(h, w, labels)) * counted, 1e-6)
    none = jnp.full_like(labels, -100)
    # As torch's `cross_entropy` (so HF's `ForCausalLMLoss`): the mean of nothing is 0 / 0.
    assert np.isnan(float(fused_loss(h, w, none)))
    assert np.isnan(float(plain_loss(h, w, none)))
    assert float(fused_loss(h, w, none, reduction="sum")) == 0.0
    # Another ignore index; a counted label outside the vocabulary makes the loss NaN.
    shifted = jnp.where(labels == -100, 7, labels)
    other = fused_loss(h, w, jnp.where(labels == -100, -1, labels), ignore_index=-1)
    np.testing.assert_allclose(float(other), float(plain_loss(h, w, labels)), 1e-6)
    assert np.isnan(float(fused_loss(h, w, shifted.at[0, 20].set(50))))


def test_leading_axes_and_a_chunk_of_one_position():
    h, w, _, labels = inputs(batch=2, seq=6)
    h4, labels4 = h.reshape(2, 1, 6, -1), labels.reshape(2, 1, 6)
    got = fused_loss(h4, w, labels4, chunk_bytes=1)
    np.testing.assert_allclose(float(got), float(plain_loss(h, w, labels)), 1e-6)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.cpu_mesh
def test_sharded_batch_and_head_give_the_unsharded_values(axis_type):
    h, w, b, labels = inputs(batch=4)
    mesh = mesh_of((2, 2), ("data", "fsdp"), axis_type)
    f = jax.jit(
        jax.value_and_grad(
            lambda h, w, b, labels: linear_cross_entropy(h, w, labels, bias=b, chunk_bytes=CHUNK),
            argnums=(0, 1, 2),
        )
    )
    expected = f(h, w, b, labels)
    for head in (P("fsdp"), P("data")):
        placed = [
            jax.device_put(h, NamedSharding(mesh, P("data"))),
            jax.device_put(w, NamedSharding(mesh, head)),
            jax.device_put(b, NamedSharding(mesh, head)),
            jax.device_put(labels, NamedSharding(mesh, P("data"))),
        ]
        with jax.set_mesh(mesh):
            loss, grads = f(*placed)
        np.testing.assert_allclose(float(loss), float(expected[0]), 1e-6)
        for got, want in zip(grads, expected[1], strict=True):
            assert relative_to_largest(got, want) <= 1e-6


def _temp_bytes(f, *shapes) -> int:
    analysis = jax.jit(f).lower(*shapes).compile().memory_analysis()
    assert analysis is not None
    return analysis.temp_size_in_bytes


@pytest.mark.quick
def test_the_gradient_never_holds_the_logits():
    """XLA:CPU's plan (compile only) of the gradient with respect to the hidden states and the
    head at 16,384 tokens x hidden 256 x vocab 128,256, where float32 logits alone are 8 GiB:
    at most 256 MiB of temporaries (measured 223 MiB with the default 64 MiB chunks)."""
    tokens, hidden, vocab = 16_384, 256, 128_256
    shapes = (
        jax.ShapeDtypeStruct((1, tokens, hidden), jnp.float32),
        jax.ShapeDtypeStruct((vocab, hidden), jnp.float32),
        jax.ShapeDtypeStruct((1, tokens), jnp.int32),
    )
    both = jax.grad(lambda h, w, labels: linear_cross_entropy(h, w, labels), argnums=(0, 1))
    assert _temp_bytes(both, *shapes) <= 256 * MiB
    hidden_only = jax.grad(lambda h, w, labels: linear_cross_entropy(h, w, labels))
    assert _temp_bytes(hidden_only, *shapes) <= 192 * MiB


def test_temporaries_follow_the_chunk_not_the_logits():
    """Where the reference's plan holds the float32 logits (XLA fuses the rest into one
    copy), the fused loss holds a few chunks' (small, compiled in a fraction of a second)."""
    tokens, hidden, vocab = 4096, 64, 8192
    logits = tokens * vocab * 4  # 128 MiB
    shapes = (
        jax.ShapeDtypeStruct((1, tokens, hidden), jnp.float32),
        jax.ShapeDtypeStruct((vocab, hidden), jnp.float32),
        jax.ShapeDtypeStruct((1, tokens), jnp.int32),
    )

    def fused(h, w, labels):
        return linear_cross_entropy(h, w, labels, chunk_bytes=4 * MiB)

    assert _temp_bytes(jax.grad(reference), *shapes) >= logits
    assert _temp_bytes(jax.grad(fused), *shapes) <= logits // 8


def _scan_lengths(jaxpr):
    """The `length` of every `scan` in a (closed) jaxpr, its sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    lengths = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            lengths.append(eqn.params["length"])
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    lengths += _scan_lengths(sub)
    return lengths


@pytest.mark.parametrize(("platform", "chunk_mib"), [("cpu", 64), ("tpu", 64), ("gpu", 256)])
def test_the_default_chunk_is_the_platforms(monkeypatch, platform, chunk_mib):
    """`chunk_bytes=None` takes the platform's size from `eqx_lean._platform` (the lookup is
    forced here): 256 MiB on a GPU (measured on one H200), 64 MiB on a CPU and a TPU. Seen in
    the traced program (nothing compiles): the loss's scan runs `logits / chunk` chunks."""
    seen = []

    def forced(shardings):
        seen.append(list(shardings))
        return platform

    monkeypatch.setattr(platform_tricks, "platform_of", forced)
    seq, vocab = 65_536, 1024  # 256 MiB of float32 logits, 4 KiB a position
    shapes = (
        jax.ShapeDtypeStruct((1, seq, 2), jnp.float32),
        jax.ShapeDtypeStruct((vocab, 2), jnp.float32),
        jax.ShapeDtypeStruct((1, seq), jnp.int32),
    )
    # A new function each time: JAX caches the traces of one.
    jaxpr = jax.make_jaxpr(lambda *args: linear_cross_entropy(*args))(*shapes)
    assert _scan_lengths(jaxpr) == [256 // chunk_mib]
    assert seen == [[]]  # inside a trace: JAX's default backend's platform
    # An explicit `chunk_bytes` is kept whatever the platform.
    jaxpr = jax.make_jaxpr(lambda *args: linear_cross_entropy(*args, chunk_bytes=32 * MiB))(*shapes)
    assert _scan_lengths(jaxpr) == [8]


def test_a_placed_array_asks_for_its_own_platform(monkeypatch):
    """Outside a trace the platform is that of the hidden states' devices."""
    seen = []

    def recorded(shardings):
        seen.append(list(shardings))
        return "cpu"

    monkeypatch.setattr(platform_tricks, "platform_of", recorded)
    h, w, _, labels = inputs()
    linear_cross_entropy(h, w, labels)
    assert seen == [[h.sharding]]


def test_arguments_are_checked_naming_them():
    h, w, b, labels = inputs()
    with pytest.raises(ValueError, match="`labels` must have"):
        linear_cross_entropy(h, w, labels[:, :-1])
    with pytest.raises(ValueError, match=r"`weight` must be the head as \[vocab, hidden\]"):
        linear_cross_entropy(h, w.T, labels)
    with pytest.raises(ValueError, match="`bias` must be None or a vector"):
        linear_cross_entropy(h, w, labels, bias=b[:-1])
    with pytest.raises(TypeError, match="`labels` must be integers"):
        linear_cross_entropy(h, w, labels.astype(jnp.float32))
    with pytest.raises(TypeError, match="one floating dtype"):
        linear_cross_entropy(h, w.astype(jnp.bfloat16), labels)
    with pytest.raises(ValueError, match="`logit_soft_cap` must be a finite number above 0"):
        linear_cross_entropy(h, w, labels, logit_soft_cap=0.0)
    with pytest.raises(TypeError, match="`chunk_bytes` must be None or an integer"):
        linear_cross_entropy(h, w, labels, chunk_bytes=True)
    with pytest.raises(TypeError, match="`ignore_index` must be an integer"):
        linear_cross_entropy(h, w, labels, ignore_index=-100.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match='`reduction` must be "mean" or "sum"'):
        linear_cross_entropy(h, w, labels, reduction="none")  # pyright: ignore[reportArgumentType]
