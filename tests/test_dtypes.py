"""Ready-made dtype rules (`eqx_lean.dtypes`, `eqx_lean/_core/dtypes.py`): by module type and by
rank, resolved against the tree each function is given, and never silent when they match
nothing."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import assert_bitwise_equal

import eqx_lean


class OwnNorm(eqx.Module):
    """A norm class of the user's own, as GPT-2 ports and the Mistral example have."""

    weight: jax.Array

    def __init__(self, dim):
        self.weight = jnp.ones(dim)


class GPT2Block(eqx.Module):
    """GPT-2's attribute names: nothing in a path says "norm"."""

    ln_1: eqx.nn.LayerNorm
    attn: eqx.nn.Linear
    ln_2: OwnNorm
    mlp: eqx.nn.MLP
    scale: jax.Array

    def __init__(self, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln_1 = eqx.nn.LayerNorm(16)
        self.attn = eqx.nn.Linear(16, 16, key=k1)
        self.ln_2 = OwnNorm(16)
        self.mlp = eqx.nn.MLP(16, 16, 32, depth=1, key=k2)
        self.scale = jax.random.uniform(k3, ())


def make_block(key):
    return GPT2Block(key=key)


class Model(eqx.Module):
    embed: jax.Array
    blocks: GPT2Block
    ln_f: eqx.nn.LayerNorm


KEYS = jax.random.split(jax.random.key(0), 3)
NORMS = eqx_lean.dtypes.for_modules(
    (eqx.nn.LayerNorm, OwnNorm), jnp.float32, otherwise=jnp.bfloat16
)

# Written out by hand, independently of the rule: every leaf of the two norms is float32.
EXPECTED_BY_TYPE = {
    ".ln_1.weight": jnp.float32,
    ".ln_1.bias": jnp.float32,
    ".attn.weight": jnp.bfloat16,
    ".attn.bias": jnp.bfloat16,
    ".ln_2.weight": jnp.float32,
    ".mlp.layers[0].weight": jnp.bfloat16,
    ".mlp.layers[0].bias": jnp.bfloat16,
    ".mlp.layers[1].weight": jnp.bfloat16,
    ".mlp.layers[1].bias": jnp.bfloat16,
    ".scale": jnp.bfloat16,
}


def dtypes_of(tree) -> dict[str, np.dtype]:
    flat = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]
    return {jax.tree_util.keystr(path): x.dtype for path, x in flat}


def arrays(tree):
    """`tree`'s arrays, `None` in place of its other leaves (the MLPs' activation functions),
    as `cast_by_path` returns it: what the bitwise comparisons compare."""
    return eqx.filter(tree, eqx.is_array)


def cast_by_path(tree, dtypes: dict):
    def cast(path, x):
        return x.astype(dtypes[jax.tree_util.keystr(path)])

    return jax.tree_util.tree_map_with_path(cast, arrays(tree))


# --- by module type ---------------------------------------------------------------------------


def test_a_substring_rule_misses_gpt2_names_where_the_type_rule_does_not():
    substring = lambda path, leaf: None if "norm" in jax.tree_util.keystr(path) else jnp.bfloat16  # noqa: E731
    missed = eqx_lean.build_stacked(make_block, KEYS, substring)
    assert dtypes_of(missed)[".ln_1.weight"] == jnp.bfloat16  # the silent miss the issue reports
    built = eqx_lean.build_stacked(make_block, KEYS, NORMS)
    assert dtypes_of(built) == EXPECTED_BY_TYPE
    reference = cast_by_path(eqx.filter_vmap(make_block)(KEYS), EXPECTED_BY_TYPE)
    assert_bitwise_equal(arrays(built), reference)


