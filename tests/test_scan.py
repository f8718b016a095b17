import functools
import gc
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import mesh_of, tolerance
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array, PRNGKeyArray

import eqx_lean
from eqx_lean.internal import has_custom_transpose, without_private_jax


NUM_LAYERS = 6
DIM = 8

REMATS = [
    pytest.param(None, id="none"),
    pytest.param(True, id="true"),
    pytest.param(jax.checkpoint_policies.dots_saveable, id="dots_saveable"),
    pytest.param("nested", id="nested"),
    pytest.param(eqx_lean.NestedRemat(group_size=4), id="nested-4-with-remainder"),
    pytest.param(
        eqx_lean.NestedRemat(group_size=3, policy=jax.checkpoint_policies.dots_saveable),
        id="nested-3-dots",
    ),
]


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def assert_close(found, expected, rtol=None):
    rtol = tolerance("loop") if rtol is None else rtol  # 1e-6 on the CPU
    found_leaves, found_def = jax.tree.flatten(found)
    expected_leaves, expected_def = jax.tree.flatten(expected)
    assert found_def == expected_def
    assert len(expected_leaves) > 0
    for a, b in zip(found_leaves, expected_leaves, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype
        if not np.issubdtype(b.dtype, np.floating):
            np.testing.assert_array_equal(a, b)
            continue
        bound = rtol * np.maximum(1.0, np.abs(b))
        assert np.all(np.abs(a - b) <= bound), np.max(np.abs(a - b))


def mlp_stack(key, num_layers=NUM_LAYERS):
    keys = jax.random.split(key, num_layers)
    return eqx_lean.build_stacked(
        lambda k: eqx.nn.MLP(DIM, DIM, width_size=16, depth=2, activation=jnp.tanh, key=k), keys
    )


def loop_fold(stacked, x):
    for layer in eqx_lean.unstack(stacked):
        x = layer(x)
    return x


@eqx.filter_jit
def value_and_grads_of(forward, stacked, x):
    """Output, and gradients with respect to the stacked parameters and the input."""

    def loss(args):
        out = forward(*args)
        return jnp.sum(jnp.sin(out)), out

    (_, out), grads = eqx.filter_value_and_grad(loss, has_aux=True)((stacked, x))
    return out, grads


# --- MLP stack --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp():
    """A stacked MLP, an input, and the loop's output and gradients (computed once per module)."""
    stacked = mlp_stack(jax.random.key(100))
    x = jax.random.normal(jax.random.key(101), (DIM,))
    with jax.default_matmul_precision("highest"):
        expected = value_and_grads_of(loop_fold, stacked, x)
    return stacked, x, expected


@pytest.mark.quick
@pytest.mark.parametrize("remat", REMATS)
def test_fold_mlp_matches_loop(mlp, remat):
    stacked, x, expected = mlp
    found = value_and_grads_of(lambda s, x: eqx_lean.fold(s, x, remat=remat), stacked, x)
    assert_close(found, expected)


@pytest.mark.parametrize("unroll", [2, True])
def test_fold_unroll_matches_loop(mlp, unroll):
    stacked, x, expected = mlp
    found = value_and_grads_of(lambda s, x: eqx_lean.fold(s, x, unroll=unroll), stacked, x)
    assert_close(found, expected)


def test_fold_under_jit_and_vmap(mlp, getkey):
    stacked, _, _ = mlp
    xs = jax.random.normal(getkey(), (5, DIM))

    @eqx.filter_jit
    def batched(stacked, xs):
        return jax.vmap(lambda x: eqx_lean.fold(stacked, x, remat=True))(xs)

    def batched_loop(stacked, xs):
        return jax.vmap(lambda x: loop_fold(stacked, x))(xs)

    assert_close(
        value_and_grads_of(batched, stacked, xs), value_and_grads_of(batched_loop, stacked, xs)
    )


def test_fold_passes_args_kwargs_and_call(mlp, getkey):
    stacked, _, _ = mlp
    x = jax.random.normal(getkey(), (DIM,))
    scale = jax.random.normal(getkey(), (DIM,))
    shift = jnp.float32(0.5)

    def call(layer, x, scale, *, shift):
        return layer(x) * scale + shift

    expected = x
    for layer in eqx_lean.unstack(stacked):
        expected = layer(expected) * scale + shift
    found = eqx_lean.fold(stacked, x, (scale,), dict(shift=shift), call=call)
    assert_close(found, expected)


def _scaled_by_a_closed_over_array(stacked):
    """`fold` of layers that each scale by an array the call closes over, and the same as a
    Python loop (the oracle), each `(scale, x) -> scalar`."""

    def ours(scale, x):
        return jnp.sum(
            jnp.sin(eqx_lean.fold(stacked, x, (scale,), call=lambda layer, h, s: layer(h) * s))
        )

    def loop(scale, x):
        for layer in eqx_lean.unstack(stacked):
            x = layer(x) * scale
        return jnp.sum(jnp.sin(x))

    return ours, loop


def test_fold_differentiates_arrays_the_layers_close_over(mlp, getkey):
    stacked, x, _ = mlp
    scale = jax.random.normal(getkey(), (DIM,))
    ours, loop = _scaled_by_a_closed_over_array(stacked)

    assert_close(jax.grad(ours, argnums=(0, 1))(scale, x), jax.grad(loop, argnums=(0, 1))(scale, x))
    assert_close(jax.hessian(ours)(scale, x), jax.hessian(loop)(scale, x))


# Forward mode goes through the private primitive; the public path (another JAX, or
# `EQX_LEAN_NO_PRIVATE_JAX=1`) refuses it by name (tests/test_scan_public_vjp.py).
@pytest.mark.private_jax
def test_fold_differentiates_arrays_the_layers_close_over_in_forward_mode(mlp, getkey):
    stacked, x, _ = mlp
    scale = jax.random.normal(getkey(), (DIM,))
    ours, loop = _scaled_by_a_closed_over_array(stacked)

    assert_close(jax.jacfwd(ours)(scale, x), jax.jacfwd(loop)(scale, x))


def test_fold_keeps_no_reference_to_arrays_the_layers_close_over(mlp):
    stacked, x, _ = mlp
    before = {id(a) for a in jax.live_arrays()}
    for _ in range(3):
        closed_over = jnp.ones((256, 256))
        out = eqx_lean.fold(stacked, x, (closed_over,), call=lambda layer, h, c: layer(h) + c[0, 0])
        del closed_over, out
    gc.collect()
    assert {id(a) for a in jax.live_arrays()} <= before


def test_bfloat16_forward_temporaries_are_one_layer_not_the_stack():
    # XLA:CPU slices bfloat16 in float32; scanning the stack as `xs` lets it hoist that
    # conversion out of the loop, a float32 copy of the whole stack.
    num_layers, dim = 8, 1024
    weights = jax.ShapeDtypeStruct((num_layers, dim, dim), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((4, dim), jnp.bfloat16)

    @jax.jit
    def forward(weights, x):
        stacked = eqx.nn.Linear(dim, dim, use_bias=False, key=jax.random.key(0))
        stacked = eqx.tree_at(lambda m: m.weight, stacked, weights)
        return eqx_lean.fold(stacked, x, call=lambda layer, h: h @ layer.weight.T)

    analysis = forward.lower(weights, x).compile().memory_analysis()
    assert analysis is not None  # XLA:CPU always reports it
    temp = analysis.temp_size_in_bytes
    one_layer_float32 = dim * dim * 4
    assert temp <= 2 * one_layer_float32, temp / one_layer_float32


def test_fold_traces_one_layer_whatever_num_layers(getkey):
    def count_dots(num_layers):
        layer = eqx.nn.MLP(DIM, DIM, width_size=16, depth=2, key=getkey())
        stacked = eqx_lean.allocate_stacked(layer, num_layers)
        dynamic, static = eqx.partition(stacked, eqx.is_array)
        jaxpr = jax.make_jaxpr(lambda d, x: eqx_lean.fold(eqx.combine(d, static), x))(
            dynamic, jnp.zeros(DIM)
        )
        return str(jaxpr).count("dot_general")

    assert count_dots(2) == count_dots(12) == 3  # the three linear layers of one MLP


def test_fold_gradient_traces_one_layer_whatever_num_layers(getkey):
    # The backward pass is a loop too: one layer's VJP is traced whatever `L` is.
    def count_dots(num_layers, remat):
        layer = eqx.nn.MLP(DIM, DIM, width_size=16, depth=2, key=getkey())
        stacked = eqx_lean.allocate_stacked(layer, num_layers)
        dynamic, static = eqx.partition(stacked, eqx.is_array)

        def loss(dynamic, x):
            return jnp.sum(eqx_lean.fold(eqx.combine(dynamic, static), x, remat=remat))

        return str(jax.make_jaxpr(jax.grad(loss))(dynamic, jnp.zeros(DIM))).count("dot_general")

    for remat in (None, True, "nested"):
        assert 0 < count_dots(2, remat) == count_dots(12, remat), remat


# --- gradients: the index-reading backward pass -------------------------------------------------


@pytest.mark.private_jax  # the private primitive against the public custom VJP
@pytest.mark.parametrize("remat", REMATS)
def test_fold_gradients_equal_the_earlier_scan_over_xs(mlp, remat):
    # The public path (a `jax.custom_vjp` of the same loops since issue 46; `lax.scan` over the
    # stack as `xs` before) and the private primitive give the same values, those of the loop.
    stacked, x, expected = mlp
    with without_private_jax():
        assert not has_custom_transpose()
        earlier = value_and_grads_of(lambda s, x: eqx_lean.fold(s, x, remat=remat), stacked, x)
    assert has_custom_transpose()
    found = value_and_grads_of(lambda s, x: eqx_lean.fold(s, x, remat=remat), stacked, x)
    assert_close(earlier, expected)
    assert_close(found, earlier)


def loop_loss(stacked, x):
    return jnp.sum(jnp.sin(loop_fold(stacked, x)))


REMATS_UNDER_EVERY_TRANSFORMATION = [
    pytest.param(True, id="true"),
    pytest.param(None, id="none", marks=pytest.mark.slow),
    pytest.param("nested", id="nested", marks=pytest.mark.slow),
]


def under_transformations(mlp, remat):
    """`both(transform, *args)`, which checks `fold` against the loop under `transform`, and
    the arguments the transformations take."""
    stacked, x, _ = mlp
    stacked, static = eqx.partition(stacked, eqx.is_array)  # the arrays, for jax.* transforms
    xs = jnp.stack([x, 0.5 * x, -x])

    def loss(stacked, x):
        return jnp.sum(jnp.sin(eqx_lean.fold(eqx.combine(stacked, static), x, remat=remat)))

    def both(transform, *args):
        expected = jax.jit(transform(lambda s, x: loop_loss(eqx.combine(s, static), x)))(*args)
        assert_close(jax.jit(transform(loss))(*args), expected)

    return both, stacked, x, xs


@pytest.mark.quick
@pytest.mark.parametrize("remat", REMATS_UNDER_EVERY_TRANSFORMATION)
def test_fold_under_every_transformation_matches_loop(mlp, remat):
    both, stacked, x, xs = under_transformations(mlp, remat)

    def on_x(f):
        return lambda x: f(stacked, x)

    def batched_loss(f):
        return lambda s, xs: jnp.sum(jax.vmap(f, in_axes=(None, 0))(s, xs))

    both(lambda f: jax.value_and_grad(f, argnums=(0, 1)), stacked, x)
    both(lambda f: jax.vmap(jax.grad(f, argnums=(0, 1)), in_axes=(None, 0)), stacked, xs)
    both(lambda f: jax.grad(batched_loss(f), argnums=(0, 1)), stacked, xs)
    both(lambda f: jax.jacrev(on_x(f)), x)
    both(lambda f: jax.hessian(on_x(f)), x)  # forward over reverse
    both(lambda f: jax.grad(jax.checkpoint(on_x(f))), x)


# Forward mode goes through the private primitive; the public path refuses it by name.
@pytest.mark.private_jax
@pytest.mark.parametrize("remat", REMATS_UNDER_EVERY_TRANSFORMATION)
def test_fold_under_every_forward_mode_transformation_matches_loop(mlp, remat):
    both, stacked, x, xs = under_transformations(mlp, remat)

    def on_x(f):
        return lambda x: f(stacked, x)

    both(lambda f: lambda x, t: jax.jvp(on_x(f), (x,), (t,)), x, xs[1])
    both(lambda f: jax.jacfwd(on_x(f)), x)
    both(lambda f: jax.jacrev(jax.jacfwd(on_x(f))), x)  # reverse over forward
    both(lambda f: jax.jacfwd(jax.jacfwd(on_x(f))), x)


def test_scan_gradients_with_integer_leaves_keys_and_python_scalars(mlp):
    # An integer counter, a random key and a Python float in the carry; integer and float `ys`.
    stacked, x, _ = mlp
    stacked, static = eqx.partition(stacked, eqx.is_array)

    def call(layer, carry, _):
        h, count, key, scale = carry
        key, noise_key = jax.random.split(key)
        h = layer(h) * scale + 0.1 * jax.random.normal(noise_key, h.shape)
        return (h, count + 1, key, scale * 0.5), (count, jnp.sum(h**2))

    def loss(stacked, x, run):
        carry = (x, jnp.int32(0), jax.random.key(7), 2.0)
        (h, count, _, scale), (counts, norms) = run(stacked, carry)
        weights = jnp.arange(1.0, NUM_LAYERS + 1.0)
        return jnp.sum(jnp.sin(h)) + jnp.sum(weights * norms) + scale, (count, counts)

    def loop(stacked, carry):
        ys = []
        for layer in eqx_lean.unstack(eqx.combine(stacked, static)):
            carry, y = call(layer, carry, None)
            ys.append(y)
        return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)

    def gradient(run):
        return jax.jit(jax.grad(lambda s, x: loss(s, x, run), argnums=(0, 1), has_aux=True))

    expected = gradient(loop)(stacked, x)
    for remat in (None, True, eqx_lean.NestedRemat()):

        def scanned(stacked, carry, remat=remat):
            return eqx_lean.scan(eqx.combine(stacked, static), carry, call=call, remat=remat)

        assert_close(gradient(scanned)(stacked, x), expected)


def test_fold_gradient_when_no_layer_needs_its_incoming_carry(mlp):
    # With no remat, a layer that starts with `sin` keeps `cos(x)`, never `x`: then the carries
    # are not saved at all, and the backward pass must not need them.
    stacked, x, _ = mlp

    def call(layer, h):
        return layer(jnp.sin(h))

    def loop(stacked, x):
        for layer in eqx_lean.unstack(stacked):
            x = call(layer, x)
        return x

    expected = value_and_grads_of(loop, stacked, x)
    assert_close(
        value_and_grads_of(lambda s, x: eqx_lean.fold(s, x, call=call), stacked, x), expected
    )


class LoraLinear(eqx.Module):
    """A linear layer with a frozen base `weight` and a low-rank update `lora_b @ lora_a`."""

    weight: Array
    lora_a: Array
    lora_b: Array
    bfloat16_product: bool = eqx.field(static=True)

    def __init__(self, dim, rank, *, bfloat16_product=False, key):
        k1, k2 = jax.random.split(key)
        self.weight = jax.random.normal(k1, (dim, dim)) / np.sqrt(dim)
        self.lora_a = jax.random.normal(k2, (rank, dim)) / np.sqrt(dim)
        self.lora_b = jnp.zeros((dim, rank))  # zero-initialised, as PEFT does
        self.bfloat16_product = bfloat16_product

    def __call__(self, x):
        if self.bfloat16_product:  # no float32 copy of the weight on XLA:CPU
            base = jnp.dot(
                x.astype(self.weight.dtype), self.weight.T, preferred_element_type=jnp.float32
            )
        else:
            base = x @ self.weight.astype(jnp.float32).T
        return jnp.tanh(base + (x @ self.lora_a.T) @ self.lora_b.T)


def lora_stack(key, num_layers, dim, rank, bfloat16_product=False):
    """A stacked `LoraLinear` with a bfloat16 base and float32 adapters (`B` not zero)."""
    stacked = eqx_lean.build_stacked(
        lambda k: LoraLinear(dim, rank, bfloat16_product=bfloat16_product, key=k),
        jax.random.split(key, num_layers),
    )
    b = 0.1 * jax.random.normal(jax.random.fold_in(key, 1), stacked.lora_b.shape)
    stacked = eqx.tree_at(lambda m: m.lora_b, stacked, b)
    return eqx.tree_at(lambda m: m.weight, stacked, stacked.weight.astype(jnp.bfloat16))


def is_array_or_struct(leaf):
    return eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)


