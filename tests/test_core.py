"""The core engine: compiled writes reused by content (`_core/program.py`, `_core/writes.py`).

A compiled write must be reused exactly when the traced program is the same: changed Python
state gives new values (bitwise those of `filter_vmap`), an identical fresh function compiles
nothing, and no cache keeps the user's function or arrays alive. The sharding checks run on the
first two of the suite's eight CPU devices.
"""

import dataclasses
import gc
import logging
import threading
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import TINY_BLOCK, GPTBlock, assert_bitwise_equal, bits, keys_of, mesh_of
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding
from jaxtyping import Array

import eqx_lean
from eqx_lean.internal import (
    EMBED_MAX_BYTES,
    WRITES,
    CompiledCache,
    jaxpr_key,
    plan_build,
    trace_layer,
    value_key,
)


# --- stale state: every way Python state reaches the program --------------------------------

SETTINGS = {"scale": 1.0}
GLOBAL_SCALE = 1.0


def test_a_changed_dict_value_gives_new_values():
    def make(key):
        return {"w": jax.random.normal(key, (8, 8)) * SETTINGS["scale"]}

    keys = keys_of(3)
    try:
        first = eqx_lean.build_stacked(make, keys)
        SETTINGS["scale"] = 3.0
        second = eqx_lean.build_stacked(make, keys)
    finally:
        SETTINGS["scale"] = 1.0
    assert not np.array_equal(bits(first["w"]), bits(second["w"]))
    SETTINGS["scale"] = 3.0
    try:
        assert_bitwise_equal(second, eqx.filter_jit(eqx.filter_vmap(make))(keys))
    finally:
        SETTINGS["scale"] = 1.0


def test_a_changed_module_global_gives_new_values():
    global GLOBAL_SCALE

    def make(key):
        return jax.random.normal(key, (8, 8)) * GLOBAL_SCALE

    keys = keys_of(3)
    first = eqx_lean.build_stacked(make, keys)
    GLOBAL_SCALE = 0.5
    try:
        second = eqx_lean.build_stacked(make, keys)
        assert_bitwise_equal(second, eqx.filter_jit(eqx.filter_vmap(make))(keys))
    finally:
        GLOBAL_SCALE = 1.0
    assert not np.array_equal(bits(first), bits(second))


@dataclasses.dataclass(frozen=True)
class Factory:
    """Equal by `width` alone: `scale` does not take part in `==` or `hash`."""

    width: int
    scale: float = dataclasses.field(compare=False, default=1.0)

    def __call__(self, key):
        return eqx.nn.Linear(self.width, self.width, key=key, dtype=jnp.float32), self.scale


def test_a_field_excluded_from_equality_still_gives_new_values():
    def make_scaled(factory):
        def make(key):
            linear, scale = factory(key)
            return eqx.tree_at(lambda m: m.weight, linear, linear.weight * scale)

        return make

    keys = keys_of(3)
    one, two = Factory(8, 1.0), Factory(8, 2.0)
    assert one == two and hash(one) == hash(two)
    first = eqx_lean.build_stacked(make_scaled(one), keys)
    second = eqx_lean.build_stacked(make_scaled(two), keys)
    np.testing.assert_array_equal(second.weight, 2 * first.weight)
    expected = eqx.filter_jit(eqx.filter_vmap(make_scaled(two)))(keys)
    assert_bitwise_equal(second, expected)


def test_a_captured_numpy_array_updated_in_place_gives_new_values():
    offset = np.zeros((8, 8), np.float32)

    def make(key):
        return jax.random.normal(key, (8, 8)) + jnp.asarray(offset)

    keys = keys_of(3)
    first = eqx_lean.build_stacked(make, keys)
    offset += 1.0
    second = eqx_lean.build_stacked(make, keys)
    assert_bitwise_equal(second, eqx.filter_jit(eqx.filter_vmap(make))(keys))
    assert not np.array_equal(bits(first), bits(second))


def test_a_large_captured_array_is_an_argument_and_updated_in_place_gives_new_values():
    # Larger than `EMBED_MAX_BYTES`: passed to the compiled writes, never embedded.
    side = 1024
    assert side * side * 4 > EMBED_MAX_BYTES
    offset = np.zeros((side, side), np.float32)

    def make(key):
        return jax.random.uniform(key, (side, side)) + jnp.asarray(offset)

    keys = keys_of(2)
    first = eqx_lean.build_stacked(make, keys)
    offset += 4.0
    second = eqx_lean.build_stacked(make, keys)
    np.testing.assert_allclose(second, first + 4.0, rtol=1e-6)
    plan = plan_build(make, keys)
    assert plan.program.embedded == (False,)


# --- reuse by content -------------------------------------------------------------------------


def test_a_fresh_function_of_the_same_content_compiles_nothing(compiles):
    keys = keys_of(TINY_BLOCK.num_layers)
    first = eqx_lean.build_stacked(lambda k: GPTBlock(TINY_BLOCK, key=k), keys, jnp.bfloat16)
    before = compiles.count
    second = eqx_lean.build_stacked(lambda k: GPTBlock(TINY_BLOCK, key=k), keys, jnp.bfloat16)
    assert compiles.count == before
    assert_bitwise_equal(first, second)


