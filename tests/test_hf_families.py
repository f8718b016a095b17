"""The Llama and Qwen2 families against `transformers` (eager attention, float32): loading in
both `config.json` forms, saving back, the per-layer attention window, tied embeddings, the end
ids `generate` stops at, and the refusals."""

import dataclasses
import json
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from test_mistral import hf_logits, max_diff, randomized

from eqx_lean.hf import Decoder, DecoderConfig, generate, init, load_hf, save_hf


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPE: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = dict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
)

# Each family as transformers 5 builds it, and the same model's hand-written transformers-4
# `config.json` (top-level `rope_theta`, `rope_scaling`, `torch_dtype`, Qwen2's
# `use_sliding_window`/`max_window_layers` instead of `layer_types`).
FAMILIES: dict[str, tuple[Any, dict[str, Any], dict[str, Any]]] = {
    "llama2": (
        "LlamaConfig",
        dict(
            SHAPE,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attention_bias=True,
            mlp_bias=True,
        ),
        dict(
            SHAPE,
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            hidden_act="silu",
            rope_theta=10000.0,
            rope_scaling=None,
            attention_bias=True,
            mlp_bias=True,
            pretraining_tp=1,
            tie_word_embeddings=False,
            torch_dtype="float32",
            bos_token_id=1,
            eos_token_id=2,
            transformers_version="4.46.0",
        ),
    ),
    "llama3": (
        "LlamaConfig",
        dict(
            SHAPE,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_ROPE},
            tie_word_embeddings=True,
        ),
        dict(
            SHAPE,
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            hidden_act="silu",
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", **LLAMA3_ROPE},
            attention_bias=False,
            mlp_bias=False,
            pretraining_tp=1,
            tie_word_embeddings=True,
            torch_dtype="float32",
            bos_token_id=1,
            eos_token_id=[2, 3],
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(
            SHAPE,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            use_sliding_window=False,
            sliding_window=4,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
        dict(
            SHAPE,
            model_type="qwen2",
            architectures=["Qwen2ForCausalLM"],
            hidden_act="silu",
            rope_theta=1e6,
            rope_scaling=None,
            use_sliding_window=False,
            sliding_window=4,
            max_window_layers=1,
            tie_word_embeddings=True,
            torch_dtype="float32",
            attention_dropout=0.0,
            bos_token_id=5,
            eos_token_id=6,
        ),
    ),
}
SEQ = 13  # longer than Qwen2's (disabled) window of 4


def hf_model(family: str, seed: int = 0, **overrides):
    """A tiny random model of `family` with std-0.2 matrices and biases, non-trivial norms."""
    class_name, kwargs, _ = FAMILIES[family]
    config = getattr(transformers, class_name)(**(kwargs | overrides))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomized(transformers.AutoModelForCausalLM.from_config(config))


def tokens(seed: int, batch: int = 2, seq: int = SEQ) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128, (batch, seq)).astype(np.int32)


def write_checkpoint(path, family: str, form: str, **overrides):
    """Saves `hf_model(family)` to `path`; `form="v4"` replaces its config with the
    hand-written transformers-4 one."""
    hf = hf_model(family, **overrides)
    hf.save_pretrained(path)
    if form == "v4":
        (path / "config.json").write_text(json.dumps(FAMILIES[family][2] | overrides))
    return hf