def adapters_only(stacked):
    """`(trainable, frozen)`: the float32 adapters, and the bfloat16 base."""
    return eqx.partition(
        stacked, lambda leaf: is_array_or_struct(leaf) and leaf.dtype == jnp.float32
    )


@pytest.mark.parametrize(
    "bfloat16_product",
    [
        pytest.param(False, id="f32-product"),
        pytest.param(True, id="bf16-product", marks=pytest.mark.slow),
    ],
)
def test_fold_gradient_of_adapters_on_a_frozen_bfloat16_base(getkey, bfloat16_product):
    stacked = lora_stack(getkey(), NUM_LAYERS, DIM, rank=2, bfloat16_product=bfloat16_product)
    x = jax.random.normal(getkey(), (3, DIM))
    trainable, frozen = adapters_only(stacked)

    def adapter_grads(forward):
        def loss(trainable):
            return jnp.sum(jnp.sin(forward(eqx.combine(trainable, frozen), x)))

        return jax.jit(jax.grad(loss))(trainable)

    expected = adapter_grads(loop_fold)
    for remat in (None, True, jax.checkpoint_policies.dots_saveable, eqx_lean.NestedRemat()):
        found = adapter_grads(lambda s, x, remat=remat: eqx_lean.fold(s, x, remat=remat))
        assert found.weight is None
        assert_close(found, expected)

    # The whole stack: the base's gradient comes back in bfloat16, as the base is.
    def whole_grads(forward):
        return jax.jit(jax.grad(lambda s: jnp.sum(jnp.sin(forward(s, x)))))(stacked)

    expected = whole_grads(loop_fold)
    found = whole_grads(lambda s, x: eqx_lean.fold(s, x, remat=True))
    assert found.weight.dtype == jnp.bfloat16
    assert_close((found.lora_a, found.lora_b), (expected.lora_a, expected.lora_b))
    # Both round the same float32 values to bfloat16: at most one rounding apart.
    np.testing.assert_allclose(
        np.asarray(found.weight, np.float32),
        np.asarray(expected.weight, np.float32),
        rtol=2**-7,
        atol=1e-7,
    )


