"""`eqx_lean.lora` on a user-defined Equinox model (no HF decoder): selection, the layer,
gradients through `fold`, merge/unmerge, sharding, and PEFT's format by a name function."""

import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import keys_of, mesh_of
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, PRNGKeyArray

import eqx_lean
from eqx_lean.internal import cast_floating
from eqx_lean.lora import (
    LoraConfig,
    LoraLinear,
    add_lora,
    load_adapters,
    lora_filter,
    lora_paths,
    merge_lora,
    save_adapters,
    unmerge_lora,
)


DIM, HIDDEN, LAYERS, RANK = 8, 12, 3, 2


class Mlp(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __call__(self, x: Array, key: PRNGKeyArray | None) -> Array:
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        return self.down(jnp.tanh(self.up(x, key=keys[0])), key=keys[1])


class Block(eqx.Module):
    """A residual block that calls its linear layers on vectors, as `eqx.nn.Linear` is used."""

    attn: eqx.nn.Linear
    mlp: Mlp

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn = eqx.nn.Linear(DIM, DIM, key=k1)  # with a bias
        self.mlp = Mlp(
            eqx.nn.Linear(DIM, HIDDEN, use_bias=False, key=k2),
            eqx.nn.Linear(HIDDEN, DIM, use_bias=False, key=k3),
        )

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        h = x + jnp.tanh(self.attn(x, key=keys[0]))
        return h + self.mlp(h, keys[1])


class Model(eqx.Module):
    layers: Block  # stacked
    head: eqx.nn.Linear  # plain

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        h = eqx_lean.fold(self.layers, x, key=key)
        return self.head(h)


def make_model(seed: int = 0) -> Model:
    k1, k2 = jax.random.split(jax.random.key(seed))
    layers = eqx_lean.build_stacked(lambda k: Block(key=k), jax.random.split(k1, LAYERS))
    return Model(layers, eqx.nn.Linear(DIM, 4, key=k2))


def loop_forward(model: Model, x: Array) -> Array:
    for layer in eqx_lean.unstack(model.layers):
        x = layer(x)
    return model.head(x)


def randomized(model, seed: int = 1, std: float = 0.3):
    """`model` with every adapter matrix drawn normal (so that `B` is not zero), in the layers
    each adapter is selected for (zero in the others, as training leaves them)."""
    keys = iter(keys_of(64, seed))

    def draw(node):
        if not isinstance(node, LoraLinear):
            return node
        a, b = (
            std * jax.random.normal(next(keys), m.shape, m.dtype)
            for m in (node.lora_A, node.lora_B)
        )
        if node.layers is not None:
            keep = np.isin(np.arange(a.shape[0]), node.layers)[:, None, None]
            a, b = jnp.where(keep, a, 0), jnp.where(keep, b, 0)
        return eqx.tree_at(lambda n: (n.lora_A, n.lora_B), node, (a, b))

    return jax.tree.map(draw, model, is_leaf=lambda n: isinstance(n, LoraLinear))


def names(path, leaf) -> str:
    """The torch-style name of a leaf: `.layers.mlp.up.weight` -> `layers.{i}.mlp.up.weight`."""
    del leaf
    key = jax.tree_util.keystr(path).removeprefix(".")
    return key.replace("layers.", "layers.{i}.", 1) if key.startswith("layers.") else key


X = jax.random.normal(jax.random.key(9), (DIM,))
ALL = (".layers.attn", ".layers.mlp.up", ".layers.mlp.down")


# --- configuration and selection ----------------------------------------------------------------


def test_module_name_is_the_weight_name_without_weight():
    from eqx_lean.internal import module_name, module_names

    path = (jax.tree_util.GetAttrKey("layers"), jax.tree_util.GetAttrKey("q_proj"))
    seen = []

    def names(p, leaf):
        seen.append((jax.tree_util.keystr(p), leaf.shape))
        return "model.layers.{i}.self_attn.q_proj.weight"

    class Stacked:
        weight = jnp.zeros((3, 4, 2))

    assert module_name(path, Stacked.weight, names) == "model.layers.{i}.self_attn.q_proj"
    assert seen == [(".layers.q_proj.weight", (3, 4, 2))]
    assert module_names(path, Stacked, names) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.2.self_attn.q_proj",
    ]
    with pytest.raises(ValueError, match=r"of \.layers\.q_proj '<module>\.weight' .* gave 'q'\."):
        module_name(path, Stacked.weight, lambda p, leaf: "q")
    with pytest.raises(
        ValueError, match=r"with '\{i\}' \(the layer index\); it gave 'm\.q\.weight'\."
    ):
        module_names(path, Stacked, lambda p, leaf: "m.q.weight")


