"""Qwen3, Gemma 2 and Gemma 3 against `transformers` 5.18 and PEFT (float32, eager attention).

Each family is one tiny random checkpoint written by `transformers` (module fixture), and the
same weights beside a hand-written `config.json` of the older form the hub's checkpoints carry
(top-level `rope_theta`, `rope_scaling`, Gemma 3's `rope_local_base_freq` and
`sliding_window_pattern`, no `layer_types`). Norm weights and biases are drawn away from their
initial values; Gemma 2's `query_pre_attn_scalar` differs from `head_dim` and its soft caps
bite; Gemma 3 has local and global layers (its global rope `linear`-scaled) and every sequence
is longer than its window. One forward per family and attention kind is compiled.
"""

import dataclasses
import json
import pathlib
import shutil
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from test_mistral import hf_logits, max_diff

from eqx_lean.hf import (
    Decoder,
    DecoderConfig,
    generate,
    load_adapters,
    load_hf,
    next_token_loss,
    save_adapters,
    save_hf,
)
from eqx_lean.internal import LinearRope
from eqx_lean.lora import LoraConfig, LoraLinear, add_lora


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPE: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
WINDOW = 4
GEMMA3_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]

# Each family: its transformers-5 config class and fields, and the same model's older-form
# `config.json` as the hub's checkpoints carry it.
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # Untied head, biases on all four attention projections, q/k norms.
    "qwen3": (
        "Qwen3Config",
        dict(
            SHAPE,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            attention_bias=True,
            tie_word_embeddings=False,
            bos_token_id=5,
            eos_token_id=6,
        ),
        dict(
            SHAPE,
            model_type="qwen3",
            architectures=["Qwen3ForCausalLM"],
            hidden_act="silu",
            rope_theta=1e6,
            rope_scaling=None,
            attention_bias=True,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=28,
            tie_word_embeddings=False,
            torch_dtype="float32",
            bos_token_id=5,
            eos_token_id=6,
        ),
    ),
    # Tied head, alternating windows, query scale of 24 (head_dim 16), both soft caps.
    "gemma2": (
        "Gemma2Config",
        dict(
            SHAPE,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=3.0,
        ),
        dict(
            SHAPE,
            model_type="gemma2",
            architectures=["Gemma2ForCausalLM"],
            hidden_act="gelu_pytorch_tanh",
            hidden_activation="gelu_pytorch_tanh",
            rope_theta=10000.0,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=3.0,
            cache_implementation="hybrid",
            torch_dtype="float32",
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        ),
    ),
    # Untied head with attention biases, q/k norms, local (θ 1e4) and global (θ 1e6, linear
    # scaling 8) layers.
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            SHAPE,
            query_pre_attn_scalar=20,
            sliding_window=WINDOW,
            layer_types=GEMMA3_LAYERS,
            attention_bias=True,
            tie_word_embeddings=False,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        dict(
            SHAPE,
            model_type="gemma3_text",
            architectures=["Gemma3ForCausalLM"],
            hidden_activation="gelu_pytorch_tanh",
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            sliding_window_pattern=2,  # layers 0 and 2 slide, as GEMMA3_LAYERS
            query_pre_attn_scalar=20,
            sliding_window=WINDOW,
            attention_bias=True,
            tie_word_embeddings=False,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            torch_dtype="float32",
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        ),
    ),
}
SEQ = 13  # longer than the windows of 4