# The benchmark: 16 layers of 2048 x 2048 bfloat16 weights (a 128 MiB stack), rank-8
# float32 adapters, a batch of 4 x 2048 float32 inputs. Compiled only, never run.
BENCH_LAYERS, BENCH_DIM, BENCH_RANK, BENCH_BATCH = 16, 2048, 8, 4


def lora_gradient_temp(remat, trainable, bfloat16_product=False):
    """`temp_size_in_bytes` of the jitted gradient on the benchmark (adapters or whole)."""
    stacked = eqx.filter_eval_shape(
        lora_stack, jax.random.key(0), BENCH_LAYERS, BENCH_DIM, BENCH_RANK, bfloat16_product
    )
    x = jax.ShapeDtypeStruct((BENCH_BATCH, BENCH_DIM), jnp.float32)
    if trainable == "adapters":
        train, frozen = adapters_only(stacked)
    else:
        train, frozen = eqx.partition(stacked, lambda _: True)
    train, static = eqx.partition(train, is_array_or_struct)
    assert len(jax.tree.leaves(train)) == (2 if trainable == "adapters" else 3)

    @jax.jit
    def gradient(train, frozen, x):
        def loss(train):
            model = eqx.combine(eqx.combine(train, static), frozen)
            return jnp.sum(eqx_lean.fold(model, x, remat=remat) ** 2)

        return jax.grad(loss)(train)

    analysis = gradient.lower(train, frozen, x).compile().memory_analysis()
    assert analysis is not None  # XLA:CPU always reports it
    return analysis.temp_size_in_bytes