def test_config_canonical_form_scale_and_errors():
    assert LoraConfig(target_modules=["v", "q", "v"]) == LoraConfig(target_modules=("q", "v"))
    assert LoraConfig(target_modules=("q", "v")).target_modules == ("q", "v")
    assert LoraConfig(r=4, lora_alpha=8).scale == 2.0
    assert LoraConfig(r=4, lora_alpha=8, use_rslora=True).scale == 4.0
    assert LoraConfig(target_modules="all-linear").target_modules == "all-linear"
    for bad, field in [
        (dict(r=0), "`r`"),
        (dict(r=True), "`r`"),
        (dict(lora_alpha=0), "`lora_alpha`"),
        (dict(lora_dropout=1.0), "`lora_dropout`"),
        (dict(use_rslora=1), "`use_rslora`"),
        (dict(target_modules=()), "`target_modules`"),
        (dict(target_modules=(".q",)), "`target_modules`"),
        (dict(target_modules="layers.(q"), "`target_modules` given as a string"),
    ]:
        with pytest.raises(ValueError, match=field):
            LoraConfig(**bad)


SELECTIONS = [
    (("attn", "up"), (".layers.attn", ".layers.mlp.up")),
    (("mlp.down",), (".layers.mlp.down",)),
    (("layers.mlp.down", "head"), (".layers.mlp.down", ".head")),
    (r"layers\.(attn|mlp\.up)", (".layers.attn", ".layers.mlp.up")),
    (r".*", (*ALL, ".head")),
    ("all-linear", (*ALL, ".head")),  # the output head is left out only if named `lm_head`
]


@pytest.mark.parametrize(("targets", "expected"), SELECTIONS)
def test_selection_by_suffix_regex_and_all_linear(targets, expected):
    model = make_model()
    lora = add_lora(model, LoraConfig(r=RANK, target_modules=targets), key=jax.random.key(1))
    assert lora_paths(lora) == expected
    np.testing.assert_array_equal(lora(X), model(X))  # B = 0: unchanged


class Dense(eqx.Module):
    """A user's own linear layer type (any type with `weight [out, in]` and `bias`)."""

    weight: Array
    bias: Array | None = None

    def __call__(self, x: Array) -> Array:
        return self.weight @ x


def test_selection_by_type_and_the_output_head_rule():
    model = {"lm_head": eqx.nn.Linear(4, 3, key=jax.random.key(0)), "proj": Dense(jnp.ones((3, 4)))}
    config = LoraConfig(target_modules="all-linear")
    with pytest.raises(ValueError, match=r"must match at least one module.*\['lm_head'\]"):
        add_lora(model, config, key=jax.random.key(1))  # `lm_head` is the head: left out
    both = add_lora(
        model, LoraConfig(target_modules=".*"), key=jax.random.key(1), types=(Dense, eqx.nn.Linear)
    )
    assert lora_paths(both) == ("['lm_head']", "['proj']")
    dense = add_lora(model, config, key=jax.random.key(1), types=(Dense,))
    assert lora_paths(dense) == ("['proj']",)
    assert dense["proj"].lora_A.shape == (8, 4) and dense["proj"].lora_B.shape == (3, 8)