def test_a_layer_with_custom_derivatives_compiles_once(compiles):
    # `custom_jvp`/`custom_vjp` equations carry derivative rules that each trace makes afresh;
    # compiled writes never differentiate, so only the forward program is keyed.
    @jax.custom_vjp
    def doubled(x):
        return 2.0 * x

    doubled.defvjp(lambda x: (2.0 * x, None), lambda _, g: (2.0 * g,))

    def make(key):
        w = jax.random.normal(key, (8, 4))
        return {"relu": jax.nn.relu(w), "doubled": doubled(w)}

    keys = keys_of(3)
    first = eqx_lean.build_stacked(lambda k: make(k), keys)
    before = compiles.count
    second = eqx_lean.build_stacked(lambda k: make(k), keys)
    assert compiles.count == before
    expected = eqx.filter_vmap(make)(keys)
    assert_bitwise_equal(first, expected)
    assert_bitwise_equal(second, expected)


def test_derivative_rules_are_left_out_of_the_key_and_the_forward_program_is_not():
    relu = jaxpr_key(jax.make_jaxpr(jax.nn.relu)(1.0).jaxpr)
    assert relu == jaxpr_key(jax.make_jaxpr(jax.nn.relu)(1.0).jaxpr)
    assert relu != jaxpr_key(jax.make_jaxpr(jax.nn.relu6)(1.0).jaxpr)


def test_a_different_dtype_compiles_again(compiles):
    keys = keys_of(TINY_BLOCK.num_layers)
    eqx_lean.build_stacked(lambda k: GPTBlock(TINY_BLOCK, key=k), keys, jnp.bfloat16)
    before = compiles.count
    eqx_lean.build_stacked(lambda k: GPTBlock(TINY_BLOCK, key=k), keys, jnp.float16)
    assert compiles.count > before


# Builds of one layer function under shardings of the same shapes and dtype, in order, on the
# first two devices.
SHARDING_BUILDS = ["split", "split", "replicated", "device-0", "device-1", "device-1"]


