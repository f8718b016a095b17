"""What would give a silently wrong model is refused (issue 39, "nothing silently wrong"):
`generate`'s `cache_size` below what a layer attends to (`eqx_lean/hf/_generate.py`), a rotary
kind not computed here wherever a `config.json` names it (`_rope.py`, against `transformers`'
own reading), the dtype of a `config.json` that states none (`_families.py`, `_checkpoint.py`,
against `from_pretrained`), and sizes the weights do not have, refused before anything is
allocated or built per layer (`_checkpoint.py`)."""

import contextlib
import json
import logging
import re
import resource
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from harness import MICRO_DECODER

from eqx_lean.hf import (
    DecoderConfig,
    abstract_model,
    from_hf_state_dict,
    generate,
    load_hf,
    save_hf,
    to_hf_state_dict,
)
from eqx_lean.internal import YarnRope, inverse_frequencies


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY: dict[str, Any] = MICRO_DECODER
# Every layer attends to everything; every layer has a window of 4; Qwen2's mix of both.
KINDS: dict[str, dict[str, Any]] = {
    "full": {},
    "sliding": dict(sliding_window=4),
    "mixed": dict(
        model_type="qwen2",
        attention_bias=True,
        sliding_window=4,
        layer_types=("sliding_attention", "full_attention"),
    ),
}
PROMPT, NEW = 6, 6  # 12 positions: three windows of 4