def test_no_match_and_adapters_already_there_are_refused():
    model = make_model()
    with pytest.raises(
        ValueError, match=r"\['q'\] name none; the candidates are \['head', 'layers.attn'"
    ):
        add_lora(model, LoraConfig(target_modules=("q", "attn")), key=jax.random.key(0))
    with pytest.raises(ValueError, match="must match at least one module"):
        add_lora(model, LoraConfig(target_modules="nothing"), key=jax.random.key(0))
    lora = add_lora(model, LoraConfig(target_modules=("attn",)), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"\.layers\.attn already has a LoRA adapter"):
        add_lora(lora, LoraConfig(target_modules=("attn", "up")), key=jax.random.key(0))
    more = add_lora(lora, LoraConfig(target_modules=("up",)), key=jax.random.key(0))
    assert lora_paths(more) == (".layers.attn", ".layers.mlp.up")


# --- the layer ----------------------------------------------------------------------------------


def test_fresh_adapters_are_peft_init_stacked_and_plain():
    model = make_model()
    lora = add_lora(model, LoraConfig(r=RANK, target_modules=".*"), key=jax.random.key(1))
    up = lora.layers.mlp.up
    assert isinstance(up, LoraLinear) and up.base is model.layers.mlp.up  # not copied
    assert up.lora_A.shape == (LAYERS, RANK, DIM) and up.lora_A.dtype == jnp.float32
    assert up.lora_B.shape == (LAYERS, HIDDEN, RANK)
    assert lora.head.lora_A.shape == (RANK, DIM) and lora.head.lora_B.shape == (4, RANK)
    for layer in (up, lora.layers.mlp.down, lora.head):
        np.testing.assert_array_equal(layer.lora_B, 0.0)
        bound = 1 / np.sqrt(layer.lora_A.shape[-1])  # kaiming_uniform_(a=sqrt(5))
        assert np.abs(np.asarray(layer.lora_A)).max() <= bound
    assert not np.allclose(up.lora_A[0], up.lora_A[1])  # one key per layer