class WriteCompilations(logging.Handler):
    """Counts the XLA compilations of `build_stacked`'s writes that `jax.log_compiles` logs."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Compiling jit(write_layers)"):
            self.count += 1


@pytest.mark.cpu_mesh
def test_a_different_sharding_compiles_again_and_the_same_does_not():
    """A compiled write is reused for the same sharding only: splitting the rows over both
    devices, replicating them, or placing them on either device compiles a write of its own."""
    devices = jax.devices()[:2]
    mesh = mesh_of((2,), ("data",))

    def make(key):
        return jax.random.normal(key, (8, 8))

    keys = keys_of(3)
    expected = np.asarray(eqx.filter_vmap(make)(keys))
    # Each per-layer sharding, and the sharding its stack (layers first) must have.
    shardings = {
        "split": (NamedSharding(mesh, P("data")), NamedSharding(mesh, P(None, "data"))),
        "replicated": (NamedSharding(mesh, P()), NamedSharding(mesh, P())),
        "device-0": (SingleDeviceSharding(devices[0]),) * 2,
        "device-1": (SingleDeviceSharding(devices[1]),) * 2,
    }
    # Earlier tests in this process may have compiled this write (`build_stacked(make, keys)`
    # is placed on device 0): start from no compiled writes, so that each sharding's first
    # build must compile. Each `make_layer` jits a fresh `write_layers`, so JAX's own caches
    # never hold one of these writes.
    eqx_lean.clear_caches()
    counter = WriteCompilations()
    jax_logger = logging.getLogger("jax")
    jax_logger.addHandler(counter)
    compiled = []
    try:
        for name in SHARDING_BUILDS:
            layer, stacked = shardings[name]
            before = counter.count
            with jax.log_compiles():
                built = jax.block_until_ready(eqx_lean.build_stacked(make, keys, sharding=layer))
            compiled.append(counter.count - before)
            # Bitwise `filter_vmap`'s values, laid out as asked: a write compiled for another
            # sharding, if reused, would fail here (or when called). By value: `jax.typeof`
            # names the sharding on Explicit axes, which `expected` does not have.
            assert built.dtype == expected.dtype, name
            np.testing.assert_array_equal(bits(built), bits(expected), err_msg=name)
            placed = built.sharding.devices_indices_map(built.shape)
            assert placed == stacked.devices_indices_map(built.shape), name
    finally:
        jax_logger.removeHandler(counter)
    # The layer is one leaf, so one write: compiled at each sharding's first build, not again.
    assert compiled == [1, 0, 1, 1, 1, 0]


@pytest.mark.parametrize("partitionable", [False, True])
def test_settings_that_change_values_are_part_of_the_key(partitionable):
    # `jax_threefry_partitionable` is read when the program is lowered, not when it is traced.
    def make(key):
        return jax.random.normal(key, (4, 300))

    keys = keys_of(2)
    with jax.threefry_partitionable(not partitionable):
        eqx_lean.build_stacked(make, keys)
    with jax.threefry_partitionable(partitionable):
        built = eqx_lean.build_stacked(make, keys)
        expected = eqx.filter_jit(eqx.filter_vmap(make))(keys)
    assert_bitwise_equal(built, expected)


def _make_with_captured_array(side: int):
    offset = jnp.ones((side, side))

    def make(key):
        return jax.random.normal(key, (side, side)) + offset

    return make, weakref.ref(offset)


@pytest.mark.parametrize("side", [64, 1024], ids=["embedded", "argument"])
def test_no_cache_keeps_a_closed_over_array_alive(side):
    make, alive = _make_with_captured_array(side)
    jax.block_until_ready(eqx_lean.build_stacked(make, keys_of(2)))
    assert alive() is not None
    del make
    gc.collect()
    assert alive() is None


def test_no_cache_keeps_the_function_alive():
    class Maker:
        def __call__(self, key):
            return jax.random.normal(key, (4, 4))

    maker = Maker()
    alive = weakref.ref(maker)
    jax.block_until_ready(eqx_lean.build_stacked(maker, keys_of(2)))
    del maker
    gc.collect()
    assert alive() is None


def test_clear_caches_forgets_the_writes(compiles):
    keys = keys_of(TINY_BLOCK.num_layers)
    eqx_lean.build_stacked(lambda k: GPTBlock(TINY_BLOCK, key=k), keys)
    assert len(WRITES) > 0
    eqx_lean.clear_caches()
    assert len(WRITES) == 0
    before = compiles.count
    eqx_lean.build_stacked(lambda k: GPTBlock(TINY_BLOCK, key=k), keys)
    assert compiles.count > before


def test_the_cache_is_bounded_least_recently_used_first():
    cache = CompiledCache(max_entries=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the least recently used
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3
    assert len(cache) == 2


def test_concurrent_builds_agree():
    keys = keys_of(TINY_BLOCK.num_layers)
    results: list = [None] * 4
    errors: list = []

    def build(i):
        try:
            results[i] = eqx_lean.build_stacked(
                lambda k: GPTBlock(TINY_BLOCK, key=k), keys, jnp.bfloat16
            )
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    eqx_lean.clear_caches()
    threads = [threading.Thread(target=build, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for other in results[1:]:
        assert_bitwise_equal(results[0], other)


# --- the program's key --------------------------------------------------------------------------


def trace(make, shape=()):
    return trace_layer(make, jax.ShapeDtypeStruct(shape, jax.random.key(0).dtype))


def test_equal_programs_have_equal_keys_and_others_do_not():
    def scaled(scale):
        return lambda key: jax.random.normal(key, (4,)) * scale

    assert trace(scaled(2.0)).key == trace(scaled(2.0)).key
    assert trace(scaled(2.0)).key != trace(scaled(3.0)).key
    # 0.0 == -0.0 in Python, but they are different programs.
    assert trace(scaled(0.0)).key != trace(scaled(-0.0)).key
    # nan != nan in Python, but the same program.
    assert trace(scaled(float("nan"))).key == trace(scaled(float("nan"))).key


def test_functions_in_parameters_are_compared_by_identity():
    def one(x):
        return x

    def same_code(x):
        return x

    assert value_key(one) == value_key(one)
    assert value_key(one) != value_key(same_code)
    # Value types are compared by value, whichever object holds them.
    assert value_key(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("a",))) == value_key(
        jax.sharding.Mesh(np.array(jax.devices()[:1]), ("a",))
    )


def test_a_host_callback_in_make_layer_gives_its_current_values():
    def with_rule(rule):
        def make(key):
            x = jax.random.normal(key, (4,))
            return jax.pure_callback(rule, jax.ShapeDtypeStruct((4,), jnp.float32), x)

        return make

    def one(x):
        return np.asarray(x)

    def two(x):
        return np.asarray(x) * 2

    keys = keys_of(2)
    first = eqx_lean.build_stacked(with_rule(one), keys)
    second = eqx_lean.build_stacked(with_rule(two), keys)
    np.testing.assert_array_equal(second, 2 * first)


# --- messages ---------------------------------------------------------------------------------


class Numbered(eqx.Module):
    weight: Array

    def __init__(self, size: int, *, key):
        self.weight = jax.random.normal(key, (size,))


def test_a_class_as_make_layer_gets_advice():
    with pytest.raises(TypeError, match=r"lambda key: Numbered\(config, key=key\)"):
        eqx_lean.build_stacked(Numbered, keys_of(2))  # pyright: ignore[reportArgumentType]


def test_an_error_raised_by_make_layer_reaches_the_user_unchanged():
    class Broken(Exception):
        pass

    def make(key):
        raise Broken("my own bug")

    with pytest.raises(Broken, match="my own bug"):
        eqx_lean.build_stacked(make, keys_of(2))


def test_a_value_error_from_make_layer_is_not_turned_into_a_tracing_error():
    def make(key):
        return eqx.nn.Linear(-1, 2, key=key)

    with pytest.raises(ValueError) as info:
        eqx_lean.build_stacked(make, keys_of(2))
    assert "must be traceable" not in str(info.value)