@pytest.mark.parametrize("form", ["v5", "v4"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_load_and_save_match_transformers(tmp_path, family, form):
    hf = write_checkpoint(tmp_path / "hf", family, form)
    ids = tokens(1)
    expected = hf_logits(hf, ids)
    model = load_hf(tmp_path / "hf")
    assert isinstance(model, Decoder) and model.config.model_type == family[:5]
    tied = family != "llama2"
    assert (model.lm_head is None) == tied
    ours = model(jnp.asarray(ids))
    assert ours.shape == (2, SEQ, 128) and ours.dtype == jnp.float32
    assert max_diff(ours, expected) < 1e-4

    save_hf(model, tmp_path / "ours")
    stored = safetensors.numpy.load_file(tmp_path / "ours" / "model.safetensors")
    assert ("lm_head.weight" in stored) != tied and "model.embed_tokens.weight" in stored
    if family == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in stored
        assert "model.layers.0.self_attn.o_proj.bias" not in stored
    if family == "llama2":
        assert "model.layers.2.self_attn.o_proj.bias" in stored
        assert "model.layers.2.mlp.down_proj.bias" in stored
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    ).eval()
    assert max_diff(hf_logits(back, ids), expected) < 1e-4


def test_llama3_rope_frequencies_are_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from eqx_lean.internal import Llama3Rope, inverse_frequencies

    config = transformers.LlamaConfig(
        **dict(SHAPE, head_dim=64, num_attention_heads=1),
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_ROPE},
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = inverse_frequencies(64, 500000.0, Llama3Rope(**LLAMA3_ROPE))  # type: ignore[arg-type]
    default = inverse_frequencies(64, 500000.0, None)
    assert not np.allclose(ours, default)  # the scaling changes some frequencies
    np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-6)


def test_qwen2_per_layer_windows(tmp_path):
    # Layer 0 attends to everything, layers 1 and 2 to their 4 most recent positions.
    hf = write_checkpoint(tmp_path, "qwen2", "v5", use_sliding_window=True)
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    model = load_hf(tmp_path)
    assert model.config.layer_windows == (None, 4, 4) and model.config.max_window is None
    ids = tokens(2)
    assert max_diff(model(jnp.asarray(ids)), hf_logits(hf, ids)) < 1e-4
    # ... and the window matters: the same weights attending to everything differ.
    assert max_diff(model(jnp.asarray(ids)), hf_logits(hf_model("qwen2"), ids)) > 1e-2
    # Incremental decoding carries the windows too: its logits are the full forward's.
    out, logits = generate(model, jnp.asarray(ids[:, :5]), 8, return_logits=True, eos_token_id=())
    full = model(out)[:, 4:-1]
    assert max_diff(logits, full) < 1e-4
    # The same windows, written back and read by transformers.
    save_hf(model, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    ).eval()
    assert back.config.layer_types == hf.config.layer_types
    assert max_diff(hf_logits(back, ids), hf_logits(hf, ids)) < 1e-4


def test_qwen2_released_form_has_no_window():
    # Released Qwen2.5 files: a `sliding_window` value, but `use_sliding_window: false`.
    config = DecoderConfig.from_hf(FAMILIES["qwen2"][2])
    assert config.layer_windows == (None, None, None) and config.sliding_window is None
    config = DecoderConfig.from_hf(FAMILIES["qwen2"][2] | {"use_sliding_window": True})
    assert config.layer_windows == (None, 4, 4)
    assert (config.attention_bias, config.o_proj_bias, config.mlp_bias) == (True, False, False)


def test_tied_checkpoint_with_a_stored_head(tmp_path):
    model = init(DecoderConfig.from_hf(FAMILIES["llama3"][2]), key=jax.random.key(0), std=0.2)
    assert model.lm_head is None
    save_hf(model, tmp_path)
    weights = tmp_path / "model.safetensors"
    stored = safetensors.numpy.load_file(weights)
    embed = stored["model.embed_tokens.weight"]
    safetensors.numpy.save_file(stored | {"lm_head.weight": embed.copy()}, weights)
    loaded = load_hf(tmp_path)  # a head equal to the embedding is the tied head
    assert loaded.lm_head is None
    np.testing.assert_array_equal(loaded.embed_tokens.weight, model.embed_tokens.weight)
    safetensors.numpy.save_file(stored | {"lm_head.weight": embed + 1}, weights)
    with pytest.raises(
        ValueError,
        match=r"config\.json ties .*'lm_head\.weight' and "
        r"'model\.embed_tokens\.weight' differ",
    ):
        load_hf(tmp_path)