def test_subclasses_match_and_the_example_rmsnorm_is_matched_by_its_own_class():
    from eqx_lean.hf import make_block as make_mistral_block
    from eqx_lean.internal import RMSNorm
    from examples.mistral7b.train import small_config

    config = small_config()
    rule = eqx_lean.dtypes.for_modules(RMSNorm, jnp.float32, otherwise=jnp.bfloat16)
    report = eqx_lean.memory.describe(lambda k: make_mistral_block(config, key=k), KEYS, rule)
    stored = {x.path: x.stored_dtype for x in report}
    norms = {p for p in stored if "norm" in p}
    assert norms and all(stored[p] == "float32" for p in norms), stored
    assert {stored[p] for p in stored if p not in norms} == {"bfloat16"}

    class Sub(OwnNorm):
        pass

    class WithSub(eqx.Module):
        n: Sub
        w: jax.Array

    layer = WithSub(Sub(4), jnp.ones((4, 4)))  # pyright: ignore[reportArgumentType]
    built = eqx_lean.stack([layer, layer], eqx_lean.dtypes.for_modules(OwnNorm, jnp.float32))
    assert built.n.weight.dtype == jnp.float32 and built.w.dtype == jnp.float32
    built = eqx_lean.stack(
        [layer, layer], eqx_lean.dtypes.for_modules(OwnNorm, jnp.float16, otherwise=jnp.bfloat16)
    )
    assert (built.n.weight.dtype, built.w.dtype) == (jnp.float16, jnp.bfloat16)


def test_every_function_that_takes_dtype_resolves_the_rule(tmp_path):
    built = eqx_lean.build_stacked(make_block, KEYS, NORMS)
    assert dtypes_of(built) == EXPECTED_BY_TYPE
    abstract = eqx.filter_eval_shape(make_block, KEYS[0])
    assert dtypes_of(eqx_lean.allocate_stacked(abstract, 3, NORMS)) == EXPECTED_BY_TYPE
    layers = [make_block(k) for k in KEYS]
    assert dtypes_of(eqx_lean.stack(layers, NORMS)) == EXPECTED_BY_TYPE
    estimate = eqx_lean.memory.estimate(make_block, KEYS, NORMS)
    assert estimate.final_bytes == sum(
        x.nbytes for x in jax.tree.leaves(eqx.filter(built, eqx.is_array))
    )
    assert {x.path: x.stored_dtype for x in estimate.leaves} == {
        p: np.dtype(d).name for p, d in EXPECTED_BY_TYPE.items()
    }

    # load_stacked: the rule is resolved against `like`, each stacked leaf seen per layer.
    full = eqx_lean.build_stacked(make_block, KEYS)  # float32 on disk
    names = lambda path, leaf: "h.{i}" + jax.tree_util.keystr(path)  # noqa: E731
    eqx_lean.save_stacked(tmp_path / "blocks", full, names)
    like = eqx.filter_eval_shape(eqx_lean.build_stacked, make_block, KEYS)
    loaded = eqx_lean.load_stacked(tmp_path / "blocks", like, names, dtype=NORMS)
    assert_bitwise_equal(arrays(loaded), cast_by_path(full, EXPECTED_BY_TYPE))

    # load_tensors: the whole model, a final LayerNorm outside the stack matched too.
    model = Model(jnp.arange(32.0).reshape(2, 16), full, eqx.nn.LayerNorm(16))

    def model_names(path, leaf):
        key = jax.tree_util.keystr(path)
        return "h.{i}" + key.removeprefix(".blocks") if key.startswith(".blocks.") else key[1:]

    eqx_lean.save_tensors(tmp_path / "model", model, model_names)
    like = eqx.filter_eval_shape(lambda: model)
    loaded = eqx_lean.load_tensors(tmp_path / "model", like, model_names, dtype=NORMS)
    expected = {".embed": jnp.bfloat16, ".ln_f.weight": jnp.float32, ".ln_f.bias": jnp.float32}
    expected |= {".blocks" + p: d for p, d in EXPECTED_BY_TYPE.items()}
    assert dtypes_of(loaded) == expected
    assert_bitwise_equal(arrays(loaded), cast_by_path(model, expected))


def test_a_type_rule_that_matches_no_module_is_an_error():
    rule = eqx_lean.dtypes.for_modules(eqx.nn.RMSNorm, jnp.float32, otherwise=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"for_modules\(RMSNorm, \.\.\.\)` matches no module") as e:
        eqx_lean.build_stacked(make_block, KEYS, rule)
    assert "GPT2Block, LayerNorm, Linear, OwnNorm, MLP" in str(e.value)
    for call in [
        lambda: eqx_lean.memory.estimate(make_block, KEYS, rule),
        lambda: eqx_lean.memory.describe(make_block, KEYS, rule),
        lambda: eqx_lean.stack([make_block(k) for k in KEYS], rule),
    ]:
        with pytest.raises(ValueError, match="matches no module"):
            call()