def random_model(config: DecoderConfig, seed: int = 0) -> Any:
    """A model of `config` with std-0.5 weights and norms around 1, drawn with NumPy into the
    abstract model's shapes: nothing to compile."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        base = 1.0 if "norm" in jax.tree_util.keystr(path) else 0.0
        return jnp.asarray(base + 0.5 * rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract_model(config))


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {kind: random_model(DecoderConfig(**(TINY | fields))) for kind, fields in KINDS.items()}


def prompt() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).integers(0, 32, (1, PROMPT)), jnp.int32)


# --- generate's cache ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, too_small, needed",
    [
        # A full-attention layer needs every position.
        ("full", 4, 12),
        # A window of 4 needs a ring of 4 (which then wraps: the default size, whose tokens
        # test_mistral.py compares with transformers').
        ("sliding", 2, 4),
        # One full-attention layer among windowed ones needs the whole sequence.
        ("mixed", 4, 12),
    ],
)
def test_generate_refuses_a_cache_that_would_drop_keys_a_layer_reads(
    models, kind, too_small, needed
):
    with pytest.raises(ValueError, match=rf"`cache_size` must be at least {needed} .*got"):
        generate(models[kind], prompt(), NEW, cache_size=too_small, eos_token_id=())


def test_generate_takes_a_cache_larger_than_needed(models):
    model = models["full"]
    ids, logits = generate(model, prompt(), NEW, cache_size=16, return_logits=True, eos_token_id=())
    # The oracle: the whole sequence in one causal forward, no cache at all.
    forward = eqx.filter_jit(lambda m, x: m(x))(model, ids)[:, PROMPT - 1 : PROMPT - 1 + NEW]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(forward), atol=1e-4, rtol=1e-4)


def test_generate_refuses_sizes_and_counts_that_are_not_positive_integers(models):
    # The wrong kind is a TypeError, the wrong size a ValueError (`eqx_lean._arguments`).
    bad_sizes: list[Any] = [True, False, 0, -3, 2.5, "12", np.int64(0)]
    for bad in bad_sizes:
        with pytest.raises(
            (TypeError, ValueError),
            match=r"`cache_size` must be None or an integer of at least 1; got",
        ):
            generate(models["full"], prompt(), NEW, cache_size=bad)
    bad_counts: list[Any] = [True, 0, 2.0]
    for bad in bad_counts:
        with pytest.raises(
            (TypeError, ValueError), match=r"`max_new_tokens` must be an integer of at least 1; got"
        ):
            generate(models["full"], prompt(), bad)


def test_the_refusal_names_the_sequence_or_the_window(models):
    with pytest.raises(ValueError) as info:
        generate(models["full"], prompt(), NEW, cache_size=11)
    assert "every layer attends to the whole sequence: the prompt's 6 tokens and " in str(
        info.value
    )
    with pytest.raises(ValueError) as info:
        generate(models["mixed"], prompt(), NEW, cache_size=4)
    assert "its full-attention layers (`layer_types`) attend to the whole sequence" in str(
        info.value
    )
    with pytest.raises(ValueError) as info:
        generate(models["sliding"], prompt(), NEW, cache_size=3)
    assert "its last 4 positions (`sliding_window`)" in str(info.value)


# --- rotary embeddings, in every form a config.json can name them ----------------------------

SHAPE: dict[str, Any] = dict(
    vocab_size=32,
    hidden_size=64,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
YARN = {"factor": 4.0, "original_max_position_embeddings": 128}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
# (family, fields, the field a refusal must name); `None`: read, and equal to transformers'.
ROPE_FORMS: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "v5 default": ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, None),
    "v4 theta": ("llama", {"rope_theta": 5e5, "rope_scaling": None}, None),
    "nothing": ("llama", {}, None),
    "empty dicts": ("llama", {"rope_parameters": {}, "rope_scaling": {}}, None),
    "v4 llama3": ("llama", {"rope_theta": 5e5, "rope_scaling": LLAMA3}, None),
    "v5 llama3": ("llama", {"rope_parameters": LLAMA3 | {"rope_theta": 5e5}}, None),
    "both, agreeing": (
        "llama",
        {
            "rope_theta": 5e5,
            "rope_parameters": LLAMA3 | {"rope_theta": 5e5},
            "rope_scaling": LLAMA3,
        },
        None,
    ),
    "default, factor 1": (
        "llama",
        {"rope_parameters": {"rope_type": "default", "factor": 1}},
        None,
    ),
    "llama3 as old type": ("llama", {"rope_scaling": LLAMA3 | {"type": "llama3"}}, None),
    # transformers reads `rope_scaling` instead of a `rope_parameters` given beside it.
    "empty rope_parameters, yarn rope_scaling": (
        "llama",
        {"rope_parameters": {}, "rope_scaling": {"type": "yarn", **YARN}},
        None,
    ),
    "theta-only rope_parameters, yarn rope_scaling": (
        "llama",
        {"rope_parameters": {"rope_theta": 1e6}, "rope_scaling": {"rope_type": "yarn", **YARN}},
        "`rope_parameters` and `rope_scaling` must describe the same",
    ),
    "default rope_parameters, linear rope_scaling": (
        "llama",
        {
            "rope_parameters": {"rope_type": "default"},
            "rope_scaling": {"type": "linear", "factor": 2.0},
        },
        "`rope_parameters` and `rope_scaling` must describe the same",
    ),
    "v5 linear": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}},
        None,
    ),
    "v4 linear as old type": (
        "qwen2",
        {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 4.0}},
        None,
    ),
    "v5 yarn": (
        "llama",
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, **YARN}},
        None,
    ),
    "yarn, mscale and betas, not truncated": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                **YARN,
                "mscale": 0.8,
                "mscale_all_dim": 0.5,
                "beta_fast": 16,
                "beta_slow": 2,
                "truncate": False,
            }
        },
        None,
    ),
    "yarn with its attention factor": (
        "qwen2",
        {"rope_scaling": {"rope_type": "yarn", **YARN, "attention_factor": 1.5}},
        None,
    ),
    "linear without a factor": (
        "llama",
        {"rope_parameters": {"rope_type": "linear"}},
        "`rope_parameters.factor` must be a number above 0",
    ),
    "llama3 rope_parameters, rope_scaling without theta": (
        "llama",
        {"rope_parameters": LLAMA3 | {"rope_theta": 5e5}, "rope_scaling": LLAMA3},
        "`rope_parameters` and `rope_scaling` must describe the same",
    ),
    "null rope_type, yarn type": (
        "llama",
        {"rope_parameters": {"rope_type": None, "type": "yarn", **YARN}},
        "`rope_parameters.rope_type` must name the rotary kind",
    ),
    "null rope_type in rope_scaling": (
        "llama",
        {"rope_scaling": {"rope_type": None, "type": "yarn", **YARN}},
        "`rope_scaling.rope_type` must name the rotary kind",
    ),
    "default rope_type, yarn type": (
        "llama",
        {"rope_scaling": {"rope_type": "default", "type": "yarn", **YARN}},
        "`rope_scaling` must name one rotary kind",
    ),
    "default with a factor": (
        "llama",
        {"rope_parameters": {"rope_type": "default", "factor": 4.0}},
        "`rope_parameters` names rope_type 'default' but gives scaling parameters",
    ),
    "type only, dynamic": (
        "llama",
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
        "rope_type 'dynamic', which is not implemented",
    ),
    "empty kind": ("llama", {"rope_parameters": {"rope_type": ""}}, "must name the rotary kind"),
    "two thetas": (
        "llama",
        {"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        "`rope_theta` must be given once or agree",
    ),
    "boolean theta": ("llama", {"rope_theta": True}, "`rope_theta` must be a positive number"),
    "null theta": ("llama", {"rope_theta": None}, "`rope_theta` must be a positive number"),
    "per layer type (Gemma 3's form)": (
        "qwen2",
        {
            "layer_types": ["full_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "yarn", **YARN},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
        "`rope_parameters` must be one flat dict",
    ),
    "per layer type, no layer_types": (
        "llama",
        {"rope_parameters": {"full_attention": {"rope_type": "yarn", **YARN}}},
        "`rope_parameters` must be one flat dict",
    ),
    "top-level rope_type": ("llama", {"rope_type": "yarn", **YARN}, "`rope_type` at the top level"),
    "string llama3 factor": (
        "llama",
        {"rope_scaling": LLAMA3 | {"factor": "8"}},
        "`rope_scaling.factor` must be a number",
    ),
}
_CLASSES = {
    "llama": ("LlamaConfig", transformers.models.llama.modeling_llama.LlamaRotaryEmbedding),
    "qwen2": ("Qwen2Config", transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding),
}


def transformers_rope(family: str, fields: dict[str, Any]) -> tuple[np.ndarray, float] | None:
    """The inverse frequencies and attention scaling `transformers` computes for a config
    dictionary, or `None` where it cannot build its rotary embedding from it."""
    config_class, rotary = _CLASSES[family]
    logging.disable(logging.WARNING)  # transformers warns about the odd forms; it is the point
    try:
        config = getattr(transformers, config_class).from_dict(json.loads(json.dumps(fields)))
        made = rotary(config)
        return made.inv_freq.numpy(), float(made.attention_scaling)
    except Exception:
        return None
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("form", list(ROPE_FORMS))
def test_every_rope_form_is_computed_as_transformers_computes_it_or_refused(form):
    family, fields, refusal = ROPE_FORMS[form]
    fields = SHAPE | fields
    if refusal is not None:
        with pytest.raises(ValueError, match=re.escape(refusal)):
            DecoderConfig.from_hf({"model_type": family, **fields})
        return
    expected = transformers_rope(family, fields)
    assert expected is not None, "a form read here must be one transformers reads"
    config = DecoderConfig.from_hf({"model_type": family, **fields})
    ours = inverse_frequencies(config.resolved_head_dim, config.rope_theta, config.rope_scaling)
    inv_freq, attention_scaling = expected
    np.testing.assert_allclose(ours, inv_freq, rtol=1e-6)
    scaling = config.rope_scaling
    scale = scaling.scale if isinstance(scaling, YarnRope) else 1.0
    np.testing.assert_allclose(scale, attention_scaling, rtol=1e-7)
    assert scale != 1.0 or not isinstance(scaling, YarnRope)


# --- the dtype of a config.json that states none ---------------------------------------------


@pytest.fixture(scope="module")
def float32_model():
    return random_model(DecoderConfig(**TINY), seed=1)


def saved(path, model, **config_fields):
    """`model` saved to `path`, its config.json's fields replaced (`None`: removed)."""
    save_hf(model, path)
    config = json.loads((path / "config.json").read_text())
    for name, value in config_fields.items():
        config.pop(name, None)
        if value is not None:
            config[name] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