def _first_greedy(model, prompt, steps: int) -> np.ndarray:
    return np.asarray(generate(model, prompt, steps, eos_token_id=()))[0, prompt.shape[1] :]


def test_generate_stops_at_any_eos(tmp_path):
    write_checkpoint(tmp_path, "llama3", "v4")
    (tmp_path / "generation_config.json").unlink()  # transformers wrote config.json's first id
    model = load_hf(tmp_path)
    assert model.config.stop_token_ids == (2, 3)
    prompt = jnp.asarray(tokens(3, batch=1, seq=4))
    free = _first_greedy(model, prompt, 12)
    index = next(i for i in range(3, 12) if free[i] not in free[:i])
    # config.json's list: the sequence ends at the first of its ids, included.
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps(config | {"eos_token_id": [127, int(free[index])]})
    )
    stopped = np.asarray(generate(load_hf(tmp_path), prompt, 12))[0, 4:]
    np.testing.assert_array_equal(stopped, free[: index + 1])
    # generation_config.json's ids win over config.json's, as in transformers.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": int(free[1])}))
    loaded = load_hf(tmp_path)
    assert loaded.config.stop_token_ids == (int(free[1]),)
    stopped = np.asarray(generate(loaded, prompt, 12))[0, 4:]
    assert list(stopped) == list(free[: list(free).index(free[1]) + 1])
    # A finished row is padded with the first end id while the others go on.
    both = jnp.concatenate([prompt, jnp.asarray(tokens(4, batch=1, seq=4))])
    ids = np.asarray(generate(model, both, 12, eos_token_id=[int(free[index])]))
    assert ids.shape[1] <= 16
    np.testing.assert_array_equal(ids[0, 4 : 4 + index + 1], free[: index + 1])
    assert np.all(ids[0, 4 + index + 1 :] == free[index])


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"model_type": "gpt2"}, r"'gpt2'.*eqx_lean\.load_tensors.*docs/io\.md"),
        ({"hidden_act": "gelu"}, r"`hidden_act` must be 'silu'"),
        ({"attention_dropout": 0.1}, r"`attention_dropout` must be 0"),
        ({"pretraining_tp": 2}, r"`pretraining_tp` must be 1"),
        ({"rope_scaling": {"type": "linear"}}, r"`rope_scaling\.factor` must be a number"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_type 'dynamic'"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 0}},
            r"`rope_parameters\.factor` must be a number above 0",
        ),
        ({"rope_scaling": {"rope_type": "longrope"}}, r"rope_type 'longrope'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"must give \['low_freq"),
        ({"partial_rotary_factor": 0.5}, r"`partial_rotary_factor` must be 1"),
        ({"head_dim": 15}, r"`head_dim` must be a positive even integer"),
        ({"eos_token_id": "</s>"}, r"`eos_token_id` must be an integer"),
    ],
)
def test_refusals_name_file_and_field(tmp_path, fields, message):
    (tmp_path / "config.json").write_text(json.dumps(FAMILIES["llama2"][2] | fields))
    with pytest.raises(ValueError, match=r"config\.json is not a config eqx_lean\.hf reads: "):
        DecoderConfig.from_json(tmp_path)
    with pytest.raises(ValueError, match=message):
        DecoderConfig.from_json(tmp_path)