def test_a_class_of_the_same_name_from_elsewhere_is_named_in_the_error():
    from eqx_lean.hf import make_block as make_mistral_block
    from examples.mistral7b.train import small_config

    config = small_config()
    rule = eqx_lean.dtypes.for_modules(eqx.nn.RMSNorm, jnp.float32)
    with pytest.raises(ValueError, match=r"eqx_lean\.hf\._model\.RMSNorm, a different class"):
        eqx_lean.memory.describe(lambda k: make_mistral_block(config, key=k), KEYS, rule)


def test_bad_arguments_are_refused_when_the_rule_is_made():
    with pytest.raises(TypeError, match="`types` must be a module class"):
        eqx_lean.dtypes.for_modules("LayerNorm", jnp.float32)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="`types` must be a module class"):
        eqx_lean.dtypes.for_modules((), jnp.float32)
    with pytest.raises(ValueError, match="`dtype` must be a floating dtype"):
        eqx_lean.dtypes.for_modules(eqx.nn.LayerNorm, jnp.int8)
    with pytest.raises(ValueError, match="`otherwise` must be a floating dtype"):
        eqx_lean.dtypes.for_vectors(jnp.float32, otherwise=jnp.int32)


# --- by rank ----------------------------------------------------------------------------------


def test_for_vectors_counts_one_layer_s_shape():
    rule = eqx_lean.dtypes.for_vectors(jnp.float32, otherwise=jnp.bfloat16)
    built = eqx_lean.build_stacked(make_block, KEYS, rule)
    expected = {
        p: (
            jnp.bfloat16
            if p.endswith("weight") and not p.startswith((".ln_1", ".ln_2"))
            else jnp.float32
        )
        for p in EXPECTED_BY_TYPE
    }
    assert dtypes_of(built) == expected
    assert built.ln_2.weight.shape == (3, 16)  # (L, d): a vector per layer
    assert_bitwise_equal(arrays(built), cast_by_path(eqx.filter_vmap(make_block)(KEYS), expected))


def test_for_vectors_that_matches_no_leaf_is_an_error():
    rule = eqx_lean.dtypes.for_vectors(jnp.float32)
    make = lambda k: eqx.nn.Linear(4, 4, use_bias=False, key=k)  # noqa: E731
    with pytest.raises(ValueError, match=r"for_vectors\(\.\.\.\)` matches no leaf.*\[4, 4\]"):
        eqx_lean.build_stacked(make, KEYS, rule)


def test_rules_compose_through_otherwise():
    rule = eqx_lean.dtypes.for_modules(
        eqx.nn.LayerNorm,
        jnp.float32,
        otherwise=eqx_lean.dtypes.for_vectors(jnp.float16, otherwise=jnp.bfloat16),
    )
    built = eqx_lean.build_stacked(make_block, KEYS, rule)
    assert dtypes_of(built) == {
        ".ln_1.weight": jnp.float32,
        ".ln_1.bias": jnp.float32,
        ".attn.weight": jnp.bfloat16,
        ".attn.bias": jnp.float16,
        ".ln_2.weight": jnp.float16,
        ".mlp.layers[0].weight": jnp.bfloat16,
        ".mlp.layers[0].bias": jnp.float16,
        ".mlp.layers[1].weight": jnp.bfloat16,
        ".mlp.layers[1].bias": jnp.float16,
        ".scale": jnp.float16,
    }
    # A plain function as `otherwise` is called for the other leaves, with the usual path.
    seen = []
    rule = eqx_lean.dtypes.for_modules(
        OwnNorm, jnp.float32, otherwise=lambda path, leaf: seen.append(path) or None
    )
    eqx_lean.build_stacked(make_block, KEYS, rule)
    assert jax.tree_util.keystr(seen[0]) == ".ln_1.weight" and len(seen) == 9