def transformers_dtype(path) -> Any:
    logging.disable(logging.WARNING)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path).dtype
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize(
    "stored, fields, expected",
    [
        ("float32", {"dtype": None}, "float32"),  # was bfloat16, a lower precision
        ("bfloat16", {"dtype": None}, "bfloat16"),
        ("float32", {"dtype": None, "torch_dtype": "float16"}, "float16"),
        ("float32", {"dtype": "float16", "torch_dtype": "float16"}, "float16"),
    ],
)
def test_load_hf_takes_the_dtype_transformers_takes(
    tmp_path, float32_model, stored, fields, expected
):
    model = jax.tree.map(
        lambda x: x.astype(stored) if eqx.is_inexact_array(x) else x, float32_model
    )
    path = saved(tmp_path, model, **fields)
    assert str(transformers_dtype(path)).removeprefix("torch.") == expected
    loaded = load_hf(path)
    assert loaded.dtype == jnp.dtype(expected) and loaded.config.dtype == expected


def test_a_config_without_dtype_is_float32_as_in_transformers():
    fields = {"model_type": "mistral", **SHAPE}
    assert DecoderConfig.from_hf(fields).dtype == "float32"
    built = transformers.AutoModelForCausalLM.from_config(transformers.MistralConfig(**SHAPE))
    assert built.dtype == torch.float32
    # Made by hand, the config keeps its documented Mistral-7B default.
    assert DecoderConfig().dtype == "bfloat16"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"dtype": "auto"}, r"`dtype` must name the model's dtype.*got 'auto'"),
        ({"dtype": None, "torch_dtype": "auto"}, r"`torch_dtype` must name the model's dtype"),
        ({"dtype": "bfloat16", "torch_dtype": "float16"}, r"`dtype` and `torch_dtype` must agree"),
        ({"dtype": "float64"}, r"`dtype` must be one of \('float32', 'bfloat16', 'float16'\)"),
    ],
)
def test_dtypes_transformers_would_not_read_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig.from_hf({"model_type": "mistral", **SHAPE, **fields})


