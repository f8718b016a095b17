"""The public lean backward of `fold` and `scan` (issue 46): `backward`'s loops as a
`jax.custom_vjp`, taken on every JAX but the tested series, forced here with
`without_private_jax()`. The oracle is a Python loop over `eqx_lean.unstack`."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import tolerance
from jax.ad_checkpoint import checkpoint_name

import eqx_lean
from eqx_lean.internal import has_custom_transpose, without_private_jax


NUM_LAYERS = 5
DIM = 8

REMATS = [
    pytest.param(None, id="none"),
    pytest.param(True, id="true"),
    pytest.param(jax.checkpoint_policies.dots_saveable, id="dots_saveable"),
    pytest.param(jax.checkpoint_policies.save_only_these_names("layer_input"), id="by-name"),
    pytest.param("nested", id="nested"),
    pytest.param(
        eqx_lean.NestedRemat(group_size=2, policy=jax.checkpoint_policies.dots_saveable),
        id="nested-2-dots",
    ),
]


@pytest.fixture(autouse=True)
def public_path():
    with jax.default_matmul_precision("highest"), without_private_jax():
        assert not has_custom_transpose()
        yield


@pytest.fixture(scope="module")
def mlp():
    keys = jax.random.split(jax.random.key(0), NUM_LAYERS)
    stacked = eqx_lean.build_stacked(
        lambda k: eqx.nn.MLP(DIM, DIM, width_size=16, depth=2, activation=jnp.tanh, key=k), keys
    )
    params, static = eqx.partition(stacked, eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (DIM,))
    return params, static, x


def assert_close(found, expected):
    rtol = tolerance("loop")  # 1e-6 on the CPU
    found_leaves, found_def = jax.tree.flatten(found)
    expected_leaves, expected_def = jax.tree.flatten(expected)
    assert found_def == expected_def and expected_leaves
    for a, b in zip(found_leaves, expected_leaves, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype
        bound = rtol * np.maximum(1.0, np.abs(b))
        assert np.all(np.abs(a - b) <= bound), np.max(np.abs(a - b))


def losses(static, remat):
    """The loss through `fold` (the carry named `"layer_input"`, for the name-based policy)
    and through a Python loop over the layers."""

    def call(layer, x):
        return layer(checkpoint_name(x, "layer_input"))

    def lean(params, x):
        out = eqx_lean.fold(eqx.combine(params, static), x, call=call, remat=remat)
        return jnp.sum(jnp.sin(out))

    def loop(params, x):
        for layer in eqx_lean.unstack(eqx.combine(params, static)):
            x = layer(x)
        return jnp.sum(jnp.sin(x))

    return lean, loop


@pytest.mark.parametrize("remat", REMATS)
def test_gradients_equal_a_loop(mlp, remat):
    params, static, x = mlp
    lean, loop = losses(static, remat)
    expected = jax.jit(jax.grad(loop, argnums=(0, 1)))(params, x)
    assert_close(jax.jit(jax.grad(lean, argnums=(0, 1)))(params, x), expected)
    # Eagerly too, and with respect to a part of the stack alone (the rest frozen).
    first, rest = eqx.partition(params, lambda a: a.ndim == 3)
    only_first = jax.grad(lambda f: lean(eqx.combine(f, rest), x))(first)
    assert_close(only_first, eqx.filter(expected[0], lambda a: a.ndim == 3))


def test_second_order_and_vmap_equal_a_loop(mlp):
    params, static, x = mlp
    lean, loop = losses(static, True)
    batch = jnp.stack([x, 0.5 * x, -x])

    def both(transform, *args):
        assert_close(jax.jit(transform(lean))(*args), jax.jit(transform(loop))(*args))

    both(lambda f: jax.grad(lambda x: jnp.sum(jax.grad(f, argnums=1)(params, x) ** 2)), x)
    both(lambda f: jax.hessian(f, argnums=1), params, x)
    # The stack closed over by the vmapped function (the scan JAX differentiates), and batched.
    both(lambda f: jax.vmap(jax.grad(f), in_axes=(None, 0)), params, batch)
    both(lambda f: jax.grad(lambda p: jnp.sum(jax.vmap(lambda v: f(p, v))(batch))), params)
    stacks = jax.tree.map(lambda a: jnp.stack([a, 1.5 * a, -a]), params)
    both(lambda f: jax.vmap(jax.grad(f, argnums=(0, 1))), stacks, batch)


def test_scan_with_xs_and_a_pytree_carry_equals_a_loop(mlp):
    params, static, x = mlp
    scales = jnp.linspace(0.5, 1.5, NUM_LAYERS)
    steps = jnp.arange(NUM_LAYERS)  # an integer `xs` leaf, and an integer in the carry

    def call(layer, carry, xs):
        h, count = carry
        scale, step = xs
        h = layer(h) * scale
        return (h, count + step), jnp.sum(h)

    def lean(params, h, scales):
        stack = eqx.combine(params, static)
        (h, count), ys = eqx_lean.scan(stack, (h, jnp.int32(0)), (scales, steps), call=call)
        return jnp.sum(jnp.sin(h)) + jnp.sum(ys**2) + count.astype(jnp.float32)

    def loop(params, h, scales):
        carry, ys = (h, jnp.int32(0)), []
        for i, layer in enumerate(eqx_lean.unstack(eqx.combine(params, static))):
            carry, y = call(layer, carry, (scales[i], steps[i]))
            ys.append(y)
        return (
            jnp.sum(jnp.sin(carry[0])) + jnp.sum(jnp.stack(ys) ** 2) + carry[1].astype(jnp.float32)
        )

    grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2)))  # noqa: E731
    assert_close(grad(lean)(params, x, scales), grad(loop)(params, x, scales))


@pytest.mark.parametrize("which", ["fold", "scan"])
@pytest.mark.parametrize("mode", ["jvp", "jacfwd"])
def test_forward_mode_is_refused_by_name(mlp, which, mode):
    params, static, x = mlp
    stack = eqx.combine(params, static)

    def f(x):
        if which == "fold":
            return eqx_lean.fold(stack, x)
        return eqx_lean.scan(stack, x, call=lambda layer, h, _: (layer(h), None))[0]

    run = {"jvp": lambda: jax.jvp(f, (x,), (x,)), "jacfwd": lambda: jax.jacfwd(f)(x)}[mode]
    with pytest.raises(TypeError, match=rf"`eqx_lean\.{which}` cannot be .* forward mode"):
        run()


# Issue 46's benchmark (`benchmarks/scan_public_vjp.py`): 16 layers of 2048 x 2048 bfloat16
# weights (a 128 MiB stack), rank-8 float32 adapters, 4 examples of 2048. Compiled only.
BENCH_LAYERS, BENCH_DIM, BENCH_RANK, BENCH_BATCH = 16, 2048, 8, 4
# Issue 46's bar: what the library needed on JAX 0.10 before (the scan JAX differentiates),
# against 1,032 MiB for the custom VJP batched per example.
VMAP_OF_GRADIENT_BAR = int(272.78 * 2**20)


class LoraLinear(eqx.Module):
    weight: Any  # `ShapeDtypeStruct`s: compiled, never run
    lora_a: Any
    lora_b: Any

    def __call__(self, x):
        base = x @ self.weight.astype(jnp.float32).T
        return jnp.tanh(base + (x @ self.lora_a.T) @ self.lora_b.T)


def bench_stack(trainable):
    """Issue 46's benchmark stack as `ShapeDtypeStruct`s, split into trained and frozen."""
    struct = jax.ShapeDtypeStruct
    stack = LoraLinear(
        struct((BENCH_LAYERS, BENCH_DIM, BENCH_DIM), jnp.bfloat16),
        struct((BENCH_LAYERS, BENCH_RANK, BENCH_DIM), jnp.float32),
        struct((BENCH_LAYERS, BENCH_DIM, BENCH_RANK), jnp.float32),
    )
    if trainable == "adapters":
        return eqx.partition(stack, lambda a: a.dtype == jnp.float32)
    return eqx.partition(stack, lambda _: True)


