import json
import subprocess
import sys
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import SMALL_BLOCK, GPTBlock, GPTConfig, assert_bitwise_equal
from jaxtyping import Array, PRNGKeyArray

import eqx_lean
from eqx_lean.internal import (
    SMALL_GROUP_BYTES,
    Block,  # the benchmark's own block: its worker's figures are measured below
    BlockConfig,
    build_calls,
    compile_writes,
    leaf_groups,
    memory_analysis,
    plan_build,
    write_temp_bytes,
)


# --- layers under test -----------------------------------------------------------------------


def make_mlp(key):
    return eqx.nn.MLP(8, 5, 16, 2, key=key)


def make_block(key):
    return GPTBlock(SMALL_BLOCK, key=key)


def make_attention(key):
    return eqx.nn.MultiheadAttention(4, 16, key=key)


class WithIntegers(eqx.Module):
    """Integer, boolean and weakly typed leaves beside floating ones, and a static field."""

    weight: Array
    positions: Array
    token_ids: Array
    mask: Array
    scale: Array
    name: str = eqx.field(static=True)
    activation: Callable

    def __init__(self, *, key: PRNGKeyArray):
        kw, kt = jax.random.split(key)
        self.weight = jax.random.normal(kw, (6, 4))
        self.positions = jnp.arange(7)
        self.token_ids = jax.random.randint(kt, (3,), 0, 100)
        self.mask = jax.random.bernoulli(kt, 0.5, (5,))
        self.scale = jnp.asarray(0.5) * 2.0
        self.name = "with-integers"
        self.activation = jax.nn.gelu


def make_with_integers(key):
    return WithIntegers(key=key)


def make_every_draw(key):
    """A leaf for each way `jax.random` reaches Threefry, which the writes lower unrolled."""
    k = jax.random.split(key, 5)
    return {
        "normal": jax.random.normal(k[0], (33, 7)),
        "normal_large": jax.random.normal(k[0], (512, 300)),  # the unrolled, fused hash
        "uniform": jax.random.uniform(k[1], (5, 3), minval=-2.0, maxval=2.0),
        "truncated": jax.random.truncated_normal(k[2], -2.0, 2.0, (9,)),
        "folded": jax.random.normal(jax.random.fold_in(k[3], 7), (6,)),
        "bits": jax.random.bits(k[4], (4, 4), jnp.uint16),
        "permutation": jax.random.permutation(k[4], 10),
    }


LAYERS = [make_mlp, make_block, make_attention, make_with_integers, make_every_draw]


def cast_reference(tree, dtype):
    """`filter_vmap`'s output cast the way `build_stacked` documents, written independently."""

    def cast(path, x):
        if not eqx.is_array(x) or not jnp.issubdtype(x.dtype, jnp.floating) or dtype is None:
            return x
        target = dtype(path, x) if callable(dtype) and not isinstance(dtype, type) else dtype
        return x if target is None else x.astype(target)

    return jax.tree_util.tree_map_with_path(cast, tree)


def live_array_ids():
    return {id(x) for x in jax.live_arrays()}


# --- parity -----------------------------------------------------------------------------------


PARITY_CASES = [(make, dtype) for make in LAYERS for dtype in (None, jnp.bfloat16)] + [
    (make_block, jnp.float16),
    (make_with_integers, jnp.float32),
]


@pytest.mark.quick
@pytest.mark.parametrize("make_layer, dtype", PARITY_CASES)
def test_bitwise_parity_with_filter_vmap(make_layer, dtype):
    keys = jax.random.split(jax.random.key(1), 5)
    expected = cast_reference(eqx.filter_vmap(make_layer)(keys), dtype)
    actual = eqx_lean.build_stacked(make_layer, keys, dtype)
    assert type(actual) is type(expected)
    assert_bitwise_equal(actual, expected)


def test_parity_with_raw_uint32_keys():
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    assert keys.dtype == jnp.uint32
    expected = cast_reference(eqx.filter_vmap(make_block)(keys), jnp.bfloat16)
    assert_bitwise_equal(eqx_lean.build_stacked(make_block, keys, jnp.bfloat16), expected)


@pytest.mark.parametrize("make_layer", [make_block, make_every_draw])
def test_parity_without_partitionable_threefry(make_layer):
    keys = jax.random.split(jax.random.key(4), 3)
    with jax.threefry_partitionable(False):
        expected = cast_reference(eqx.filter_vmap(make_layer)(keys), jnp.bfloat16)
        actual = eqx_lean.build_stacked(make_layer, keys, jnp.bfloat16)
    assert_bitwise_equal(actual, expected)