HALF_THE_BFLOAT16_STACK = BENCH_LAYERS * BENCH_DIM * BENCH_DIM * 2 // 2  # 64 MiB


@pytest.mark.parametrize("bfloat16_product", [False, True], ids=["f32-product", "bf16-product"])
@pytest.mark.parametrize("trainable", ["adapters", "whole"])
def test_lora_gradient_temporaries_at_most_half_the_bfloat16_stack(trainable, bfloat16_product):
    # The bar of issue 15 (`remat=True`); the earlier scan over `xs` needed 273 MiB here.
    temp = lora_gradient_temp(True, trainable, bfloat16_product)
    assert temp <= HALF_THE_BFLOAT16_STACK, temp / 2**20


@pytest.mark.parametrize(
    "remat",
    [
        pytest.param(None, id="none"),
        pytest.param(jax.checkpoint_policies.dots_saveable, id="dots_saveable"),
        pytest.param("nested", id="nested"),
    ],
)
@pytest.mark.parametrize("trainable", ["adapters", "whole"])
# XLA:CPU's plan (421 MiB on the H100 against this 64 MiB bar); the private primitive and the
# public custom VJP (`EQX_LEAN_NO_PRIVATE_JAX=1`, issue 46) both meet it.
@pytest.mark.xla_cpu
def test_lora_gradient_temporaries_on_every_remat_mode(trainable, remat):
    # No remat mode saves a copy of the stack, converted or not, nor a stack-sized zero: with
    # `None`, the layer's float32 copy of its weight is recomputed, not saved per layer.
    temp = lora_gradient_temp(remat, trainable)
    assert temp <= HALF_THE_BFLOAT16_STACK, temp / 2**20


# --- attention stack with a per-layer KV cache ------------------------------------------------

HEADS = 2
HEAD_DIM = 4
CACHE_LEN = 7