def test_qwen2_layer_types_and_aliases():
    import pickle

    import eqx_lean.hf

    # The names before `Decoder`: the same classes, reached with a warning.
    with pytest.warns(DeprecationWarning, match=r"eqx_lean\.hf\.Mistral` is deprecated"):
        assert eqx_lean.hf.Mistral is Decoder
    with pytest.warns(DeprecationWarning, match=r"use `eqx_lean\.hf\.DecoderConfig`"):
        old = eqx_lean.hf.MistralConfig
    assert old is DecoderConfig and isinstance(DecoderConfig(), old)
    # A config pickled under the old name (its class's module path then) still loads.
    blob = pickle.dumps(DecoderConfig()).replace(b"DecoderConfig", b"MistralConfig")
    assert pickle.loads(blob) == DecoderConfig()
    # One pickled before the block options existed: they are its family's.
    options = ("hidden_act", "norm_unit_offset", "post_norms", "qk_norm", "scale_embeddings")
    state = {k: v for k, v in vars(DecoderConfig()).items() if k not in options}
    restored = DecoderConfig.__new__(DecoderConfig)
    restored.__setstate__(state)
    assert restored == DecoderConfig() and restored.hidden_act == "silu"
    with pytest.raises(AttributeError, match="has no attribute 'Mistral7B'"):
        eqx_lean.hf.Mistral7B  # noqa: B018
    with pytest.raises(ValueError, match=r"`layer_types` must give one of"):
        DecoderConfig.from_hf(FAMILIES["qwen2"][2] | {"layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match=r"\(attention_bias, o_proj_bias, mlp_bias\)"):
        DecoderConfig(model_type="qwen2", sliding_window=None)


PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_adapters_per_family(tmp_path, family):
    peft = pytest.importorskip("peft")
    from eqx_lean.hf import load_adapters

    hf = write_checkpoint(tmp_path / "base", family, "v5")
    settings = dict(r=4, lora_alpha=8, init_lora_weights=False)
    torch.manual_seed(1)
    adapted = peft.get_peft_model(hf, peft.LoraConfig(target_modules=PEFT_TARGETS, **settings))
    adapted.save_pretrained(tmp_path / "adapter")
    ids = tokens(5)
    expected = hf_logits(adapted.eval(), ids)
    model = load_adapters(load_hf(tmp_path / "base"), tmp_path / "adapter")
    assert max_diff(model(jnp.asarray(ids)), expected) < 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapters_saved_here_load_in_peft_per_family(tmp_path, family):
    """The other direction: adapters made here (B drawn nonzero, as after training) load in
    `PeftModel` on the family's `transformers` model with the same logits."""
    peft = pytest.importorskip("peft")
    from eqx_lean.hf import save_adapters
    from eqx_lean.lora import LoraConfig, LoraLinear, add_lora

    write_checkpoint(tmp_path / "base", family, "v5")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=tuple(PEFT_TARGETS))
    model = add_lora(load_hf(tmp_path / "base"), config, key=jax.random.key(2))
    keys = iter(jax.random.split(jax.random.key(3), 64))

    def nonzero_b(node):
        if isinstance(node, LoraLinear):
            b = 0.3 * jax.random.normal(next(keys), node.lora_B.shape, node.lora_B.dtype)
            return eqx.tree_at(lambda n: n.lora_B, node, b)
        return node

    model = jax.tree.map(nonzero_b, model, is_leaf=lambda n: isinstance(n, LoraLinear))
    save_adapters(model, tmp_path / "ours")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    base.config._attn_implementation = "eager"
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "ours").eval()
    ids = tokens(6)
    expected = hf_logits(loaded, ids)
    assert max_diff(model(jnp.asarray(ids)), expected) < 1e-4
    # The adapters matter (PEFT wrapped `base` in place: compare with a fresh load).
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    assert max_diff(expected, hf_logits(plain, ids)) > 1e-2


def test_generation_end_ids_are_not_part_of_the_model_config():
    """`generation_config.json`'s end ids change what `generate` stops at, not the model: a
    save and a load beside any generation file give back an equal (and equally hashed) config,
    so no compiled program is told apart by them."""
    plain = DecoderConfig(model_type="llama", sliding_window=None, eos_token_id=(2,))
    with_generation = dataclasses.replace(plain, generation_eos_token_id=())
    assert with_generation == plain and hash(with_generation) == hash(plain)
    assert with_generation.stop_token_ids == () and plain.stop_token_ids == (2,)