def test_weights_in_several_dtypes_without_a_config_dtype_are_refused(tmp_path, float32_model):
    path = saved(tmp_path, float32_model, dtype=None)
    tensors = {
        name: value if "norm" in name else value.astype(np.float16)
        for name, value in to_hf_state_dict(float32_model).items()
    }
    (path / "model.safetensors").unlink()
    safetensors.numpy.save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError) as info:
        load_hf(path)
    message = str(info.value)
    assert "gives no `dtype` (nor `torch_dtype`)" in message
    assert "float32 ('model.layers.0.input_layernorm.weight')" in message
    assert "float16 ('" in message
    assert load_hf(path, dtype=jnp.float32).dtype == jnp.float32


# --- sizes the weights do not have: refused at once, nothing allocated -----------------------


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def refused_at_once(seconds: float = 1.0, extra_bytes: int = 2**30):
    """The code under it must finish within `seconds` and reserve at most `extra_bytes` more
    address space (beyond, it gets a `MemoryError`, rather than exhausting the machine)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _address_space() + extra_bytes
    unlimited = hard == resource.RLIM_INFINITY
    resource.setrlimit(resource.RLIMIT_AS, (limit if unlimited else min(limit, hard), hard))
    start = time.perf_counter()
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert time.perf_counter() - start < seconds


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory):
    fields: dict[str, Any] = {**TINY, **KINDS["mixed"], "layer_types": None, "sliding_window": None}
    config = DecoderConfig(**fields)
    path = tmp_path_factory.mktemp("qwen2")
    save_hf(random_model(config, seed=2), path)
    return path


def test_a_layer_count_of_a_trillion_is_refused_before_any_list_of_layers(
    qwen2_checkpoint, no_allocation
):
    # Without `layer_types`, Qwen2's config lists one kind per layer: built only once the
    # count is the weights'.
    saved_config = json.loads((qwen2_checkpoint / "config.json").read_text())
    config = saved_config | {"num_hidden_layers": 10**12, "use_sliding_window": True}
    del config["layer_types"]
    (qwen2_checkpoint / "config.json").write_text(json.dumps(config))
    try:
        with pytest.raises(ValueError) as info, refused_at_once():
            load_hf(qwen2_checkpoint)
    finally:
        (qwen2_checkpoint / "config.json").write_text(json.dumps(saved_config))
    assert "says num_hidden_layers=1000000000000, but the weights in" in str(info.value)
    assert "hold 2 layers" in str(info.value)


@pytest.mark.parametrize(
    "field, tensor, expected, held",
    [
        ("hidden_size", "model.embed_tokens.weight", [32, 2**40], [32, 16]),
        ("intermediate_size", "model.layers.0.mlp.gate_proj.weight", [2**40, 16], [24, 16]),
    ],
)
def test_a_size_of_a_terabyte_is_refused_from_the_headers(
    tmp_path, float32_model, no_allocation, field, tensor, expected, held
):
    path = saved(tmp_path, float32_model, **{field: 2**40, "head_dim": 8})
    with pytest.raises(ValueError) as info, refused_at_once():
        load_hf(path)
    message = str(info.value)
    assert f"{path / 'config.json'} does not match the weights in {path}: " in message
    assert f"`{field}`={2**40} gives tensor {tensor!r} the shape {expected}" in message
    assert f"but the weights hold {held}" in message


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"num_hidden_layers": 10**12},
            r"`state_dict` must hold the 1000000000000 layers `config.num_hidden_layers` gives; "
            r"it holds 2",
        ),
        (
            {"intermediate_size": 2**40},
            r"tensor `model.layers.0.mlp.gate_proj.weight` must have shape \[1099511627776, 16\], "
            r"which `config`'s `intermediate_size`=1099511627776 gives it; `state_dict` holds "
            r"\[24, 16\]",
        ),
        (
            {"hidden_size": 2**40, "head_dim": 8},
            r"tensor `model.embed_tokens.weight` must have shape \[32, 1099511627776\], which "
            r"`config`'s `hidden_size`=1099511627776 gives it; `state_dict` holds \[32, 16\]",
        ),
    ],
)
def test_from_hf_state_dict_checks_every_size_before_allocating(float32_model, fields, message):
    state_dict = to_hf_state_dict(float32_model)
    config = DecoderConfig(**(TINY | fields))
    with pytest.raises(ValueError, match=message), refused_at_once():
        from_hf_state_dict(state_dict, config)
