"""`eqx_lean.load_tensors`/`load_stacked` with `quantize=`: the chosen linear weights of any
Equinox model quantised as they stream, equal to quantising the plain load, with `layers`,
`dtype`, `strict` and `sharding=` meaning what they mean for every leaf."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import assert_bitwise_equal, keys_of, mesh_of
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import save_file

import eqx_lean
from eqx_lean.internal import quant_load
from eqx_lean.quant import QuantConfig, QuantizedLinear, quantize_linears, quantizing


LAYERS, DIM, HIDDEN, VOCAB = 4, 32, 48, 40


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    scale: jax.Array


class Model(eqx.Module):
    embed: jax.Array
    blocks: Block
    head: eqx.nn.Linear


def make_block(key):
    up, down = jax.random.split(key)
    return Block(
        eqx.nn.Linear(DIM, HIDDEN, key=up),
        eqx.nn.Linear(HIDDEN, DIM, use_bias=False, key=down),
        jnp.ones(DIM),
    )


def like(layers: int = LAYERS):
    keys = keys_of(layers)
    return eqx.filter_eval_shape(
        lambda: Model(
            jnp.zeros((VOCAB, DIM)),
            eqx_lean.build_stacked(make_block, keys),
            eqx.nn.Linear(DIM, VOCAB, use_bias=False, key=jax.random.key(1)),
        )
    )


NAMES = {
    ".embed": "embed",
    ".blocks.up.weight": "blocks.{i}.up.weight",
    ".blocks.up.bias": "blocks.{i}.up.bias",
    ".blocks.down.weight": "blocks.{i}.down.weight",
    ".blocks.scale": "blocks.{i}.scale",
    ".head.weight": "head.weight",
}


def names(path, _):
    return NAMES[jax.tree_util.keystr(path)]


def block_names(path, _):
    return NAMES[".blocks" + jax.tree_util.keystr(path)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = {"embed": rng.normal(size=(VOCAB, DIM)), "head.weight": rng.normal(size=(VOCAB, DIM))}
    for i in range(LAYERS + 1):  # one layer more than the model: `layers=` chooses
        tensors[f"blocks.{i}.up.weight"] = rng.normal(size=(HIDDEN, DIM))
        tensors[f"blocks.{i}.up.bias"] = rng.normal(size=HIDDEN)
        tensors[f"blocks.{i}.down.weight"] = rng.normal(size=(DIM, HIDDEN)) * 10.0 ** (i - 2)
        tensors[f"blocks.{i}.scale"] = rng.normal(size=DIM)
    path = tmp_path_factory.mktemp("quant_load") / "model.safetensors"
    save_file({k: v.astype(np.float32) for k, v in tensors.items()}, path)
    return path


def assert_same_values(got, expected):
    """Equal trees, leaf for leaf and bit for bit, static fields (schemes, shapes) included,
    wherever their arrays lie: `got` sharded, `expected` not."""
    assert_bitwise_equal(jax.device_get(got), jax.device_get(expected))


CONFIGS = [
    QuantConfig("nf4"),
    QuantConfig("nf4", blocksize=32, double_quant=True),
    QuantConfig("int8"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.scheme}-dq{c.double_quant}")
def test_load_tensors_quantised_equals_quantising_the_plain_load(checkpoint, config, monkeypatch):
    monkeypatch.setattr(quant_load, "_CHUNK_VALUES", 100)  # many chunks per tensor
    kwargs = dict(dtype=jnp.bfloat16, layers=range(1, 5), strict=False)
    got = eqx_lean.load_tensors(checkpoint, like(), names, quantize=config, **kwargs)
    plain = eqx_lean.load_tensors(checkpoint, like(), names, **kwargs)
    assert_bitwise_equal(got, quantize_linears(plain, config))
    # "all-linear" leaves out only a module named `lm_head`: this model's `head` is quantised.
    for linear in (got.blocks.up, got.blocks.down, got.head):
        assert isinstance(linear, QuantizedLinear)
        assert linear.weight.dtype == jnp.bfloat16
    assert got.blocks.up.weight.batch_shape == (4,) and got.head.weight.batch_shape == ()
    assert got.embed.dtype == jnp.bfloat16


def test_load_stacked_quantises_the_chosen_linears_only(checkpoint):
    config = QuantConfig("nf4", target_modules=["down"])
    blocks = like().blocks
    got = eqx_lean.load_stacked(checkpoint, blocks, block_names, layers=4, quantize=config)
    plain = eqx_lean.load_stacked(checkpoint, blocks, block_names, layers=4)
    assert isinstance(got.down, QuantizedLinear) and isinstance(got.up, eqx.nn.Linear)
    assert_bitwise_equal(got, quantize_linears(plain, config))
    x = jnp.ones((3, HIDDEN))
    layer = jax.tree.map(lambda a: a[2], got)
    expected = np.asarray(x, np.float64) @ np.asarray(layer.down.weight.dequantize(), np.float64).T
    np.testing.assert_allclose(layer.down(x), expected, rtol=1e-5, atol=1e-5)


def test_a_quantised_load_is_strict_about_tensors_and_layers(checkpoint):
    config = QuantConfig("nf4")
    with pytest.raises(ValueError, match=r"holds 5 layers .*, but the stacked leaves .* have 4"):
        eqx_lean.load_tensors(checkpoint, like(), names, quantize=config)
    with pytest.raises(ValueError, match=r"`layers` selects checkpoint layer 5, but the"):
        eqx_lean.load_tensors(checkpoint, like(), names, layers=range(2, 6), quantize=config)

    def misnamed(path, _):
        key = jax.tree_util.keystr(path)
        return "blocks.{i}.missing.weight" if key == ".blocks.down.weight" else NAMES[key]

    with pytest.raises(KeyError, match=r"4 are missing: 'blocks.0.missing.weight'"):
        eqx_lean.load_tensors(checkpoint, like(), misnamed, layers=4, quantize=config)
    without_head = {k: v for k, v in NAMES.items() if k != ".head.weight"}
    model = like()
    model = eqx.tree_at(lambda m: m.head.weight, model, jnp.zeros((VOCAB, DIM)))

    def fewer(path, _):
        return without_head.get(jax.tree_util.keystr(path))

    with pytest.raises(ValueError, match=r"tensors that no leaf of `like` is named for: 'head"):
        eqx_lean.load_tensors(
            checkpoint, model, fewer, layers=4, quantize=QuantConfig(target_modules=["up"])
        )


def test_quantised_load_errors(checkpoint):
    model = like()
    with pytest.raises(ValueError, match="`quantize` must be None, 'nf4', 'int8'"):
        eqx_lean.load_tensors(checkpoint, model, names, layers=4, quantize="fp4")
    with pytest.raises(ValueError, match=r"entries \['gate'\] name no linear layer"):
        eqx_lean.load_tensors(
            checkpoint, model, names, layers=4, quantize=QuantConfig(target_modules=["gate"])
        )
    transposed = dict(NAMES)

    def with_transpose(path, _):
        key = jax.tree_util.keystr(path)
        if key == ".head.weight":
            return eqx_lean.TensorName("head.weight", (1, 0))
        return transposed[key]

    transposed_head = eqx.nn.Linear(VOCAB, DIM, use_bias=False, key=jax.random.key(0))
    square = eqx.tree_at(lambda m: m.head, model, transposed_head)
    with pytest.raises(ValueError, match=r"`head`, whose tensor 'head.weight' is named with "):
        eqx_lean.load_tensors(
            checkpoint, square, with_transpose, layers=4, strict=False, quantize="nf4"
        )

    def unnamed_head(path, _):
        key = jax.tree_util.keystr(path)
        return None if key == ".head.weight" else NAMES[key]

    with pytest.raises(ValueError, match=r"must give its weight a tensor to quantise from"):
        head = eqx.tree_at(lambda m: m.head.weight, model, jnp.zeros((VOCAB, DIM)))
        eqx_lean.load_tensors(
            checkpoint, head, unnamed_head, layers=4, strict=False, quantize="nf4"
        )


def test_a_failed_quantised_load_raises_before_reading(checkpoint, monkeypatch):
    """The checks run before any weight is quantised: a bad checkpoint quantises nothing."""
    calls = []
    monkeypatch.setattr(quant_load, "_encode", lambda *a, **k: calls.append(a))
    with pytest.raises(KeyError, match="The checkpoint holds 5 layers"):
        eqx_lean.load_tensors(checkpoint, like(6), names, quantize="nf4")
    assert calls == []


# --- sharding (the suite's 8 CPU devices) ---------------------------------------------------------


SHARDED_CONFIGS = [
    QuantConfig("nf4", blocksize=16),
    QuantConfig("nf4", double_quant=True, blocksize=16),
    QuantConfig("int8"),
]


def by_rows_and_columns(mesh):
    """`sharding=` for the weight: a matrix [out, in] (a layer's, or the head's) split over
    "model" by rows and "data" by columns, every other leaf replicated."""

    def rule(path, leaf):
        if leaf.ndim == 2:
            return NamedSharding(mesh, P("model", "data"))
        return NamedSharding(mesh, P())

    return rule


@pytest.mark.parametrize("config", SHARDED_CONFIGS, ids=lambda c: f"{c.scheme}-dq{c.double_quant}")
@pytest.mark.cpu_mesh
def test_quantised_weights_are_sharded_between_rows_of_whole_blocks(checkpoint, config):
    """On 8 devices, `sharding=` is given for the weight; NF4 codes and scales are split
    between rows over the mesh axes it names, int8 codes keep it; the values equal the
    unsharded load's."""
    mesh = mesh_of((2, 4), ("data", "model"))
    sharding = by_rows_and_columns(mesh)
    got = eqx_lean.load_tensors(
        checkpoint, like(), names, layers=4, strict=False, sharding=sharding, quantize=config
    )
    plain = eqx_lean.load_tensors(
        checkpoint, like(), names, layers=4, strict=False, quantize=config
    )
    assert_same_values(got, plain)
    up = got.blocks.up.weight
    if config.scheme == "nf4":
        assert up.codes.sharding.spec == P(None, ("model", "data")), up.codes.sharding
        scales = up.scale_bits.codes if config.double_quant else up.scale_bits
        assert scales.sharding.spec == P(None, ("model", "data")), scales.sharding
        assert got.head.weight.codes.sharding.spec == P(("model", "data")), got.head
        # Every device holds 1/8 of the codes: whole rows, whole blocks.
        shard = up.codes.addressable_shards[0].data
        assert shard.shape == (4, 48 * 32 // 2 // 8), shard.shape
    else:
        assert up.codes.sharding.spec == P(None, "model", "data"), up.codes.sharding
        assert up.scale_bits.sharding.spec == P(None, "model"), up.scale_bits.sharding
    # `fold` gathers each layer before it runs, as for any sharded stack.
    x = jnp.ones((3, 32))

    def run(blocks):
        return eqx_lean.fold(blocks, x, call=lambda b, x: b.down(b.up(x)))

    np.testing.assert_array_equal(jax.jit(run)(got.blocks), run(plain.blocks))


@pytest.mark.cpu_mesh
def test_a_sharding_that_cuts_a_block_is_refused_naming_the_weight(checkpoint):
    """48 rows of 32 values in 8 shards: 6 rows, 192 values, not whole blocks of 128."""
    mesh = mesh_of((2, 4), ("data", "model"))
    with pytest.raises(ValueError) as caught:
        eqx_lean.load_tensors(
            checkpoint,
            like(),
            names,
            layers=4,
            strict=False,
            sharding=by_rows_and_columns(mesh),
            quantize=QuantConfig("nf4", blocksize=128),
        )
    assert "`blocks.up.weight`" in str(caught.value), caught.value
    assert "whole blocks of 128" in str(caught.value), caught.value


@pytest.mark.cpu_mesh
def test_build_stacked_splits_codes_and_scales_alike_and_refuses_them_split_apart():
    """`build_stacked`'s rule sees the codes and scales: split alike into whole blocks, the
    stack equals the unsharded build; split apart, refused."""
    mesh = mesh_of((2, 4), ("data", "model"))
    make = quantizing(make_block, QuantConfig("nf4"), jnp.float32)
    keys = keys_of(4, 3)
    sharded = eqx_lean.build_stacked(make, keys, sharding=eqx_lean.fsdp(mesh, ("data", "model")))
    assert sharded.up.weight.codes.sharding.spec == P(None, ("data", "model"))
    assert_same_values(sharded, eqx_lean.build_stacked(make, keys))

    def codes_only(path, leaf):
        codes = path[-1] == jax.tree_util.GetAttrKey("codes")
        return NamedSharding(mesh, P("data") if codes else P())

    with pytest.raises(ValueError) as caught:
        eqx_lean.build_stacked(make, keys, sharding=codes_only)
    assert "NF4 codes of `up.weight` over mesh axes ('data',)" in str(caught.value), caught.value