class Attention(eqx.Module):
    query: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value: eqx.nn.Linear
    out: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)

    def __init__(self, dim: int, num_heads: int, *, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.query = eqx.nn.Linear(dim, dim, use_bias=False, key=kq)
        self.key_proj = eqx.nn.Linear(dim, dim, use_bias=False, key=kk)
        self.value = eqx.nn.Linear(dim, dim, use_bias=False, key=kv)
        self.out = eqx.nn.Linear(dim, dim, key=ko)
        self.num_heads = num_heads

    def __call__(
        self, x: Array, cache: tuple[Array, Array], pos: Array
    ) -> tuple[Array, tuple[Array, Array]]:
        """`x`: new tokens `(T, dim)` at positions `pos..pos+T`; `cache`: two `(CACHE_LEN, dim)`."""
        k_cache, v_cache = cache
        heads = lambda y: y.reshape(y.shape[0], self.num_heads, -1)  # noqa: E731
        q = heads(jax.vmap(self.query)(x))
        k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, jax.vmap(self.key_proj)(x), pos, 0)
        v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, jax.vmap(self.value)(x), pos, 0)
        logits = jnp.einsum("thd,shd->hts", q, heads(k_cache)) / jnp.sqrt(jnp.float32(HEAD_DIM))
        query_pos = pos + jnp.arange(x.shape[0])
        visible = jnp.arange(CACHE_LEN)[None, :] <= query_pos[:, None]
        logits = jnp.where(visible[None], logits, jnp.float32(-1e30))
        attended = jnp.einsum("hts,shd->thd", jax.nn.softmax(logits, axis=-1), heads(v_cache))
        x = x + jax.vmap(self.out)(attended.reshape(x.shape))
        return x, (k_cache, v_cache)


def attention_stack(key):
    keys = jax.random.split(key, NUM_LAYERS)
    return eqx_lean.build_stacked(lambda k: Attention(HEADS * HEAD_DIM, HEADS, key=k), keys)


def attention_inputs(getkey):
    dim = HEADS * HEAD_DIM
    x = jax.random.normal(getkey(), (3, dim))
    cache = (
        jax.random.normal(getkey(), (NUM_LAYERS, CACHE_LEN, dim)),
        jax.random.normal(getkey(), (NUM_LAYERS, CACHE_LEN, dim)),
    )
    return x, cache, jnp.int32(2)


def attention_loss(run):
    def loss(args):
        out, (k, v) = run(*args)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(k) * v), (out, (k, v))

    return loss


def loop_attention(stacked, x, cache, pos):
    new_caches = []
    for i, layer in enumerate(eqx_lean.unstack(stacked)):
        x, new_cache = layer(x, eqx_lean.layer_at(cache, i), pos)
        new_caches.append(new_cache)
    return x, jax.tree.map(lambda *cs: jnp.stack(cs), *new_caches)


@pytest.fixture(scope="module")
def attention():
    """A stacked attention module, inputs with a KV cache, and the loop's outputs and gradients."""
    stacked = attention_stack(jax.random.key(200))
    counter = iter(range(201, 300))
    inputs = attention_inputs(lambda: jax.random.key(next(counter)))
    with jax.default_matmul_precision("highest"):
        expected = eqx.filter_jit(
            eqx.filter_value_and_grad(attention_loss(loop_attention), has_aux=True)
        )((stacked, *inputs))
    return stacked, inputs, expected


# Every remat mode runs on the MLP stack; here the cheaper half by default, all with `-m slow`.
ATTENTION_REMATS = [
    p
    if p.id in ("none", "true", "nested-4-with-remainder")
    else pytest.param(*p.values, id=p.id, marks=pytest.mark.slow)
    for p in REMATS
]


@pytest.mark.parametrize("remat", ATTENTION_REMATS)
def test_scan_attention_with_kv_cache_matches_loop(attention, remat):
    stacked, (x, cache, pos), expected = attention

    def scanned(stacked, x, cache, pos):
        return eqx_lean.scan(
            stacked, x, cache, call=lambda layer, x, c: layer(x, c, pos), remat=remat
        )

    found = eqx.filter_jit(eqx.filter_value_and_grad(attention_loss(scanned), has_aux=True))(
        (stacked, x, cache, pos)
    )
    assert_close(found, expected)


def test_scan_without_xs_returns_stacked_ys(mlp):
    stacked, x, _ = mlp

    def call(layer, x, nothing):
        assert nothing is None
        y = layer(x)
        return y, jnp.sum(y**2)

    expected_x, expected_norms = x, []
    for layer in eqx_lean.unstack(stacked):
        expected_x = layer(expected_x)
        expected_norms.append(jnp.sum(expected_x**2))
    found = eqx_lean.scan(stacked, x, call=call)
    assert_close(found, (expected_x, jnp.stack(expected_norms)))


# --- per-layer keys ---------------------------------------------------------------------------


class DropoutBlock(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, *, key: PRNGKeyArray):
        self.linear = eqx.nn.Linear(DIM, DIM, key=key)
        self.dropout = eqx.nn.Dropout(0.5)

    def __call__(self, x: Array, scale: Array, *, key: PRNGKeyArray) -> Array:
        return self.dropout(jnp.tanh(self.linear(x)) * scale, key=key)


SCALE = 1.5


def loop_with_keys(stacked, x, key):
    keys = jax.random.split(key, NUM_LAYERS)
    for layer, layer_key in zip(eqx_lean.unstack(stacked), keys, strict=True):
        x = layer(x, jnp.float32(SCALE), key=layer_key)
    return x


