"""`QuantizedLinear`, `quantize_linears` and `quantizing`: quantised bases computing through
`fold`, under LoRA, built one layer at a time, and refusing any other use."""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_lean
from eqx_lean.internal import (
    cast_floating,
    linear_product,
    quant_product,
    quantized_product,
    rows_per_chunk,
)
from eqx_lean.lora import LoraConfig, add_lora, lora_filter, merge_lora
from eqx_lean.quant import (
    QuantConfig,
    QuantizedArray,
    QuantizedLinear,
    dequantized_linear,
    quantize,
    quantize_linears,
    quantizing,
)


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(64, 96, key=k1)
        self.down = eqx.nn.Linear(96, 64, use_bias=False, key=k2)


def _block_call(block, x):
    up = block.up
    h = up.project(x) if hasattr(up, "project") else jax.vmap(up)(x)
    down = block.down
    return x + (
        down.project(jax.nn.gelu(h)) if hasattr(down, "project") else jax.vmap(down)(jax.nn.gelu(h))
    )


class Model(eqx.Module):
    blocks: Block
    lm_head: eqx.nn.Linear


def _model(dtype=jnp.bfloat16, layers=3):
    keys = jax.random.split(jax.random.key(0), layers)
    blocks = eqx_lean.build_stacked(Block, keys, dtype)
    head = eqx.nn.Linear(64, 10, use_bias=False, key=jax.random.key(1))
    return Model(blocks, cast_floating(head, dtype))


def _run(model, x):
    return eqx_lean.fold(model.blocks, x, call=_block_call)


def _dequantized(model):
    return jax.tree.map(
        lambda n: dequantized_linear(n) if isinstance(n, QuantizedLinear) else n,
        model,
        is_leaf=lambda n: isinstance(n, QuantizedLinear),
    )


def test_quantize_linears_selects_all_linear_but_the_head():
    q = quantize_linears(_model())
    up = q.blocks.up
    assert isinstance(up, QuantizedLinear) and isinstance(q.blocks.down, QuantizedLinear)
    assert isinstance(q.lm_head, eqx.nn.Linear)  # left unquantised, as transformers does
    weight = up.weight
    assert isinstance(weight, QuantizedArray)
    assert weight.shape == (3, 96, 64) and weight.batch_shape == (3,)
    assert weight.name == "blocks.up.weight"
    assert up.bias is not None and up.bias.dtype == jnp.bfloat16
    only_up = quantize_linears(_model(), QuantConfig("int8", target_modules=["up"]))
    up = only_up.blocks.up
    weight = up.weight
    assert isinstance(up, QuantizedLinear) and isinstance(weight, QuantizedArray)
    assert weight.scheme == "int8"
    assert isinstance(only_up.blocks.down, eqx.nn.Linear)
    with pytest.raises(
        ValueError, match=r"entries \['gate'\] name no module of `model`.*blocks.down"
    ):
        quantize_linears(_model(), QuantConfig(target_modules=["gate"]))


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
@pytest.mark.parametrize("double_quant", [False, True])
def test_fold_over_a_quantised_stack_equals_its_dequantised_model(
    double_quant, sliced, monkeypatch
):
    if sliced:  # products decoded 16 rows at a time
        monkeypatch.setattr(quant_product, "CHUNK_VALUES", 16 * 96)
    # The reference: plain eqx.nn.Linear layers holding the dequantised weights, run by fold.
    q = quantize_linears(_model(), QuantConfig(double_quant=double_quant))
    x = jax.random.normal(jax.random.key(2), (5, 64), jnp.bfloat16)
    got = jax.jit(_run)(q, x)
    want = jax.jit(_run)(_dequantized(q), x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # And a Python loop over the layers, one QuantizedArray sliced out at a time.
    loop = x
    for i in range(3):
        loop = _block_call(jax.tree.map(lambda a, i=i: a[i], q.blocks), loop)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(loop, np.float32))


def test_qlora_gradients_reach_the_adapters_only():
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    q = quantize_linears(_model(jnp.float32))
    lora = add_lora(q, config, key=jax.random.key(3))
    assert isinstance(lora.blocks.up.base, QuantizedLinear)
    # Nonzero B, so the adapters act.
    lora = eqx.tree_at(
        lambda m: m.blocks.up.lora_B, lora, jnp.full_like(lora.blocks.up.lora_B, 0.01)
    )
    reference = add_lora(_dequantized(q), config, key=jax.random.key(3))
    reference = eqx.tree_at(
        lambda m: m.blocks.up.lora_B, reference, jnp.full_like(reference.blocks.up.lora_B, 0.01)
    )
    x = jax.random.normal(jax.random.key(4), (5, 64), jnp.float32)

    def loss(model):
        return jnp.sum(_run(model, x) ** 2)

    spec = lora_filter(lora)
    grads = eqx.filter_jit(eqx.filter_grad(lambda a, b: loss(eqx.combine(a, b))))(
        *eqx.partition(lora, spec)
    )
    ref_spec = lora_filter(reference)
    ref_grads = eqx.filter_jit(eqx.filter_grad(lambda a, b: loss(eqx.combine(a, b))))(
        *eqx.partition(reference, ref_spec)
    )
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
    # Differentiating the whole model: the quantised weights have no inexact leaf, so no
    # gradient (None under eqx.filter_grad), while biases and adapters get theirs.
    whole = eqx.filter_jit(eqx.filter_grad(loss))(lora)
    assert all(
        leaf is None
        for leaf in jax.tree.leaves(whole.blocks.up.base.weight, is_leaf=lambda x: x is None)
    )
    assert whole.blocks.up.base.bias is not None and whole.blocks.up.lora_A is not None