def temporaries(gradient, trainable, batch_shape):
    train, frozen = bench_stack(trainable)
    examples = jax.ShapeDtypeStruct(batch_shape, jnp.float32)
    analysis = jax.jit(gradient).lower(train, frozen, examples).compile().memory_analysis()
    assert analysis is not None  # XLA:CPU always reports it
    return analysis.temp_size_in_bytes


# Issue 46's bar for the public path: a quarter of the bfloat16 stack (the private primitive's
# plan is 16.75 MiB; JAX's derivative of the scan over the stack needed 272.75).
QUARTER_OF_THE_BFLOAT16_STACK = BENCH_LAYERS * BENCH_DIM * BENCH_DIM * 2 // 4  # 32 MiB


@pytest.mark.xla_cpu  # an XLA:CPU plan
@pytest.mark.parametrize("trainable", ["adapters", "whole"])
def test_gradient_temporaries_at_most_a_quarter_of_the_bfloat16_stack(trainable):
    def gradient(train, frozen, x):
        loss = lambda t: jnp.sum(eqx_lean.fold(eqx.combine(t, frozen), x, remat=True) ** 2)  # noqa: E731
        return jax.grad(loss)(train)

    temp = temporaries(gradient, trainable, (BENCH_BATCH, BENCH_DIM))
    assert temp <= QUARTER_OF_THE_BFLOAT16_STACK, temp / 2**20