@pytest.fixture(scope="module")
def dropout():
    keys = jax.random.split(jax.random.key(300), NUM_LAYERS)
    stacked = eqx_lean.build_stacked(lambda k: DropoutBlock(key=k), keys)
    x = jax.random.normal(jax.random.key(301), (DIM,))
    key = jax.random.key(302)
    with jax.default_matmul_precision("highest"):
        expected = value_and_grads_of(lambda s, x: loop_with_keys(s, x, key), stacked, x)
    return stacked, x, key, expected


@pytest.mark.parametrize("remat", [None, True, "nested"])
def test_fold_splits_one_key_per_layer(dropout, getkey, remat):
    stacked, x, key, expected = dropout

    def folded(stacked, x):
        return eqx_lean.fold(stacked, x, (jnp.float32(SCALE),), key=key, remat=remat)

    found = value_and_grads_of(folded, stacked, x)
    assert_close(found, expected)
    # The key matters: another key drops other units.
    assert not np.allclose(found[0], eqx_lean.fold(stacked, x, (jnp.float32(SCALE),), key=getkey()))


# --- stateful layers --------------------------------------------------------------------------


class NormBlock(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key: PRNGKeyArray):
        self.linear = eqx.nn.Linear(DIM, DIM, key=key)
        self.norm = eqx.nn.BatchNorm(DIM, axis_name="batch", mode="ema", momentum=0.5)

    def __call__(self, x: Array, state: eqx.nn.State) -> tuple[Array, eqx.nn.State]:
        return self.norm(jnp.tanh(self.linear(x)), state)


@pytest.mark.parametrize("builder", ["build_stacked", "filter_vmap"])
def test_scan_stateful_layers(getkey, builder):
    keys = jax.random.split(getkey(), NUM_LAYERS)
    make = eqx.nn.make_with_state(NormBlock)
    if builder == "build_stacked":
        stacked, state = eqx_lean.build_stacked(make, keys)
    else:
        stacked, state = eqx.filter_vmap(make)(keys)
    batch = jax.random.normal(getkey(), (4, DIM))

    def run_scan(stacked, state, batch):
        return jax.vmap(
            lambda x: eqx_lean.scan(stacked, x, state, call=lambda layer, x, s: layer(x, s)),
            axis_name="batch",
            out_axes=(0, None),
        )(batch)

    def run_loop(stacked, state, batch):
        new_states = []
        for i, layer in enumerate(eqx_lean.unstack(stacked)):
            batch, layer_state = jax.vmap(
                layer, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
            )(batch, eqx_lean.layer_at(state, i))
            new_states.append(layer_state)
        return batch, jax.tree.map(lambda *s: jnp.stack(s), *new_states)

    # The loop is jitted too: run eagerly, the batch variance is rounded differently from any
    # compiled program (up to 1e-6 after normalising), which would test XLA, not `scan`.
    run_loop = eqx.filter_jit(run_loop)
    # Twice, so that the second pass reads the running statistics the first pass wrote.
    expected_out, expected_state = run_loop(stacked, state, batch)
    expected_out, expected_state = run_loop(stacked, expected_state, expected_out)
    found_out, found_state = eqx.filter_jit(run_scan)(stacked, state, batch)
    found_out, found_state = eqx.filter_jit(run_scan)(stacked, found_state, found_out)
    assert isinstance(found_state, eqx.nn.State)
    assert_close((found_out, found_state), (expected_out, expected_state))


@pytest.mark.parametrize(
    "remat",
    [
        pytest.param(True, id="true"),
        pytest.param(None, id="none", marks=pytest.mark.slow),
        pytest.param("nested", id="nested", marks=pytest.mark.slow),
    ],
)
def test_scan_stateful_layers_gradient_under_vmap_with_a_named_axis(getkey, remat):
    # Batch norm reduces over the named vmap axis inside each layer: the backward pass is
    # vmapped with that axis name too.
    keys = jax.random.split(getkey(), NUM_LAYERS)
    stacked, state = eqx_lean.build_stacked(eqx.nn.make_with_state(NormBlock), keys)
    stacked, static = eqx.partition(stacked, eqx.is_array)
    batch = jax.random.normal(getkey(), (4, DIM))

    def run_scan(layers, batch):
        return jax.vmap(
            lambda x: eqx_lean.scan(layers, x, state, call=lambda f, x, s: f(x, s), remat=remat),
            axis_name="batch",
            out_axes=(0, None),
        )(batch)

    def run_loop(layers, batch, state=state):
        states = []
        for i, layer in enumerate(eqx_lean.unstack(layers)):
            batch, layer_state = jax.vmap(
                layer, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
            )(batch, eqx_lean.layer_at(state, i))
            states.append(layer_state)
        return batch, jax.tree.map(lambda *s: jnp.stack(s), *states)

    def loss(run):
        def of(dynamic, batch):
            out, new_state = run(eqx.combine(dynamic, static), batch)
            return jnp.sum(jnp.sin(out)), new_state

        return jax.jit(jax.grad(of, argnums=(0, 1), has_aux=True))

    found = loss(run_scan)(stacked, batch)
    loop = loss(run_loop)(stacked, batch)
    # Normalising by the variance of 4 samples amplifies rounding: two float32 orders of the
    # same sums differ by up to 2e-5 relative on some CPUs. So the oracle is the loop in float64
    # (the float32 inputs, widened exactly), and the scan must be within twice the float32
    # loop's own error from it, leaf by leaf (and 1e-6 of the leaf's scale, for leaves the
    # float32 loop gets exactly).
    with jax.enable_x64(True):
        wide = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
        )
        exact = loss(functools.partial(run_loop, state=wide(state)))(wide(stacked), wide(batch))
    found_leaves, found_def = jax.tree.flatten(found)
    exact_leaves, exact_def = jax.tree.flatten(exact)
    assert found_def == exact_def and len(found_leaves) > 0
    for a, b, c in zip(found_leaves, jax.tree.leaves(loop), exact_leaves, strict=True):
        a, b, c = np.asarray(a), np.asarray(b), np.asarray(c)
        assert a.shape == b.shape == c.shape and a.dtype == b.dtype
        if not np.issubdtype(b.dtype, np.floating):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)
            continue
        scale = np.abs(c).max()
        own_error = np.abs(b - c).max()
        assert np.abs(a - c).max() <= 2 * own_error + 1e-6 * max(1.0, scale), (
            np.abs(a - c).max(),
            own_error,
        )


