"""The shared helpers of `eqx_lean/_core/layout.py`: the struct of a value and its bytes.

Every expected value is written out by hand (shape times item size), not computed by the helper
under test.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from eqx_lean.internal import layer_struct, shard_bytes, struct_bytes, struct_of, tree_bytes


def test_struct_bytes_of_arrays_structs_avals_and_keys():
    assert struct_bytes(np.zeros((3, 5), np.float32)) == 60
    assert struct_bytes(jnp.zeros((7,), jnp.bfloat16)) == 14
    assert struct_bytes(jax.ShapeDtypeStruct((2, 3, 4), jnp.int8)) == 24
    assert struct_bytes(jax.ShapeDtypeStruct((), jnp.float32)) == 4
    assert struct_bytes(jax.ShapeDtypeStruct((0, 9), jnp.float32)) == 0
    # An abstract value of a jaxpr, and Threefry keys (two uint32 words each).
    (aval,) = jax.make_jaxpr(lambda x: x * 2)(jnp.zeros((4, 4))).out_avals
    assert struct_bytes(aval) == 64
    assert struct_bytes(jax.random.split(jax.random.key(0), 3)) == 24


def test_shard_bytes_of_one_device_share():
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    struct = jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    # One device: its shard is the whole array, from the struct's own sharding or a given one.
    assert shard_bytes(struct) == 192
    assert shard_bytes(jax.ShapeDtypeStruct((8, 6), jnp.float32)) == 192

    class Halves:  # a sharding of two devices along the first axis, as `shard_shape` sees it
        def shard_shape(self, shape):
            return (shape[0] // 2, *shape[1:])

    assert shard_bytes(struct, Halves()) == 96  # pyright: ignore[reportArgumentType]


def test_tree_bytes_counts_array_leaves_only():
    tree = {
        "linear": eqx.nn.Linear(3, 2, key=jax.random.key(0)),  # weight 2x3 and bias 2, float32
        "struct": jax.ShapeDtypeStruct((5,), jnp.int16),
        "numpy": np.zeros((2, 2), np.float64),
        "number": 1.5,
        "nothing": None,
        "function": jnp.tanh,
    }
    assert tree_bytes(tree) == 4 * 6 + 4 * 2 + 2 * 5 + 8 * 4
    assert tree_bytes(None) == 0
    assert tree_bytes([]) == 0


def test_struct_of_keeps_the_weak_type_and_places_on_a_given_sharding():
    weak = jnp.asarray(1.0) * 2  # a Python scalar's weak type survives the product
    assert struct_of(weak) == jax.ShapeDtypeStruct((), jnp.float32, weak_type=True)
    assert struct_of(np.zeros((2, 3), np.int8)) == jax.ShapeDtypeStruct((2, 3), jnp.int8)
    (aval,) = jax.make_jaxpr(lambda x: x + 1)(jnp.zeros((4,), jnp.bfloat16)).out_avals
    assert struct_of(aval) == jax.ShapeDtypeStruct((4,), jnp.bfloat16)

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    placed = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    # Without a sharding a struct is returned as is; with one, that sharding replaces its own.
    assert struct_of(placed) is placed
    moved = struct_of(placed, device)
    assert (moved.shape, moved.dtype, moved.sharding) == ((8,), jnp.float32, device)
    on_device = struct_of(weak, device)
    assert (on_device.weak_type, on_device.sharding) == (True, device)


def test_layer_struct_drops_the_layer_axis_the_weak_type_and_the_sharding():
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    sharding = NamedSharding(mesh, P(None, "data"))
    stacked = jax.ShapeDtypeStruct((5, 4, 3), jnp.bfloat16, weak_type=True, sharding=sharding)
    assert layer_struct(stacked) == jax.ShapeDtypeStruct((4, 3), jnp.bfloat16)
    assert layer_struct(jnp.zeros((2, 7), jnp.int32)) == jax.ShapeDtypeStruct((7,), jnp.int32)
    keys = jax.random.split(jax.random.key(0), 6)
    assert layer_struct(keys) == jax.ShapeDtypeStruct((), jax.random.key(1).dtype)