def test_per_leaf_dtype_rule_keeps_norms_in_float32():
    seen = []

    def keep_norms(path, leaf):
        seen.append(leaf)
        return None if "norm" in jax.tree_util.keystr(path) else jnp.bfloat16

    keys = jax.random.split(jax.random.key(0), 4)
    actual = eqx_lean.build_stacked(make_block, keys, keep_norms)
    assert actual.attention_norm.weight is not None
    assert actual.attention_norm.weight.dtype == jnp.float32
    assert actual.mlp.down.weight.dtype == jnp.bfloat16
    # The rule sees one layer's leaves, without the layer axis.
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in seen)
    assert (SMALL_BLOCK.dim, SMALL_BLOCK.hidden) in [leaf.shape for leaf in seen]
    assert all(leaf.ndim <= 2 for leaf in seen)
    expected = cast_reference(eqx.filter_vmap(make_block)(keys), keep_norms)
    assert_bitwise_equal(actual, expected)


def test_weak_types_are_kept_unless_cast():
    keys = jax.random.split(jax.random.key(0), 3)
    kept = eqx_lean.build_stacked(make_with_integers, keys)
    assert jax.typeof(kept.scale) == jax.typeof(eqx.filter_vmap(make_with_integers)(keys).scale)
    assert kept.scale.weak_type
    assert not eqx_lean.build_stacked(make_with_integers, keys, jnp.float32).scale.weak_type


def test_integer_boolean_and_static_parts_are_untouched():
    keys = jax.random.split(jax.random.key(0), 3)
    stacked = eqx_lean.build_stacked(make_with_integers, keys, jnp.bfloat16)
    assert stacked.positions.dtype == jnp.int32
    assert stacked.mask.dtype == jnp.bool_
    assert stacked.name == "with-integers"
    assert stacked.activation is jax.nn.gelu
    np.testing.assert_array_equal(stacked.positions, np.tile(np.arange(7), (3, 1)))


def test_plain_pytree_layers():
    def make(key):
        return {"w": jax.random.normal(key, (3, 2)), "b": [jnp.zeros(2), 1.5, "tag"]}

    keys = jax.random.split(jax.random.key(0), 4)
    assert_bitwise_equal(eqx_lean.build_stacked(make, keys), eqx.filter_vmap(make)(keys))


def test_single_layer():
    keys = jax.random.split(jax.random.key(0), 1)
    expected = cast_reference(eqx.filter_vmap(make_mlp)(keys), jnp.bfloat16)
    assert_bitwise_equal(eqx_lean.build_stacked(make_mlp, keys, jnp.bfloat16), expected)


def test_arithmetic_after_draws_matches_compiled_filter_vmap():
    # Eager filter_vmap runs `w * 1.7 + noise` op by op, while a compiled layer may fuse it
    # into a multiply-add that rounds differently by an ulp; compiled filter_vmap fuses as well.
    offset = jnp.arange(6.0).reshape(2, 3)

    def make(key):
        return offset * 1.7 + jax.random.normal(key, (2, 3)) * 0.3

    keys = jax.random.split(jax.random.key(0), 16)
    expected = eqx.filter_jit(eqx.filter_vmap(make))(keys)
    assert_bitwise_equal(eqx_lean.build_stacked(make, keys), expected)


# --- compilation ------------------------------------------------------------------------------


COUNTED_BLOCK = GPTConfig(num_layers=1, dim=24, hidden=96, heads=4)


def _fresh_make_layer(traces):
    # A configuration no other test builds, so no cache is warm for either count.
    def make(key):
        traces.append(None)
        return GPTBlock(COUNTED_BLOCK, key=key)

    return make


def _build_counting(num_layers, compiles):
    traces = []
    keys = jax.random.split(jax.random.key(0), num_layers)
    jax.block_until_ready(keys)
    before = compiles.count
    jax.block_until_ready(eqx_lean.build_stacked(_fresh_make_layer(traces), keys, jnp.bfloat16))
    return compiles.count - before, len(traces)


def test_compilations_and_traces_do_not_grow_with_num_layers(compiles):
    few = _build_counting(4, compiles)
    many = _build_counting(64, compiles)
    assert few == many
    assert few[0] >= 1


