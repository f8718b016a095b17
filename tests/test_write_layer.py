"""`eqx_lean.write_layer`: one layer written into a stacked pytree in place."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_lean


def stacked_linears(dtype=jnp.bfloat16, layers: int = 4):
    keys = jax.random.split(jax.random.key(0), layers)
    return eqx_lean.build_stacked(lambda k: eqx.nn.Linear(3, 5, key=k), keys, dtype)


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(f"uint{8 * x.dtype.itemsize}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_writes_one_layer_bitwise_as_the_cast(dtype):
    stacked = stacked_linears(dtype)
    before = jax.tree.map(np.asarray, stacked)
    layer = eqx.nn.Linear(3, 5, key=jax.random.key(7))
    # Values that a cast must keep exactly: -0.0, infinities, a NaN.
    weight = layer.weight.at[0, :3].set(jnp.array([-0.0, jnp.inf, jnp.nan]))
    layer = eqx.tree_at(lambda m: m.weight, layer, weight)
    out = eqx_lean.write_layer(stacked, layer, 2)
    assert type(out) is eqx.nn.Linear and out.weight.dtype == dtype
    for got, old, new in [(out.weight, before.weight, weight), (out.bias, before.bias, layer.bias)]:
        np.testing.assert_array_equal(bits(got[2]), bits(new.astype(dtype)))
        for i in (0, 1, 3):  # the other layers are untouched
            np.testing.assert_array_equal(bits(got[i]), bits(old[i]))


def test_updates_in_place_and_consumes_the_stack():
    stacked = stacked_linears()
    pointer = stacked.weight.unsafe_buffer_pointer()
    out = eqx_lean.write_layer(stacked, eqx.nn.Linear(3, 5, key=jax.random.key(1)), 0)
    assert out.weight.unsafe_buffer_pointer() == pointer
    assert stacked.bias is not None
    assert stacked.weight.is_deleted() and stacked.bias.is_deleted()


def test_none_leaves_are_kept_and_not_donated():
    stacked = stacked_linears()
    bias = np.asarray(stacked.bias)
    layer = eqx.tree_at(
        lambda m: m.bias,
        eqx.nn.Linear(3, 5, key=jax.random.key(1)),
        None,
        is_leaf=lambda x: x is None,
    )
    out = eqx_lean.write_layer(stacked, layer, 1)
    assert stacked.bias is not None and out.bias is stacked.bias
    assert not stacked.bias.is_deleted()
    np.testing.assert_array_equal(bits(out.bias), bits(bias))


def test_a_plain_stacked_array():
    stacked = jnp.zeros((3, 2), jnp.bfloat16)
    out = eqx_lean.write_layer(stacked, np.array([1.5, -2.0], np.float32), 1)
    np.testing.assert_array_equal(np.asarray(out, np.float32), [[0, 0], [1.5, -2.0], [0, 0]])


def test_bad_arguments_are_named_and_nothing_is_written():
    stacked = stacked_linears()
    layer = eqx.nn.Linear(3, 5, key=jax.random.key(1))
    with pytest.raises(IndexError, match=r"`index` must be in \[0, 4\) for leaf \.weight"):
        eqx_lean.write_layer(stacked, layer, 4)
    with pytest.raises(TypeError, match="`index` must be a Python int"):
        eqx_lean.write_layer(stacked, layer, jnp.int32(1))  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="`layer` must have the structure"):
        eqx_lean.write_layer(stacked, jnp.zeros(3), 0)
    wrong = eqx.tree_at(lambda m: m.bias, layer, jnp.zeros(6))
    with pytest.raises(
        ValueError, match=r"`layer`'s leaf \.bias must have one layer's shape \[5\]"
    ):
        eqx_lean.write_layer(stacked, wrong, 0)
    # A refused write donated nothing: the stack is still whole.
    assert stacked.bias is not None
    assert not stacked.weight.is_deleted() and not stacked.bias.is_deleted()
    with pytest.raises(ValueError, match="must have a leading layer axis"):
        eqx_lean.write_layer(jnp.float32(1.0), jnp.float32(2.0), 0)
    with pytest.raises(ValueError, match="must hold at least one array"):
        eqx_lean.write_layer({"a": 1}, {"a": 1}, 0)