def test_quantizing_builds_what_quantize_linears_makes_of_the_built_stack():
    keys = jax.random.split(jax.random.key(5), 4)
    config = QuantConfig(double_quant=True)
    built = eqx_lean.build_stacked(quantizing(Block, config, jnp.bfloat16), keys, jnp.bfloat16)
    reference = quantize_linears(eqx_lean.build_stacked(Block, keys, jnp.bfloat16), config)
    assert jax.tree.structure(built) == jax.tree.structure(reference)
    for a, b in zip(jax.tree.leaves(built), jax.tree.leaves(reference), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_quantised_weight_used_as_an_array_is_refused_by_name():
    class ReadsWeight(eqx.Module):
        up: eqx.nn.Linear

        def __call__(self, x):
            return self.up.weight @ x  # bypasses the layer

    model = quantize_linears(ReadsWeight(eqx.nn.Linear(64, 8, key=jax.random.key(0))))
    with pytest.raises(
        TypeError, match=r"`up.weight` is a nf4-quantised weight of shape \(8, 64\)"
    ):
        model(jnp.ones(64))
    # An eqx.nn.Linear given a QuantizedArray weight fails the same way.
    linear = eqx.nn.Linear(64, 8, key=jax.random.key(0))
    linear = eqx.tree_at(
        lambda m: m.weight, linear, eqx_lean.quant.quantize(linear.weight, name="w")
    )
    with pytest.raises(TypeError, match="`w` is a nf4-quantised weight"):
        linear(jnp.ones(64))


def test_merging_into_a_quantised_base_is_refused():
    lora = add_lora(
        quantize_linears(_model()), LoraConfig(r=2, target_modules=["up"]), key=jax.random.key(0)
    )
    with pytest.raises(ValueError, match=r"\.blocks\.up is a QuantizedLinear"):
        merge_lora(lora)


def test_quant_config_errors():
    with pytest.raises(ValueError, match="`scheme` must be 'nf4' or 'int8'"):
        QuantConfig("fp4")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="`blocksize` must be an even integer"):
        QuantConfig(blocksize=63)
    with pytest.raises(ValueError, match="`double_quant` applies to the nf4 scheme only"):
        QuantConfig("int8", double_quant=True)
    assert isinstance(QuantConfig().quantize(jnp.ones((4, 64))), QuantizedArray)


def _whole_product(x, weight):
    return linear_product(x, weight.dequantize().astype(x.dtype))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=str)
@pytest.mark.parametrize(
    ("scheme", "double_quant"), [("nf4", False), ("nf4", True), ("int8", False)], ids=str
)
def test_a_product_decoded_in_row_slices_equals_the_whole_one(
    scheme, double_quant, dtype, monkeypatch
):
    monkeypatch.setattr(quant_product, "CHUNK_VALUES", 1024)
    w = jax.random.normal(jax.random.key(5), (96, 64), jnp.float32).astype(dtype)
    q = quantize(w, scheme, double_quant=double_quant)
    assert rows_per_chunk(q) == 16  # 16 x 64 values a slice, 6 slices
    x = jax.random.normal(jax.random.key(6), (3, 5, 64), jnp.float32).astype(dtype)
    lowered = jax.jit(quantized_product).lower(x, q).as_text()
    assert "while" in lowered  # the slices are a loop, on CPU
    with jax.default_matmul_precision("highest"):
        got = np.asarray(jax.jit(quantized_product)(x, q), np.float32)
        want = np.asarray(jax.jit(_whole_product)(x, q), np.float32)
        if dtype == jnp.bfloat16:  # the float32 sums round to the same bfloat16
            np.testing.assert_array_equal(got, want)
        else:  # XLA:CPU orders a dot's float32 sum by the dot's shape: the last bits differ
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())

        # The gradient with respect to the input: the whole decoded weight, as `linear_product`,
        # so bitwise in both dtypes.
        def loss(product):
            return jax.grad(lambda x: jnp.sum(product(x, q).astype(jnp.float32) ** 2))

        got_grad = jax.jit(loss(quantized_product))(x)
        want_grad = jax.jit(loss(_whole_product))(x)
    assert got_grad.dtype == x.dtype
    np.testing.assert_array_equal(
        np.asarray(got_grad, np.float32), np.asarray(want_grad, np.float32)
    )


def test_slices_are_whole_blocks_and_rows_or_none():
    def rows(shape, scheme: Literal["nf4", "int8"] = "nf4"):
        weight = jax.eval_shape(lambda: quantize(jnp.zeros(shape, jnp.bfloat16), scheme))
        return rows_per_chunk(weight)

    assert rows((14336, 4096)) == 256  # 1 Mi values
    assert rows((4096, 14336)) == 64
    assert rows((1024, 1024)) is None  # small enough whole
    assert rows((2053, 1021)) is None  # 2053 is prime, and 1021 values are not whole blocks
    assert rows((2053, 1021), "int8") == 1  # int8 scales are per row: any row count


@pytest.mark.xla_cpu
def test_an_evaluated_product_never_holds_the_whole_decoded_weight():
    """XLA's CPU plan of a 4096 x 14336 NF4 product with 8 tokens: the decoded weight would be
    112 MiB of bfloat16; a slice is 2 MiB."""
    weight = jax.eval_shape(lambda: quantize(jnp.zeros((4096, 14336), jnp.bfloat16), "nf4"))
    x = jax.ShapeDtypeStruct((8, 14336), jnp.bfloat16)

    def temp_bytes(fn):
        analysis = jax.jit(fn).lower(x, weight).compile().memory_analysis()
        assert analysis is not None
        return analysis.temp_size_in_bytes

    decoded = 4096 * 14336 * 2
    assert temp_bytes(_whole_product) >= decoded
    assert temp_bytes(quantized_product) <= decoded / 16