def test_call_is_a_drop_in_for_linear_with_bias_leading_axes_and_jit():
    linear = eqx.nn.Linear(DIM, 5, key=jax.random.key(0))
    lora = add_lora({"p": linear}, LoraConfig(r=RANK, target_modules=("p",)), key=jax.random.key(1))
    layer = randomized(lora)["p"]
    xs = jax.random.normal(jax.random.key(2), (2, 3, DIM))
    scale = layer.config.scale
    assert linear.bias is not None
    want = (
        xs @ linear.weight.T
        + linear.bias[None, None]
        + scale * (xs @ layer.lora_A.T) @ layer.lora_B.T
    )
    np.testing.assert_allclose(layer(xs), want, rtol=1e-6, atol=1e-6)
    vector = jax.jit(lambda m, x: m(x))(layer, xs[0, 0])
    np.testing.assert_allclose(vector, want[0, 0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(layer.project(xs), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lora["p"](X), linear(X), rtol=1e-6, atol=1e-6)


def test_dropout_only_with_a_key():
    linear = eqx.nn.Linear(DIM, 5, use_bias=False, key=jax.random.key(0))
    config = LoraConfig(r=RANK, target_modules=("p",), lora_dropout=0.5)
    layer = randomized(add_lora({"p": linear}, config, key=jax.random.key(1)))["p"]
    key = jax.random.key(3)
    keep = jax.random.bernoulli(key, 0.5, X.shape)
    dropped = jnp.where(keep, X / 0.5, 0.0)
    want = linear(X) + config.scale * (layer.lora_B @ (layer.lora_A @ dropped))
    np.testing.assert_allclose(layer(X, key=key), want, rtol=1e-6, atol=1e-6)
    clean = linear(X) + config.scale * (layer.lora_B @ (layer.lora_A @ X))
    np.testing.assert_allclose(layer(X), clean, rtol=1e-6, atol=1e-6)


def test_bfloat16_base_rounds_once_to_the_base_dtype():
    linear = eqx.nn.Linear(DIM, 5, key=jax.random.key(0))
    linear = jax.tree.map(lambda a: a.astype(jnp.bfloat16), linear)
    layer = randomized(
        add_lora({"p": linear}, LoraConfig(r=RANK, target_modules="p"), key=jax.random.key(1))
    )["p"]
    x = X.astype(jnp.bfloat16)
    y = layer(x)
    assert y.dtype == jnp.bfloat16 and layer.lora_A.dtype == jnp.float32
    f32 = jnp.float32
    base = jnp.einsum("i,oi->o", x, linear.weight, preferred_element_type=f32).astype(jnp.bfloat16)
    wide = base.astype(f32) + layer.config.scale * (layer.lora_B @ (layer.lora_A @ x.astype(f32)))
    np.testing.assert_array_equal(y, (wide + linear.bias.astype(f32)).astype(jnp.bfloat16))


# --- gradients through fold -------------------------------------------------------------------


def test_adapter_gradients_through_fold_equal_a_python_loop_and_are_lean():
    lora = randomized(
        add_lora(make_model(), LoraConfig(r=RANK, target_modules=".*"), key=jax.random.key(1))
    )
    adapters, frozen = eqx.partition(lora, lora_filter(lora))
    xs = jax.random.normal(jax.random.key(4), (5, DIM))

    def grads(forward):
        @jax.jit
        def run(adapters):
            def loss(adapters):
                model = eqx.combine(adapters, frozen)
                return jnp.sum(jnp.sin(jax.vmap(lambda x: forward(model, x))(xs)))

            return jax.grad(loss)(adapters)

        return run(adapters)

    ours = grads(lambda m, x: m(x))
    loop = grads(loop_forward)
    arrays = [g for g in jax.tree.leaves(ours)]
    # Only the adapters have gradient buffers: 2 per adapted module.
    assert len(arrays) == 2 * 4
    for got, want in zip(arrays, jax.tree.leaves(loop), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert all(float(jnp.abs(g).max()) > 0 for g in arrays)


# --- merge and unmerge ----------------------------------------------------------------------------


def test_merge_equals_the_adapted_forward_and_unmerge_restores_the_base():
    model = make_model()
    lora = randomized(
        add_lora(model, LoraConfig(r=RANK, target_modules=".*"), key=jax.random.key(1))
    )
    xs = jax.random.normal(jax.random.key(4), (5, DIM))
    want = jax.vmap(lora)(xs)
    merged = merge_lora(lora)
    assert lora_paths(merged) == () and isinstance(merged.head, eqx.nn.Linear)
    np.testing.assert_allclose(jax.vmap(merged)(xs), want, rtol=1e-5, atol=1e-6)
    kept = merge_lora(lora, keep_adapters=True)
    assert all(layer.merged for layer in (kept.layers.attn, kept.head))
    np.testing.assert_allclose(jax.vmap(kept)(xs), want, rtol=1e-5, atol=1e-6)
    assert lora_paths(merge_lora(kept)) == ()  # merging again adds nothing
    np.testing.assert_array_equal(merge_lora(kept).head.weight, merged.head.weight)
    back = unmerge_lora(kept)
    assert not back.head.merged
    for got, base in [(back.layers.mlp.up, model.layers.mlp.up), (back.head, model.head)]:
        np.testing.assert_allclose(got.base.weight, base.weight, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.vmap(back)(xs), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="must hold merged adapters"):
        unmerge_lora(back)


def test_merge_donates_and_bfloat16_unmerge_is_refused():
    model = cast_floating(make_model(), jnp.bfloat16)
    lora = randomized(
        add_lora(model, LoraConfig(r=RANK, target_modules=("up",)), key=jax.random.key(1))
    )
    kept = merge_lora(lora, keep_adapters=True)
    assert kept.layers.mlp.up.base.weight.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"float32 or float64 base; \.layers\.mlp\.up is bfloat16"):
        unmerge_lora(kept)
    weight = lora.layers.mlp.up.base.weight
    merged = merge_lora(lora, donate=True)
    assert weight.is_deleted() and merged.layers.mlp.up.weight.dtype == jnp.bfloat16


def test_plain_model_without_a_layer_axis():
    mlp = eqx.nn.MLP(DIM, 3, 16, 2, key=jax.random.key(0))
    lora = add_lora(mlp, LoraConfig(r=RANK, target_modules=r"layers\.[01]"), key=jax.random.key(1))
    assert lora_paths(lora) == (".layers[0]", ".layers[1]")
    lora = randomized(lora)
    assert lora.layers[0].lora_A.shape == (RANK, DIM)
    first = lora.layers[0]
    hand = first.base(X) + first.config.scale * first.lora_B @ (first.lora_A @ X)
    np.testing.assert_allclose(first(X), hand, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(merge_lora(lora)(X), lora(X), rtol=1e-5, atol=1e-6)
    adapters, frozen = eqx.partition(lora, lora_filter(lora))
    grads = jax.grad(lambda a: jnp.sum(eqx.combine(a, frozen)(X)))(adapters)
    assert len(jax.tree.leaves(grads)) == 4


# --- sharding -------------------------------------------------------------------------------------


# On the suite's 8 CPU devices, a 2 x 4 mesh: LoRA adapters of a sharded base are sharded like
# it (`A`'s input dim as the base's, `B`'s output dim as the base's, the rank replicated, the
# layer axis as the base's), and a sharded forward matches.
SHARDED_CONFIG = LoraConfig(r=2, target_modules="all-linear")


@pytest.fixture(scope="module")
def sharded_base():
    """A stack of 4 linear layers, each weight split over "model" by rows and "data" by
    columns, and a head split over "data" by rows: `{"layers": ..., "head": ...}`."""
    mesh = mesh_of((2, 4), ("data", "model"))
    keys = keys_of(4)
    stacked = eqx_lean.build_stacked(lambda k: eqx.nn.Linear(16, 16, use_bias=False, key=k), keys)
    stacked = eqx.tree_at(
        lambda m: m.weight,
        stacked,
        jax.device_put(stacked.weight, NamedSharding(mesh, P(None, "model", "data"))),
    )
    head = eqx.nn.Linear(16, 8, key=jax.random.key(1))
    head = eqx.tree_at(
        lambda m: m.weight, head, jax.device_put(head.weight, NamedSharding(mesh, P("data", None)))
    )
    return {"layers": stacked, "head": head}


@pytest.mark.cpu_mesh
def test_adapters_are_sharded_like_the_base_on_8_devices(sharded_base):
    lora = add_lora(sharded_base, SHARDED_CONFIG, key=jax.random.key(2))
    layers, out = lora["layers"], lora["head"]
    assert layers.lora_A.sharding.spec == P(None, None, "data"), layers.lora_A.sharding
    assert layers.lora_B.sharding.spec == P(None, "model", None), layers.lora_B.sharding
    assert out.lora_A.sharding.spec == P(None, None), out.lora_A.sharding
    assert out.lora_B.sharding.spec == P("data", None), out.lora_B.sharding
    # The same values as unsharded.
    plain = add_lora(jax.device_get(sharded_base), SHARDED_CONFIG, key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(layers.lora_A), np.asarray(plain["layers"].lora_A))


@pytest.mark.cpu_mesh
def test_a_layer_axis_sharded_in_the_base_is_sharded_in_the_adapters(sharded_base):
    stacked = sharded_base["layers"]
    mesh = stacked.weight.sharding.mesh
    by_layer = eqx.tree_at(
        lambda m: m.weight,
        stacked,
        jax.device_put(stacked.weight, NamedSharding(mesh, P("data", "model", None))),
    )
    adapted = add_lora(by_layer, LoraConfig(r=2, target_modules=".*"), key=jax.random.key(3))
    assert adapted.lora_A.sharding.spec == P("data", None, None), adapted.lora_A.sharding
    assert adapted.lora_B.sharding.spec == P("data", "model", None), adapted.lora_B.sharding


@pytest.mark.cpu_mesh
def test_loaded_adapters_of_a_sharded_base_are_placed_like_fresh_ones(sharded_base, tmp_path):
    """And the sharded forward of the loaded adapters matches that of the saved ones."""
    lora = add_lora(sharded_base, SHARDED_CONFIG, key=jax.random.key(2))

    def adapter_names(path, leaf):
        del leaf
        key = jax.tree_util.keystr(path)
        return key.replace("['layers'].", "layers.{i}.").replace("['head'].", "head.")

    lora = eqx.tree_at(lambda m: m["layers"].lora_B, lora, jnp.ones_like(lora["layers"].lora_B))
    save_adapters(lora, tmp_path / "adapters", adapter_names)
    loaded = load_adapters(sharded_base, tmp_path / "adapters", adapter_names)
    assert loaded["layers"].lora_A.sharding.spec == P(None, None, "data")
    assert loaded["layers"].lora_B.sharding.spec == P(None, "model", None)
    x = jnp.ones((3, 16))

    def forward(layer, h):
        return jnp.tanh(layer.project(h)) * 2

    y = eqx_lean.fold(loaded["layers"], x, call=forward)
    want = eqx_lean.fold(lora["layers"], x, call=forward)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6)


# --- PEFT's format with a user's name function --------------------------------------------------


def test_peft_round_trip_with_a_name_function(tmp_path):
    model = make_model()
    config = LoraConfig(r=RANK, lora_alpha=4, target_modules=("attn", "down", "head"))
    lora = randomized(add_lora(model, config, key=jax.random.key(1)))
    save_adapters(lora, tmp_path, names, base_model_name_or_path="me/model")
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["target_modules"] == ["attn", "down", "head"] and saved["r"] == RANK
    assert saved["base_model_name_or_path"] == "me/model" and saved["task_type"] is None
    from safetensors.numpy import load_file

    tensors = load_file(tmp_path / "adapter_model.safetensors")
    expected = {
        f"base_model.model.{m}.{x}.weight"
        for m in [f"layers.{i}.{p}" for i in range(LAYERS) for p in ("attn", "mlp.down")] + ["head"]
        for x in ("lora_A", "lora_B")
    }
    assert set(tensors) == expected
    np.testing.assert_array_equal(
        tensors["base_model.model.layers.1.mlp.down.lora_B.weight"], lora.layers.mlp.down.lora_B[1]
    )
    loaded = load_adapters(model, tmp_path, names)
    assert lora_paths(loaded) == lora_paths(lora)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(lora), strict=True):
        np.testing.assert_array_equal(got, want)
    assert loaded.head.config == config


def write_peft(path: pathlib.Path, targets, tensors: dict) -> None:
    """An adapter directory as PEFT's `save_pretrained` writes it, by hand."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    peft = {"peft_type": "LORA", "r": RANK, "lora_alpha": 4, "target_modules": targets}
    (path / "adapter_config.json").write_text(json.dumps(peft))
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})


def test_peft_adapters_of_some_layers_load_train_and_save_back(tmp_path):
    model = make_model()
    rng = np.random.default_rng(0)
    targets = ["layers.0.mlp.up", "layers.2.mlp.up"]
    tensors = {}
    for i in (0, 2):
        name = f"base_model.model.layers.{i}.mlp.up"
        tensors[f"{name}.lora_A.weight"] = rng.normal(size=(RANK, DIM)).astype(np.float32)
        tensors[f"{name}.lora_B.weight"] = rng.normal(size=(HIDDEN, RANK)).astype(np.float32)
    write_peft(tmp_path / "peft", targets, tensors)
    lora = load_adapters(model, tmp_path / "peft", names)
    up = lora.layers.mlp.up
    assert lora_paths(lora) == (".layers.mlp.up",) and up.layers == (0, 2)
    np.testing.assert_array_equal(up.lora_A[1], 0.0)
    np.testing.assert_array_equal(up.lora_B[1], 0.0)
    np.testing.assert_array_equal(
        up.lora_B[2], tensors["base_model.model.layers.2.mlp.up.lora_B.weight"]
    )
    # Layer 1 runs as the base model's layer 1.
    layers = eqx_lean.unstack(lora.layers)
    base_layers = eqx_lean.unstack(model.layers)
    np.testing.assert_allclose(layers[1](X), base_layers[1](X), rtol=1e-6, atol=1e-6)
    assert not np.allclose(layers[0](X), base_layers[0](X))
    # Training leaves layer 1 without an adapter: A = B = 0 there get zero gradients.
    adapters, frozen = eqx.partition(lora, lora_filter(lora))
    grads = jax.grad(lambda a: jnp.sum(eqx.combine(a, frozen)(X) ** 2))(adapters)
    np.testing.assert_array_equal(grads.layers.mlp.up.lora_A[1], 0.0)
    np.testing.assert_array_equal(grads.layers.mlp.up.lora_B[1], 0.0)
    # Saved back with the same selection and tensors.
    save_adapters(lora, tmp_path / "ours", names)
    from safetensors.numpy import load_file

    again = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert set(again) == set(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(again[name], value)
    saved = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert saved["target_modules"] == targets
    # A nonzero adapter in a layer PEFT's selection leaves out cannot be saved.
    bad = eqx.tree_at(lambda m: m.layers.mlp.up.lora_B, lora, up.lora_B.at[1].set(1.0))
    with pytest.raises(
        ValueError,
        match=r"adapted in layers \[0, 2\] only, but its lora_B is nonzero in layers \[1\]",
    ):
        save_adapters(bad, tmp_path / "bad", names)


def test_peft_loads_refuse_other_modules_layers_and_tensors(tmp_path):
    model = make_model()
    write_peft(tmp_path / "q", ["q_proj"], {})
    with pytest.raises(
        ValueError,
        match=r"field `target_modules` must name modules of `model`.*\['q_proj'\] name none",
    ):
        load_adapters(model, tmp_path / "q", names)
    write_peft(tmp_path / "layer", ["layers.3.attn"], {})  # the model has layers 0 to 2
    with pytest.raises(ValueError, match="name none"):
        load_adapters(model, tmp_path / "layer", names)
    extra = {
        "base_model.model.head.lora_A.weight": np.zeros((RANK, DIM), np.float32),
        "base_model.model.head.lora_B.weight": np.zeros((4, RANK), np.float32),
        "base_model.model.head.lora_magnitude_vector": np.ones(4, np.float32),
    }
    write_peft(tmp_path / "dora", ["head"], extra)
    with pytest.raises(ValueError, match="lora_magnitude_vector"):
        load_adapters(model, tmp_path / "dora", names)


def test_real_peft_loads_our_adapters_with_the_same_outputs(tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    config = LoraConfig(r=RANK, lora_alpha=4, target_modules=r"layers\.[02]\.(attn|mlp\.up)|head")
    lora = randomized(add_lora(make_model(), config, key=jax.random.key(1), names=names))
    save_adapters(lora, tmp_path, names)

    class TorchMlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(DIM, HIDDEN, bias=False)
            self.down = torch.nn.Linear(HIDDEN, DIM, bias=False)

    class TorchBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.Linear(DIM, DIM)
            self.mlp = TorchMlp()

        def forward(self, x):
            h = x + torch.tanh(self.attn(x))
            return h + self.mlp.down(torch.tanh(self.mlp.up(h)))

    class TorchModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([TorchBlock() for _ in range(LAYERS)])
            self.head = torch.nn.Linear(DIM, 4)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    base = make_model()
    torch_model = TorchModel()
    flat = jax.tree_util.tree_flatten_with_path(base)[0]
    with torch.no_grad():
        params = dict(torch_model.named_parameters())
        for path, leaf in flat:
            name = names(path, leaf)
            if "{i}" in name:
                for i in range(LAYERS):
                    params[name.replace("{i}", str(i))].copy_(torch.from_numpy(np.asarray(leaf[i])))
            else:
                params[name].copy_(torch.from_numpy(np.asarray(leaf)))
    wrapped = peft.PeftModel.from_pretrained(torch_model, str(tmp_path)).eval()
    xs = np.asarray(jax.random.normal(jax.random.key(4), (5, DIM)))
    with torch.no_grad():
        theirs = wrapped(torch.from_numpy(xs)).numpy()
    ours = np.asarray(jax.vmap(lora)(jnp.asarray(xs)))
    assert not np.allclose(theirs, np.asarray(jax.vmap(base)(jnp.asarray(xs))), atol=1e-3)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    assert lora.layers.attn.layers == (0, 2) and lora.head.layers is None


# --- memory -----------------------------------------------------------------------------------

# The bar of `tests/test_scan.py::test_lora_gradient_temporaries_on_every_remat_mode` (issue 15),
# on the same benchmark shapes: half the bfloat16 stack.
BENCH_LAYERS, BENCH_DIM, BENCH_RANK, BENCH_BATCH = 16, 2048, 8, 4
HALF_THE_BFLOAT16_STACK = BENCH_LAYERS * BENCH_DIM * BENCH_DIM * 2 // 2  # 64 MiB


class BenchLayer(eqx.Module):
    proj: eqx.nn.Linear

    def __call__(self, x: Array) -> Array:
        # The base product reads the bfloat16 input and weight (as the HF decoder runs).
        return jnp.tanh(self.proj(x.astype(jnp.bfloat16)).astype(jnp.float32))


@pytest.mark.parametrize("remat", [True, None], ids=["remat", "no-remat"])
def test_adapter_gradient_temporaries_on_a_bfloat16_base(remat):
    def build():
        keys = keys_of(BENCH_LAYERS)
        stacked = eqx.filter_vmap(
            lambda k: BenchLayer(eqx.nn.Linear(BENCH_DIM, BENCH_DIM, use_bias=False, key=k))
        )(keys)
        stacked = jax.tree.map(lambda a: a.astype(jnp.bfloat16), stacked)
        return add_lora(
            stacked, LoraConfig(r=BENCH_RANK, target_modules=("proj",)), key=jax.random.key(1)
        )

    stacked = eqx.filter_eval_shape(build)
    adapters, frozen = eqx.partition(stacked, lora_filter(stacked))
    assert [leaf.dtype for leaf in jax.tree.leaves(adapters)] == [jnp.float32] * 2
    x = jax.ShapeDtypeStruct((BENCH_BATCH, BENCH_DIM), jnp.float32)

    @jax.jit
    def gradient(adapters, frozen, x):
        def loss(adapters):
            return jnp.sum(eqx_lean.fold(eqx.combine(adapters, frozen), x, remat=remat) ** 2)

        return jax.grad(loss)(adapters)

    analysis = gradient.lower(adapters, frozen, x).compile().memory_analysis()
    assert analysis is not None  # XLA:CPU always reports it
    assert analysis.temp_size_in_bytes <= HALF_THE_BFLOAT16_STACK, (
        analysis.temp_size_in_bytes / 2**20
    )