def randomized(model, gemma: bool):
    """`model` in eval mode, matrices and biases drawn with std 0.2, norm weights around their
    identity (1; Gemma's, which multiply by `1 + w`, around 0) with std 0.5."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_((0.0 if gemma else 1.0) + 0.5 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2)
    return model.eval()


def hf_model(family: str, seed: int = 0, **overrides):
    class_name, fields, _ = FAMILIES[family]
    config = getattr(transformers, class_name)(**(fields | overrides))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    made = transformers.AutoModelForCausalLM.from_config(config)
    return randomized(made, gemma=family != "qwen3")


def tokens(seed: int, batch: int = 2, seq: int = SEQ) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128, (batch, seq)).astype(np.int32)


def from_pretrained(path: pathlib.Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager"
    ).eval()


class Checkpoint:
    """One family's tiny checkpoint in both config forms, the transformers model, and ours."""

    def __init__(self, root: pathlib.Path, family: str):
        self.family = family
        self.v5, self.v4 = root / "v5", root / "v4"
        self.hf = hf_model(family)
        self.hf.save_pretrained(self.v5)
        shutil.copytree(self.v5, self.v4)
        (self.v4 / "config.json").write_text(json.dumps(FAMILIES[family][2]))
        self.model = load_hf(self.v5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Checkpoint]:
    return {family: Checkpoint(tmp_path_factory.mktemp(family), family) for family in FAMILIES}


forward = eqx.filter_jit(lambda model, ids, attention: model(ids, attention=attention))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_in_both_config_forms(checkpoints, family):
    checkpoint = checkpoints[family]
    ids = tokens(1)
    expected = hf_logits(checkpoint.hf, ids)
    model = checkpoint.model
    assert (model.lm_head is None) == (family == "gemma2")
    for attention in ("eager", "blockwise"):
        assert max_diff(forward(model, jnp.asarray(ids), attention), expected) < 2e-5
    # The hub's form: transformers reads it as the same model, and so do we (the same config,
    # so the same compiled forward, and the same weights).
    assert max_diff(hf_logits(from_pretrained(checkpoint.v4), ids), expected) < 1e-6
    old = load_hf(checkpoint.v4)
    assert old.config == model.config
    assert max_diff(forward(old, jnp.asarray(ids), "blockwise"), expected) < 2e-5


# The other head (and biases, windows) of each family: its tied or untied variant.
VARIANTS: dict[str, dict[str, Any]] = {
    "qwen3": dict(
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    ),
    "gemma2": dict(tie_word_embeddings=False, attention_bias=True),
    "gemma3": dict(tie_word_embeddings=True, attention_bias=False),
}


@pytest.mark.parametrize("family", list(VARIANTS))
def test_the_other_head_matches_transformers(family, tmp_path):
    hf = hf_model(family, seed=4, **VARIANTS[family])
    hf.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    assert (model.lm_head is None) == VARIANTS[family]["tie_word_embeddings"]
    if family == "qwen3":
        assert model.config.layer_windows == (None, WINDOW, WINDOW)
    ids = tokens(6)
    expected = hf_logits(hf, ids)
    for attention in ("eager", "blockwise"):
        assert max_diff(forward(model, jnp.asarray(ids), attention), expected) < 2e-5
    save_hf(model, tmp_path / "ours")
    assert max_diff(hf_logits(from_pretrained(tmp_path / "ours"), ids), expected) < 1e-6