def test_second_call_compiles_nothing(compiles):
    keys = jax.random.split(jax.random.key(0), 6)
    eqx_lean.build_stacked(make_block, keys, jnp.bfloat16)
    other_keys = jax.random.split(jax.random.key(1), 6)
    jax.block_until_ready(other_keys)
    before = compiles.count
    eqx_lean.build_stacked(make_block, other_keys, jnp.bfloat16)
    assert compiles.count == before


def _leaves_of_bytes(*sizes: int) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct((size // 4,), jnp.float32) for size in sizes]


MIB = 2**20


def test_large_leaves_are_grouped_no_larger_than_the_largest_leaf():
    sizes = [16 * MIB, 8 * MIB, 8 * MIB, 6 * MIB, 2 * MIB, 1 * MIB]
    groups = leaf_groups(_leaves_of_bytes(*sizes))
    assert sorted(j for group in groups for j in group) == list(range(len(sizes)))
    assert all(sum(sizes[j] for j in group) <= 16 * MIB for group in groups)
    # The two 8 MiB leaves fill a group; the rest pack around them, first fit.
    assert groups == ((0,), (1, 2), (3, 4, 5))


def test_small_leaves_share_one_group_up_to_the_small_group_bytes():
    assert SMALL_GROUP_BYTES == 4 * MIB
    # Leaves of a small layer: one group, so one compiled write, however many leaves.
    assert leaf_groups(_leaves_of_bytes(*[64 * 2**10] * 40)) == (tuple(range(40)),)
    # Past 4 MiB in all, a second group, still none larger than 4 MiB.
    groups = leaf_groups(_leaves_of_bytes(*[MIB] * 6))
    assert groups == ((0, 1, 2, 3), (4, 5))
    # A leaf larger than 4 MiB sets the bound, as before.
    assert leaf_groups(_leaves_of_bytes(6 * MIB, 3 * MIB, 3 * MIB)) == ((0,), (1, 2))


def test_a_small_block_is_written_by_one_compiled_write():
    keys = jax.random.split(jax.random.key(0), 2)
    plan = plan_build(make_block, keys, jnp.bfloat16)
    assert len(plan.layout.structs) > 1
    assert [group.leaves for group in plan.groups] == [tuple(range(len(plan.layout.structs)))]


def test_writes_alias_the_stacked_buffers():
    keys = jax.random.split(jax.random.key(0), 8)
    abstract = eqx.filter_eval_shape(make_block, keys[0])
    leaves = jax.tree.leaves(abstract)
    stacked_bytes = 8 * sum(x.size * 2 for x in leaves if isinstance(x, jax.ShapeDtypeStruct))
    plan = plan_build(make_block, keys, jnp.bfloat16, None, None)
    compiled = compile_writes(plan)
    for group, executable in zip(plan.groups, compiled, strict=True):
        analysis = memory_analysis(executable)
        group_bytes = sum(plan.structs[j].size * 2 for j in group.leaves)
        assert analysis.alias_size_in_bytes == group_bytes
        # Besides the aliased buffers, the output holds only a table of pointers.
        assert analysis.output_size_in_bytes - analysis.alias_size_in_bytes <= 8 * len(group.leaves)
    assert sum(s.size * s.dtype.itemsize for s in plan.structs) == stacked_bytes


# --- donation and ownership -------------------------------------------------------------------


def test_donation_never_deletes_arrays_captured_by_make_layer():
    shared = jnp.arange(6.0).reshape(2, 3)
    offset = jnp.ones((2, 3))

    def make(key):
        return {"shared": shared, "moved": shared + offset, "noise": jax.random.normal(key, (2, 3))}

    keys = jax.random.split(jax.random.key(0), 4)
    stacked = eqx_lean.build_stacked(make, keys)
    assert not shared.is_deleted() and not offset.is_deleted() and not keys.is_deleted()
    np.testing.assert_array_equal(shared, np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(stacked["shared"], np.broadcast_to(shared, (4, 2, 3)))
    assert_bitwise_equal(stacked, eqx.filter_vmap(make)(keys))


# --- inside outer transforms ------------------------------------------------------------------


def test_under_filter_eval_shape_allocates_nothing(compiles):
    keys = jax.random.split(jax.random.key(0), 32)
    jax.block_until_ready(keys)
    before_ids, before_compiles = live_array_ids(), compiles.count
    abstract = eqx.filter_eval_shape(eqx_lean.build_stacked, make_block, keys, jnp.bfloat16)
    assert live_array_ids() <= before_ids
    assert compiles.count == before_compiles
    weight = abstract.mlp.down.weight
    assert isinstance(weight, jax.ShapeDtypeStruct)
    assert weight.shape == (32, SMALL_BLOCK.dim, SMALL_BLOCK.hidden)
    assert weight.dtype == jnp.bfloat16
    assert abstract.attention.num_heads == SMALL_BLOCK.heads


def test_under_filter_jit_matches_eager():
    keys = jax.random.split(jax.random.key(2), 5)
    jitted = eqx.filter_jit(lambda k: eqx_lean.build_stacked(make_with_integers, k, jnp.bfloat16))
    assert_bitwise_equal(
        jitted(keys), eqx_lean.build_stacked(make_with_integers, keys, jnp.bfloat16)
    )


def test_under_jit_the_trace_does_not_unroll_layers():
    def count_traces(num_layers):
        traces = []
        make = _fresh_make_layer(traces)
        keys = jax.random.split(jax.random.key(0), num_layers)
        jaxpr = jax.make_jaxpr(lambda k: eqx_lean.build_stacked(make, k, jnp.bfloat16))(keys)
        return len(traces), len(str(jaxpr))

    few_traces, few_size = count_traces(2)
    many_traces, many_size = count_traces(64)
    assert few_traces == many_traces
    assert many_size < 1.05 * few_size


# --- progress ---------------------------------------------------------------------------------


def test_progress_bar_and_silence_by_default(capsys):
    keys = jax.random.split(jax.random.key(0), 3)
    eqx_lean.build_stacked(make_mlp, keys)
    quiet = capsys.readouterr()
    assert quiet.out == "" and quiet.err == ""
    eqx_lean.build_stacked(make_mlp, keys, progress=True)
    shown = capsys.readouterr()
    assert "build_stacked" in shown.err and "3/3" in shown.err


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "keys, error, match",
    [
        (jax.random.split(jax.random.key(0), 0), ValueError, "at least one key"),
        (jax.random.key(0), ValueError, "one leading layer axis"),
        (jax.random.split(jax.random.key(0), 6).reshape(2, 3), ValueError, "one leading layer"),
        (jnp.zeros((4, 3), jnp.uint32), ValueError, r"raw uint32 keys of shape \(num_layers, 2\)"),
        (jnp.zeros((4, 2), jnp.float32), ValueError, "typed key array"),
        ([jax.random.key(0)], TypeError, "`keys` must be a key array"),
    ],
)
def test_bad_keys(keys, error, match):
    with pytest.raises(error, match=match):
        eqx_lean.build_stacked(make_mlp, keys)


@pytest.mark.parametrize(
    "dtype, error, match",
    [
        (jnp.int32, ValueError, "`dtype` must be a floating dtype"),
        (jnp.complex64, ValueError, "`dtype` must be a floating dtype"),
        ("not-a-dtype", TypeError, "`dtype` must be a floating dtype"),
        (lambda path, leaf: "nonsense", TypeError, r"`dtype` rule's result for leaf \.layers"),
        (lambda path, leaf: jnp.int8, ValueError, r"`dtype` rule's result .* got int8"),
    ],
)
def test_bad_dtype(dtype, error, match):
    keys = jax.random.split(jax.random.key(0), 2)
    before = live_array_ids()
    with pytest.raises(error, match=match):
        eqx_lean.build_stacked(make_mlp, keys, dtype)
    assert live_array_ids() <= before


def test_make_layer_that_is_not_traceable():
    def concrete_only(key):
        seed = int(jax.random.key_data(key)[0])
        return eqx.nn.Linear(2, 2, key=jax.random.key(seed))

    keys = jax.random.split(jax.random.key(0), 2)
    with pytest.raises(TypeError, match="`make_layer` must be traceable"):
        eqx_lean.build_stacked(concrete_only, keys)


def test_make_layer_is_traced_once_per_build_like_filter_vmap():
    # Every layer comes from one trace of `make_layer` (as with `filter_vmap`), so static parts
    # cannot differ between layers; each build traces afresh, reading Python state anew.
    calls = []

    class Numbered(eqx.Module):
        weight: Array
        number: int = eqx.field(static=True)

    def make(key):
        calls.append(None)
        return Numbered(jax.random.normal(key, (2,)), len(calls))

    keys = jax.random.split(jax.random.key(0), 3)
    first = eqx_lean.build_stacked(make, keys)
    assert len(calls) == 1 and first.number == 1
    second = eqx_lean.build_stacked(make, keys)
    assert len(calls) == 2 and second.number == 2
    np.testing.assert_array_equal(first.weight, second.weight)
    calls.clear()
    assert_bitwise_equal(first, eqx.filter_vmap(make)(keys))


def test_failure_midway_frees_the_buffers(monkeypatch):
    keys = jax.random.split(jax.random.key(0), 6)
    jax.block_until_ready(keys)
    eqx_lean.build_stacked(make_block, keys)  # compile first, so only the build is compared

    def failing_runs(num_layers, per_call, progress):
        yield 0, 1
        yield 1, 2
        raise KeyboardInterrupt

    monkeypatch.setattr(build_calls, "_runs", failing_runs)
    before = live_array_ids()
    with pytest.raises(KeyboardInterrupt):
        eqx_lean.build_stacked(make_block, keys)
    assert live_array_ids() <= before


# --- allocate_stacked -------------------------------------------------------------------------


def test_allocate_stacked_from_abstract_layer():
    abstract = eqx.filter_eval_shape(make_with_integers, jax.random.key(0))
    stacked = eqx_lean.allocate_stacked(abstract, 5, jnp.bfloat16)
    assert stacked.weight.shape == (5, 6, 4) and stacked.weight.dtype == jnp.bfloat16
    assert stacked.positions.shape == (5, 7) and stacked.positions.dtype == jnp.int32
    assert stacked.name == "with-integers"
    for leaf in jax.tree.leaves(eqx.filter(stacked, eqx.is_array)):
        assert not np.asarray(leaf).any()


def test_allocate_stacked_from_concrete_layer_keeps_dtypes():
    layer = make_mlp(jax.random.key(0))
    stacked = eqx_lean.allocate_stacked(layer, 3)
    expected = eqx.filter_vmap(make_mlp)(jax.random.split(jax.random.key(0), 3))
    for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(expected), strict=True):
        if eqx.is_array(b):
            assert jax.typeof(a) == jax.typeof(b)


@pytest.mark.parametrize(
    "num_layers, error", [(0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)]
)
def test_allocate_stacked_bad_num_layers(num_layers, error):
    with pytest.raises(error, match="`num_layers` must be an integer of at least 1; got"):
        eqx_lean.allocate_stacked(make_mlp(jax.random.key(0)), num_layers)


# --- stack, unstack, layer_at -----------------------------------------------------------------


def stack_reference(layers):
    dynamic = [eqx.filter(layer, eqx.is_array) for layer in layers]
    static = eqx.filter(layers[0], eqx.is_array, inverse=True)
    return eqx.combine(jax.tree.map(lambda *xs: jnp.stack(xs), *dynamic), static)


def _layers(n=4, make=make_with_integers):
    return [make(k) for k in jax.random.split(jax.random.key(7), n)]


def test_stack_matches_jnp_stack_and_unstack_round_trips():
    layers = _layers()
    stacked = eqx_lean.stack(layers)
    assert_bitwise_equal(stacked, stack_reference(layers))
    for original, recovered in zip(layers, eqx_lean.unstack(stacked), strict=True):
        assert_bitwise_equal(recovered, original)
    assert_bitwise_equal(eqx_lean.stack(eqx_lean.unstack(stacked)), stacked)


def test_stack_casts_floating_leaves():
    layers = _layers()
    expected = cast_reference(stack_reference(layers), jnp.bfloat16)
    assert_bitwise_equal(eqx_lean.stack(layers, jnp.bfloat16), expected)


def test_stack_consume_deletes_sources_and_handles_shared_arrays():
    layers = _layers(3, make_mlp)
    tied = layers[0].layers[0].weight
    layers = [eqx.tree_at(lambda m: m.layers[0].weight, layer, tied) for layer in layers]
    expected = stack_reference(layers)
    stacked = eqx_lean.stack(layers, consume=True)
    assert tied.is_deleted()
    sources = [x for layer in layers for x in jax.tree.leaves(eqx.filter(layer, eqx.is_array))]
    assert all(x.is_deleted() for x in sources)
    assert_bitwise_equal(stacked, expected)


def test_stack_errors():
    layers = _layers(2, make_mlp)
    with pytest.raises(ValueError, match="non-empty list or tuple"):
        eqx_lean.stack([])
    with pytest.raises(ValueError, match="non-empty list or tuple"):
        eqx_lean.stack(layers[0])  # pyright: ignore[reportArgumentType]
    other = eqx.nn.MLP(8, 5, 16, 3, key=jax.random.key(0))
    # The message says where the two differ, not two treedefs that print alike.
    with pytest.raises(
        ValueError, match=r"`layers\[1\]` differs from `layers\[0\]`: it has an extra leaf at "
    ):
        eqx_lean.stack([layers[0], other])
    tanh = eqx.tree_at(lambda m: m.activation, layers[1], jax.nn.tanh)
    with pytest.raises(ValueError, match=r"at \.activation it has <.*tanh.*> where the first has"):
        eqx_lean.stack([layers[0], tanh])
    wider = eqx.tree_at(lambda m: m.layers[0].weight, layers[1], jnp.zeros((16, 9)))
    with pytest.raises(ValueError, match=r"leaf \.layers\[0\]\.weight of `layers\[1\]` is float32"):
        eqx_lean.stack([layers[0], wider])
    bias = layers[1].layers[0].bias
    assert bias is not None
    half = eqx.tree_at(lambda m: m.layers[0].bias, layers[1], bias.astype(jnp.float16))
    with pytest.raises(ValueError, match="equal shape and dtype"):
        eqx_lean.stack([layers[0], half])
    with pytest.raises(ValueError, match="`dtype` must be a floating dtype"):
        eqx_lean.stack(layers, jnp.int32)


def test_layer_at():
    keys = jax.random.split(jax.random.key(0), 4)
    stacked = eqx_lean.build_stacked(make_mlp, keys)
    assert_bitwise_equal(eqx_lean.layer_at(stacked, -1), eqx_lean.unstack(stacked)[3])
    traced = eqx.filter_jit(eqx_lean.layer_at)(stacked, jnp.asarray(2))
    assert_bitwise_equal(traced, eqx_lean.layer_at(stacked, 2))
    with pytest.raises(IndexError, match=r"`index` must be in \[-4, 4\); got 4"):
        eqx_lean.layer_at(stacked, 4)


def test_unstack_rejects_ragged_leading_axes():
    with pytest.raises(ValueError, match="same length on every array leaf"):
        eqx_lean.unstack({"a": jnp.zeros((3, 2)), "b": jnp.zeros((4, 2))})
    with pytest.raises(ValueError, match="no array leaves"):
        eqx_lean.unstack({"a": 1.0})
    # The leaves are named, as `fold` and `scan` name them (one check serves all).
    with pytest.raises(ValueError, match=r"`stacked\['a'\]` is float32\[3, 2\] and `stacked"):
        eqx_lean.unstack({"a": jnp.zeros((3, 2)), "b": jnp.zeros((4, 2))})
    with pytest.raises(ValueError, match=r"`stacked\['b'\]` is a 0-d array \(float32\[\]\)"):
        eqx_lean.layer_at({"a": jnp.zeros((3, 2)), "b": jnp.zeros((), jnp.float32)}, 0)


# --- peak memory ------------------------------------------------------------------------------


def test_peak_memory_in_a_fresh_process():
    """Peak RSS over idle stays at final + one write's temporaries + compile overhead."""
    config = {"num_layers": 16, "dim": 1024, "hidden": 3584, "heads": 8, "kv_heads": 2}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "eqx_lean.bench._worker",
            "build_stacked",
            json.dumps({**config, "dtype": "bfloat16"}),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    keys = jax.random.split(jax.random.key(0), config["num_layers"])
    block_config = BlockConfig(**config)
    largest_temp = write_temp_bytes(
        plan_build(lambda k: Block(block_config, key=k), keys, jnp.bfloat16)
    )[0]
    float32_stack = 2 * figures["final_bytes"]
    # What compiling the writes and XLA:CPU's runtime leave resident beyond XLA's own figures:
    # 118-158 MiB over six configurations (JAX 0.10.2, glibc; see `eqx_lean/_memory/estimates.py`).
    # It does not grow with the model, so the bound still tells one layer's temporaries apart
    # from a float32 stack (1 GiB more here), which is what this test guards against.
    compile_overhead = 160 * 2**20
    assert figures["peak_over_idle_bytes"] <= (
        figures["final_bytes"] + largest_temp + compile_overhead
    )
    assert figures["peak_over_idle_bytes"] < float32_stack