# --- sharded within each layer ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.cpu_mesh
def test_fold_sharded_within_layers_on_8_devices():
    mesh = mesh_of((8,), ("model",), AxisType.Auto)
    keys = jax.random.split(jax.random.key(0), 4)
    stacked = eqx_lean.build_stacked(
        lambda k: eqx.nn.MLP(16, 16, 64, 1, activation=jnp.tanh, key=k), keys
    )
    x = jax.random.normal(jax.random.key(1), (16,))

    def shard(leaf):
        spec = [None] * leaf.ndim
        spec[-1 if leaf.ndim > 2 else 1] = "model"  # within each layer, never the layer axis
        return jax.device_put(leaf, NamedSharding(mesh, P(*spec)))

    sharded = jax.tree.map(lambda leaf: shard(leaf) if eqx.is_array(leaf) else leaf, stacked)
    assert sharded.layers[0].weight.sharding.spec == P(None, None, "model")

    def loss(stacked, x):
        return jnp.sum(jnp.sin(eqx_lean.fold(stacked, x, remat=True)))

    found = eqx.filter_jit(eqx.filter_value_and_grad(loss))(sharded, x)
    expected = eqx.filter_value_and_grad(loop_loss)(stacked, x)  # on one device
    assert_close(found, expected)


class BareLora(eqx.Module):
    """`LoraLinear`'s layer as three arrays: a bfloat16 base and float32 adapters."""

    weight: Array
    lora_a: Array
    lora_b: Array

    def __call__(self, x):
        base = x @ self.weight.astype(jnp.float32).T
        return jnp.tanh(base + (x @ self.lora_a.T) @ self.lora_b.T)


@pytest.mark.cpu_mesh
def test_fold_gradients_come_back_in_the_stacks_sharding_on_8_devices():
    mesh = mesh_of((8,), ("model",), AxisType.Auto)
    dim, rank, num_layers = 32, 2, 4
    keys = jax.random.split(jax.random.key(0), 3)
    stacked = BareLora(
        (jax.random.normal(keys[0], (num_layers, dim, dim)) / dim**0.5).astype(jnp.bfloat16),
        jax.random.normal(keys[1], (num_layers, rank, dim)) / dim**0.5,
        jax.random.normal(keys[2], (num_layers, dim, rank)),
    )

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    sharded = BareLora(
        put(stacked.weight, P(None, "model", None)),
        put(stacked.lora_a, P(None, None, "model")),
        put(stacked.lora_b, P(None, "model", None)),
    )
    x = jax.random.normal(jax.random.key(1), (3, dim))

    def grads(forward, stacked):
        return jax.jit(jax.grad(lambda s: jnp.sum(jnp.sin(forward(s, x)))))(stacked)

    def assert_close_to_scale(found, expected, rtol):
        # Sums split across devices round differently: float32 rounding of the leaf's scale.
        found, expected = np.asarray(found, np.float32), np.asarray(expected, np.float32)
        atol = 1e-6 * np.abs(expected).max()
        np.testing.assert_allclose(found, expected, rtol=rtol, atol=atol)

    expected = grads(loop_fold, stacked)  # on one device
    remats: list[bool | Literal["nested"] | None] = [None, True, "nested"]
    for remat in remats:
        found = grads(functools.partial(eqx_lean.fold, remat=remat), sharded)
        # The gradient comes back in the stack's own sharding, leaf by leaf.
        for g, a in zip(jax.tree.leaves(found), jax.tree.leaves(sharded), strict=True):
            assert g.dtype == a.dtype, (remat, g.dtype, a.dtype)
            assert g.sharding.is_equivalent_to(a.sharding, a.ndim), (remat, g.sharding, a.sharding)
        assert_close_to_scale(found.lora_a, expected.lora_a, rtol=1e-5)
        assert_close_to_scale(found.lora_b, expected.lora_b, rtol=1e-5)
        assert_close_to_scale(found.weight, expected.weight, rtol=2**-7)  # one bfloat16 rounding


# --- errors -------------------------------------------------------------------------------------


def test_error_xs_leading_axis_not_num_layers(mlp):
    stacked, _, _ = mlp
    x = jnp.zeros(DIM)
    call = lambda layer, x, c: (layer(x), c)  # noqa: E731
    with pytest.raises(ValueError, match=r"leading layer axis of length L=6.*xs\[1\]"):
        eqx_lean.scan(stacked, x, (jnp.zeros((6, 2)), jnp.zeros((5, 2))), call=call)
    with pytest.raises(ValueError, match=r"leading layer axis of length L=6.*xs"):
        eqx_lean.scan(stacked, x, jnp.float32(1.0), call=call)
    with pytest.raises(TypeError, match=r"`xs` must be a pytree of arrays"):
        eqx_lean.scan(stacked, x, ("not an array",), call=call)