@pytest.mark.xla_cpu  # an XLA:CPU plan
@pytest.mark.parametrize("trainable", ["adapters", "whole"])
def test_vmap_of_a_gradient_over_a_closed_over_stack_keeps_its_memory(trainable):
    def gradient(train, frozen, xs):
        def loss(train):
            stack = eqx.combine(train, frozen)  # closed over by the vmapped function
            per_example = lambda v: jnp.sum(eqx_lean.fold(stack, v, remat=True) ** 2)  # noqa: E731
            return jnp.sum(jax.vmap(per_example)(xs))

        return jax.grad(loss)(train)

    temp = temporaries(gradient, trainable, (BENCH_BATCH, BENCH_DIM))
    assert temp <= VMAP_OF_GRADIENT_BAR, temp / 2**20


def test_per_example_parameters_over_a_shared_frozen_stack_equal_a_loop(mlp):
    # A part of the stack batched (one copy per example, differentiated), the rest shared and
    # frozen (closed over): the custom VJP, batched, as on the private path.
    params, static, x = mlp
    batch = jnp.stack([x, 0.5 * x, -x])
    biases, weights = eqx.partition(params, lambda a: a.ndim == 2)
    per_example = jax.tree.map(lambda a: jnp.stack([a, 1.5 * a, -a]), biases)
    lean, loop = losses(static, True)

    def summed(f):
        def of(biases):
            each = lambda b, v: f(eqx.combine(b, weights), v)  # noqa: E731
            return jnp.sum(jax.vmap(each)(biases, batch))

        return jax.jit(jax.grad(of))

    assert_close(summed(lean)(per_example), summed(loop)(per_example))


@pytest.mark.xla_cpu  # an XLA:CPU plan
def test_vmap_of_per_example_adapters_over_a_shared_frozen_stack_stays_lean():
    # Only a frozen leaf is unbatched, so the batched custom VJP is taken: 17.09 MiB, as on the
    # private path; JAX's derivative of the scan over the stack needed 281 MiB.
    train, frozen = bench_stack("adapters")
    per_example = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((BENCH_BATCH, *a.shape), a.dtype), train
    )

    def gradient(train, frozen, xs):
        def loss(train):
            each = lambda t, v: jnp.sum(  # noqa: E731
                eqx_lean.fold(eqx.combine(t, frozen), v, remat=True) ** 2
            )
            return jnp.sum(jax.vmap(each)(train, xs))

        return jax.grad(loss)(train)

    examples = jax.ShapeDtypeStruct((BENCH_BATCH, BENCH_DIM), jnp.float32)
    analysis = jax.jit(gradient).lower(per_example, frozen, examples).compile().memory_analysis()
    assert analysis is not None  # XLA:CPU always reports it
    temp = analysis.temp_size_in_bytes
    assert temp <= QUARTER_OF_THE_BFLOAT16_STACK, temp / 2**20