def test_family_options_as_read(checkpoints):
    qwen3, gemma2, gemma3 = (checkpoints[f].model.config for f in FAMILIES)
    assert qwen3.qk_norm and not qwen3.post_norms and qwen3.hidden_act == "silu"
    assert (qwen3.attention_bias, qwen3.o_proj_bias) == (True, True)
    assert gemma2.post_norms and gemma2.norm_unit_offset and gemma2.scale_embeddings
    assert not gemma2.qk_norm and gemma2.hidden_act == "gelu_pytorch_tanh"
    assert gemma2.attention_scale == 24**-0.5 and gemma2.layer_windows == (WINDOW, None, WINDOW)
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (1.5, 3.0)
    assert gemma3.qk_norm and gemma3.local_rope_layers == (True, False, True)
    assert (gemma3.rope_theta, gemma3.rope_local_base_freq) == (1e6, 1e4)
    assert gemma3.rope_scaling == LinearRope(factor=8.0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_hf_loads_in_transformers(checkpoints, family, tmp_path):
    checkpoint = checkpoints[family]
    save_hf(checkpoint.model, tmp_path)
    back = from_pretrained(tmp_path)
    for field in ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters"):
        assert getattr(back.config, field, None) == getattr(checkpoint.hf.config, field, None)
    ids = tokens(2)
    assert max_diff(hf_logits(back, ids), hf_logits(checkpoint.hf, ids)) < 1e-6


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_picks_the_argmax_of_transformers_forward(checkpoints, family):
    """Each token `generate` picks (its KV cache over windowed and full layers alike) is the
    argmax of transformers' full forward on the same prefix."""
    checkpoint = checkpoints[family]
    prompt = tokens(3, batch=1, seq=5)
    out = np.asarray(generate(checkpoint.model, jnp.asarray(prompt), 9, eos_token_id=()))
    assert out.shape == (1, 14)  # past the window of 4
    for step in range(5, out.shape[1]):
        logits = hf_logits(checkpoint.hf, out[:, :step])[0, -1]
        assert out[0, step] == int(np.argmax(logits)), f"step {step - 5}"


def test_gemma2_loss_with_its_final_soft_cap_matches_transformers(checkpoints):
    """The fused loss caps each chunk of logits as the model caps them: both paths give
    transformers' loss (its `labels`), and the cap matters to it."""
    checkpoint = checkpoints["gemma2"]
    ids = tokens(7)
    with torch.no_grad():
        tensor = torch.from_numpy(ids.astype(np.int64))
        expected = float(checkpoint.hf(tensor, labels=tensor).loss)
    loss = eqx.filter_jit(lambda model, ids, fused: next_token_loss(model, ids, fused=fused))
    for fused in (True, False):
        assert abs(float(loss(checkpoint.model, jnp.asarray(ids), fused)) - expected) < 1e-5
    uncapped = dataclasses.replace(checkpoint.model.config, final_logit_softcapping=None)
    capped = checkpoint.model
    model = Decoder(capped.embed_tokens, capped.layers, capped.norm, capped.lm_head, uncapped)
    assert abs(float(loss(model, jnp.asarray(ids), True)) - expected) > 1e-2


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_adapters_both_ways(checkpoints, family, tmp_path):
    peft = pytest.importorskip("peft")
    checkpoint = checkpoints[family]
    ids = tokens(5)
    # PEFT's adapters, loaded here.
    torch.manual_seed(1)
    settings = dict(r=4, lora_alpha=8, init_lora_weights=False, target_modules=TARGETS)
    adapted = peft.get_peft_model(from_pretrained(checkpoint.v5), peft.LoraConfig(**settings))
    adapted.save_pretrained(tmp_path / "peft")
    expected = hf_logits(adapted.eval(), ids)
    model = load_adapters(checkpoint.model, tmp_path / "peft")
    assert max_diff(forward(model, jnp.asarray(ids), "blockwise"), expected) < 1e-4
    # Adapters made here (B drawn nonzero, as after training), loaded by PEFT.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=tuple(TARGETS))
    ours = add_lora(checkpoint.model, config, key=jax.random.key(2))
    keys = iter(jax.random.split(jax.random.key(3), 64))

    def nonzero_b(node):
        if isinstance(node, LoraLinear):
            b = 0.3 * jax.random.normal(next(keys), node.lora_B.shape, node.lora_B.dtype)
            return eqx.tree_at(lambda n: n.lora_B, node, b)
        return node

    ours = jax.tree.map(nonzero_b, ours, is_leaf=lambda n: isinstance(n, LoraLinear))
    save_adapters(ours, tmp_path / "ours")
    loaded = peft.PeftModel.from_pretrained(from_pretrained(checkpoint.v5), tmp_path / "ours")
    expected = hf_logits(loaded.eval(), ids)
    assert max_diff(forward(ours, jnp.asarray(ids), "blockwise"), expected) < 1e-4
    # The adapters matter.
    assert max_diff(expected, hf_logits(checkpoint.hf, ids)) > 1e-2


def test_gemma3_conditional_generation_is_read_as_its_text_tower(tmp_path):
    """A `Gemma3ForConditionalGeneration` (Gemma 3 4B-27B as released) loads as its text tower:
    logits of its text-only forward, its tensors under either prefix, its vision tower's
    ignored and anything else refused; it saves as the `Gemma3ForCausalLM` it is."""
    text = FAMILIES["gemma3"][1] | dict(tie_word_embeddings=True, attention_bias=False)
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=120,
        eoi_token_index=121,
        image_token_index=122,
    )
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(5)
    hf = randomized(transformers.Gemma3ForConditionalGeneration(config), gemma=True)
    hf.save_pretrained(tmp_path / "hf")
    stored = safetensors.numpy.load_file(tmp_path / "hf" / "model.safetensors")
    assert "language_model.model.layers.0.self_attn.q_norm.weight" in stored  # the hub's names
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert DecoderConfig.from_hf(hf_config).model_type == "gemma3_text"
    model = load_hf(tmp_path / "hf")
    assert model.lm_head is None and model.config.layer_windows == (WINDOW, None, WINDOW)
    ids = tokens(8)
    expected = hf_logits(hf, ids)
    for attention in ("eager", "blockwise"):
        assert max_diff(forward(model, jnp.asarray(ids), attention), expected) < 2e-5
    save_hf(model, tmp_path / "ours")
    back = from_pretrained(tmp_path / "ours")
    assert type(back).__name__ == "Gemma3ForCausalLM"
    assert max_diff(hf_logits(back, ids), expected) < 1e-6
    # transformers 5's in-memory names (`model.language_model.`), as some writers store them.
    weights = tmp_path / "hf" / "model.safetensors"
    renamed = {
        name.replace("language_model.model.", "model.language_model.", 1)
        if name.startswith("language_model.model.")
        else "model." + name: value
        for name, value in stored.items()
    }
    safetensors.numpy.save_file(renamed, weights)
    again = load_hf(tmp_path / "hf")
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True)
    )
    # A tensor neither tower has is refused.
    safetensors.numpy.save_file(stored | {"text_head.weight": np.zeros(3, np.float32)}, weights)
    with pytest.raises(ValueError, match=r"neither its text tower's .*'text_head\.weight'"):
        load_hf(tmp_path / "hf")