def test_error_carry_changes(mlp):
    stacked, _, _ = mlp
    x = jnp.zeros(DIM)
    with pytest.raises(ValueError, match=r"`carry` is carried from layer to layer.*float32\[9\]"):
        eqx_lean.scan(stacked, x, call=lambda layer, x, _: (jnp.append(layer(x), 1.0), None))
    with pytest.raises(ValueError, match=r"`carry` is carried.*structure"):
        eqx_lean.scan(stacked, x, call=lambda layer, x, _: ((layer(x), x), None))  # pyright: ignore
    with pytest.raises(ValueError, match=r"`carry\[1\]` is float32\[8\].*int32\[8\]"):
        eqx_lean.scan(
            stacked, (x, x), call=lambda layer, c, _: ((layer(c[0]), c[1].astype(jnp.int32)), None)
        )
    with pytest.raises(ValueError, match=r"`x` is carried from layer.*`x` is float32\[8\]"):
        eqx_lean.fold(stacked, x, call=lambda layer, x: layer(x)[:4])


def test_error_call_must_return_pair(mlp):
    stacked, _, _ = mlp
    with pytest.raises(TypeError, match=r"`call` must return a pair `\(carry, y\)`"):
        eqx_lean.scan(stacked, jnp.zeros(DIM), call=lambda layer, x, _: layer(x))


def test_empty_stack_returns_the_carry_and_empty_ys_like_lax_scan():
    empty = {"w": jnp.zeros((0, DIM, DIM)), "b": jnp.zeros((0, DIM))}
    x = jnp.arange(DIM, dtype=jnp.float32)

    def call(layer, x, _):
        return layer["w"] @ x + layer["b"], (x.sum(), layer["b"])

    carry, ys = eqx_lean.scan(empty, x, call=call)
    expected_carry, expected_ys = jax.lax.scan(lambda c, layer: call(layer, c, None), x, empty)
    np.testing.assert_array_equal(carry, expected_carry)
    assert jax.tree.map(jnp.shape, ys) == jax.tree.map(jnp.shape, expected_ys) == ((0,), (0, DIM))
    np.testing.assert_array_equal(eqx_lean.fold(empty, x, call=lambda layer, x: layer["w"] @ x), x)


def test_a_list_of_layers_points_to_stack(mlp):
    stacked, x, _ = mlp
    layers = eqx_lean.unstack(stacked)
    with pytest.raises(TypeError, match=r"got a list of 6 separate layers.*eqx_lean\.stack"):
        eqx_lean.fold(layers, x)
    with pytest.raises(TypeError, match=r"got a tuple of 6 separate layers"):
        eqx_lean.scan(tuple(layers), x, call=lambda layer, x, _: (layer(x), None))
    # A tuple of stacked modules is a valid stacked pytree.
    out = eqx_lean.fold((stacked, stacked), x, call=lambda pair, x: pair[1](pair[0](x)))
    assert out.shape == x.shape


def test_error_bad_options(mlp, getkey):
    stacked, _, _ = mlp
    x = jnp.zeros(DIM)
    with pytest.raises(ValueError, match=r"`remat` must be None, True"):
        eqx_lean.fold(stacked, x, remat="sqrt")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"`group_size` must be a positive integer"):
        eqx_lean.NestedRemat(group_size=0)
    with pytest.raises(TypeError, match=r"`args` must be a tuple"):
        eqx_lean.fold(stacked, x, x)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"`kwargs` must be a dict"):
        eqx_lean.fold(stacked, x, (), [x])  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"either as `fold\(..., key=key\)`.*not both"):
        eqx_lean.fold(stacked, x, (), dict(key=getkey()), key=getkey())
    with pytest.raises(ValueError, match=r"`stacked` has no array leaves"):
        eqx_lean.fold(eqx.nn.Lambda(jnp.tanh), x)


@pytest.mark.parametrize("remat", [None, True])
def test_gradient_through_a_vmapped_fold_matches_the_loop(mlp, remat):
    """`jax.vmap(lambda x: fold(stacked, x))` inside a gradient: the stack, closed over, is not
    batched; its gradient must be the sum over the batch, with no more memory than JAX's own
    derivative of a scan over the stack needs (the path before the index-reading backward)."""
    stacked, x, _ = mlp
    batch = jnp.stack([x, 2 * x, -x])

    def vmapped(stacked, batch):
        return jax.vmap(lambda x: eqx_lean.fold(stacked, x, remat=remat))(batch)

    def looped(stacked, batch):
        return jax.vmap(lambda x: loop_fold(stacked, x))(batch)

    assert_close(
        value_and_grads_of(vmapped, stacked, batch), value_and_grads_of(looped, stacked, batch)
    )

    params, static = eqx.partition(stacked, eqx.is_array)

    def temps(loss):
        grad = jax.jit(jax.grad(lambda p, b: jnp.sum(loss(eqx.combine(p, static), b))))
        analysis = grad.lower(params, batch).compile().memory_analysis()
        assert analysis is not None
        return analysis.temp_size_in_bytes

    with_index_loops = temps(vmapped)
    with without_private_jax():
        jax_s_own = temps(vmapped)
    assert with_index_loops <= jax_s_own


def test_remat_false_keeps_everything_as_none_does():
    stacked = {"w": 0.1 * jnp.ones((3, 4, 4))}

    def rematerialised(remat) -> int:
        def loss(stacked):
            call = lambda layer, x: jnp.tanh(layer["w"] @ x)  # noqa: E731
            return eqx_lean.fold(stacked, jnp.ones(4), call=call, remat=remat).sum()

        return str(jax.make_jaxpr(jax.grad(loss))(stacked)).count("remat")

    assert rematerialised(False) == rematerialised(None) == 0
    assert rematerialised(True) > 0