@pytest.mark.parametrize(
    "family, fields, message",
    [
        ("gemma2", {"hidden_activation": "gelu"}, r"`hidden_activation` must be 'gelu_pytorch"),
        ("gemma2", {"use_bidirectional_attention": True}, r"`use_bidirectional_attention`"),
        ("gemma2", {"attn_logit_softcapping": 0}, r"`attn_logit_softcapping` must be"),
        (
            "gemma3",
            {
                "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}},
                "rope_scaling": None,
                "rope_local_base_freq": None,
            },
            r"`rope_parameters\.sliding_attention` must be the default",
        ),
        (
            "gemma3",
            {"rope_parameters": {"full_attention": {"rope_type": "default"}}},
            r"`rope_scaling` must not be given beside `rope_parameters` per layer type",
        ),
        ("qwen3", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"'dynamic'"),
    ],
)
def test_refusals_name_the_field(family, fields, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig.from_hf(FAMILIES[family][2] | fields)


def test_options_are_the_familys():
    with pytest.raises(ValueError, match=r"`post_norms` must be True for a 'gemma2' model"):
        DecoderConfig(model_type="gemma2", sliding_window=4, post_norms=False)
    with pytest.raises(ValueError, match=r"`final_logit_softcapping` must be None for a 'llama'"):
        DecoderConfig(model_type="llama", sliding_window=None, final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match=r"`rope_local_base_freq` must be given"):
        DecoderConfig(model_type="gemma3_text", sliding_window=4)
