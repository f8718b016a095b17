"""A new user's walls, the files' part (issue 41): what a checkpoint's or adapter's files hold
that would load and fail later, compute garbage, or be refused with a bare Python error is
refused before any JAX work, with a sentence naming the field or entry and the file.

- `config.json` fields of the wrong type or range (`eqx_lean/hf/_config.py`, `_families.py`,
  `_rope.py`): bools are not sizes, strings not numbers, epsilons and bases finite and positive;
- bitsandbytes-quantised tensors in a checkpoint whose `config.json` lost its
  `quantization_config` (`_quantized.py`), and in a state dict;
- a LoRA scale (`lora_alpha / r`) that is not a normal float32 (`eqx_lean/lora/`);
- a NUL byte in an entry of `model.safetensors.index.json` (`eqx_lean/_io/safetensors.py`);
- a state dict with more layers than its config (`from_hf_state_dict`), as a load refuses.

Every checkpoint here is written with NumPy, so that no test compiles anything.
"""

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from harness import MICRO_DECODER

from eqx_lean.hf import DecoderConfig, from_hf_state_dict, load_hf
from eqx_lean.internal import parse_adapter_config, to_peft
from eqx_lean.lora import LoraConfig


CONFIG: dict[str, Any] = MICRO_DECODER


def state_dict(layers: int | None = None, **fields: Any) -> dict[str, np.ndarray]:
    """The HF tensors of a Mistral of `CONFIG | fields` with `layers` layers (`None`: the
    config's), drawn with NumPy."""
    c = DecoderConfig(**(CONFIG | fields))
    d, f = c.hidden_size, c.intermediate_size
    q, kv = (
        heads * c.resolved_head_dim for heads in (c.num_attention_heads, c.num_key_value_heads)
    )
    shapes = {
        "model.embed_tokens.weight": (c.vocab_size, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (c.vocab_size, d),
    }
    per_layer = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    for i in range(c.num_hidden_layers if layers is None else layers):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in per_layer.items()})
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_checkpoint(path: Path, tensors: dict[str, np.ndarray], **config: Any) -> Path:
    """A checkpoint directory of `tensors` and `CONFIG`'s config.json, its fields replaced by
    `config` (a `None` removes one)."""
    path.mkdir(parents=True, exist_ok=True)
    hf = DecoderConfig(**CONFIG).to_hf()
    for name, value in config.items():
        hf.pop(name, None)
        if value is not None:
            hf[name] = value
    (path / "config.json").write_text(json.dumps(hf))
    safetensors.numpy.save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def tensors() -> dict[str, np.ndarray]:
    return state_dict()


def refused(call: Any, *parts: str) -> str:
    """The message of the `ValueError` or `TypeError` `call()` raises, which must hold every
    one of `parts`."""
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    message = str(info.value)
    for part in parts:
        assert part in message, (part, message)
    return message


# --- config.json fields of the wrong type or range --------------------------------------------

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LLAMA: dict[str, Any] = {"model_type": "llama", "sliding_window": None}
QWEN2: dict[str, Any] = {"model_type": "qwen2", "attention_bias": True, "sliding_window": None}
# (fields replaced in config.json, the field the refusal must name, the value it must show)
BAD_FIELDS: dict[str, tuple[dict[str, Any], str, str]] = {
    # Was a window of 1.
    "bool sliding_window": ({"sliding_window": True}, "`sliding_window`", "True (bool)"),
    "zero sliding_window": ({"sliding_window": 0}, "`sliding_window`", "got 0"),
    "string rms_norm_eps": ({"rms_norm_eps": "1e-6"}, "`rms_norm_eps`", "'1e-6' (str)"),
    "negative rms_norm_eps": ({"rms_norm_eps": -1}, "`rms_norm_eps`", "got -1.0"),
    "zero rms_norm_eps": ({"rms_norm_eps": 0}, "`rms_norm_eps`", "got 0.0"),
    # Was a bare OverflowError: JSON reads the literal as an int no float holds.
    "400-digit rms_norm_eps": ({"rms_norm_eps": 10**400}, "`rms_norm_eps`", "of 401 digits"),
    "string tie_word_embeddings, Mistral": (
        {"tie_word_embeddings": "false"},
        "`tie_word_embeddings`",
        "'false' (str)",
    ),
    # Was taken for its truth value: a tied head.
    "string tie_word_embeddings, Llama": (
        LLAMA | {"tie_word_embeddings": "false"},
        "`tie_word_embeddings`",
        "'false' (str)",
    ),
    "integer tie_word_embeddings, Qwen2": (
        QWEN2 | {"tie_word_embeddings": 1},
        "`tie_word_embeddings`",
        "1 (int)",
    ),
    "float original_max_position_embeddings": (
        LLAMA | {"rope_scaling": LLAMA3 | {"original_max_position_embeddings": 64.5}},
        "`rope_scaling.original_max_position_embeddings`",
        "64.5",
    ),
    "zero low_freq_factor": (
        LLAMA | {"rope_scaling": LLAMA3 | {"low_freq_factor": 0}},
        "`rope_scaling.low_freq_factor`",
        "got 0",
    ),
    "bool vocab_size": ({"vocab_size": True}, "`vocab_size`", "True (bool)"),
    "float hidden_size": ({"hidden_size": 16.0}, "`hidden_size`", "16.0 (float)"),
    "string intermediate_size": ({"intermediate_size": "24"}, "`intermediate_size`", "'24'"),
    "bool num_hidden_layers": ({"num_hidden_layers": True}, "`num_hidden_layers`", "True"),
    "zero num_attention_heads": ({"num_attention_heads": 0}, "`num_attention_heads`", "got 0"),
    "bool num_key_value_heads": ({"num_key_value_heads": True}, "`num_key_value_heads`", "True"),
    "bool head_dim": ({"head_dim": True}, "`head_dim`", "got True"),
    "zero max_position_embeddings": (
        {"max_position_embeddings": 0},
        "`max_position_embeddings`",
        "got 0",
    ),
    "bool max_position_embeddings": (
        {"max_position_embeddings": False},
        "`max_position_embeddings`",
        "False (bool)",
    ),
    "infinite rope_theta": ({"rope_parameters": None, "rope_theta": 1e999}, "`rope_theta`", "inf"),
    "string initializer_range": (
        {"initializer_range": "0.02"},
        "`initializer_range`",
        "'0.02' (str)",
    ),
    "negative bos_token_id": ({"bos_token_id": -1}, "`bos_token_id`", "got -1"),
    "bool eos_token_id": ({"eos_token_id": True}, "`eos_token_id`", "True (bool)"),
    "negative id in eos_token_id": ({"eos_token_id": [2, -1]}, "`eos_token_id`", "[2, -1]"),
    "integer attention_bias, Llama": (
        LLAMA | {"attention_bias": 1},
        "`attention_bias`",
        "1 (int)",
    ),
    "string mlp_bias, Llama": (LLAMA | {"mlp_bias": "no"}, "`mlp_bias`", "'no' (str)"),
    "bool pretraining_tp, Llama": (LLAMA | {"pretraining_tp": True}, "`pretraining_tp`", "True"),
    "bool attention_dropout": ({"attention_dropout": False}, "`attention_dropout`", "False"),
    "string use_sliding_window, Qwen2": (
        QWEN2 | {"use_sliding_window": "yes", "sliding_window": 4},
        "`use_sliding_window`",
        "'yes' (str)",
    ),
    "bool sliding_window, Qwen2": (
        QWEN2 | {"use_sliding_window": True, "sliding_window": True, "layer_types": None},
        "`sliding_window`",
        "True (bool)",
    ),
    # Was a bare TypeError ('>=' between int and str).
    "string max_window_layers, Qwen2": (
        QWEN2
        | {
            "use_sliding_window": True,
            "sliding_window": 4,
            "layer_types": None,
            "max_window_layers": "1",
        },
        "`max_window_layers`",
        "'1' (str)",
    ),
    # Was a bare TypeError (an unhashable type).
    "object in layer_types, Qwen2": (
        QWEN2 | {"layer_types": [{}, "full_attention"]},
        "`layer_types`",
        "[{}, 'full_attention']",
    ),
    "list model_type": ({"model_type": ["mistral"]}, "`model_type`", "['mistral']"),
}


@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_config_fields_of_the_wrong_type_or_range_are_refused_naming_field_and_file(
    tmp_path, tensors, no_allocation, compiles, case
):
    fields, field, shown = BAD_FIELDS[case]
    path = write_checkpoint(tmp_path, tensors, **fields)
    config_file = str(path / "config.json")
    refused(lambda: load_hf(path), config_file, field, shown)
    refused(lambda: DecoderConfig.from_json(path), config_file, field, shown)
    assert compiles.count == 0


def test_config_fields_made_by_hand_are_checked_and_made_canonical():
    made: dict[str, Any] = CONFIG | {"sliding_window": True}
    with pytest.raises(TypeError, match=r"`sliding_window` must be None or an integer of at least"):
        DecoderConfig(**made)
    made = CONFIG | {"rms_norm_eps": float("nan")}
    with pytest.raises(ValueError, match=r"`rms_norm_eps` must be a finite number above 0"):
        DecoderConfig(**made)
    made = CONFIG | {"vocab_size": np.int64(32), "rms_norm_eps": 1}
    config = DecoderConfig(**made)
    assert type(config.vocab_size) is int and type(config.rms_norm_eps) is float
    made = CONFIG | {"rms_norm_eps": 1.0}
    assert config == DecoderConfig(**made)


# --- bitsandbytes-quantised tensors without a quantization_config -----------------------------


def bitsandbytes_tensors(tensors: dict[str, np.ndarray], kind: str) -> dict[str, np.ndarray]:
    """`tensors` with each decoder projection as bitsandbytes saves it (names and dtypes from
    transformers 5 and bitsandbytes 0.50.2's `save_pretrained` of a `load_in_4bit` or
    `load_in_8bit` model); `"packed"` keeps the 4-bit codes alone, their quant state dropped."""
    out = {}
    for name, value in tensors.items():
        if not name.startswith("model.layers.") or "proj" not in name:
            out[name] = value
            continue
        blocks = value.size // 64 or 1
        if kind == "int8":
            out[name] = np.zeros(value.shape, np.int8)
            out[name.removesuffix(".weight") + ".SCB"] = np.ones(value.shape[0], np.float32)
            out[name.removesuffix(".weight") + ".weight_format"] = np.zeros((), np.uint8)
            continue
        out[name] = np.zeros((value.size // 2, 1), np.uint8)
        if kind == "packed":
            continue
        double = kind == "nf4, double quant"
        out[f"{name}.absmax"] = np.ones(blocks, np.uint8 if double else np.float32)
        out[f"{name}.quant_map"] = np.linspace(-1, 1, 16, dtype=np.float32)
        out[f"{name}.quant_state.bitsandbytes__nf4"] = np.zeros(78, np.uint8)
        if double:
            out[f"{name}.nested_absmax"] = np.ones(1, np.float32)
            out[f"{name}.nested_quant_map"] = np.zeros(256, np.float32)
    return out


BNB_KINDS = ["nf4", "nf4, double quant", "int8", "packed"]


@pytest.mark.parametrize("via", ["load_hf", "from_hf_state_dict"])
@pytest.mark.parametrize("kind", BNB_KINDS)
def test_bitsandbytes_tensors_without_quantization_config_are_refused_as_such(
    tmp_path, tensors, no_allocation, compiles, kind, via
):
    quantised = bitsandbytes_tensors(tensors, kind)
    shown = {  # the quant state first; the packed codes when there is none
        "nf4": "_proj.weight.",
        "nf4, double quant": "_proj.weight.",
        "int8": "_proj.SCB'",
        "packed": "_proj.weight'",
    }[kind]
    if via == "load_hf":
        path = write_checkpoint(tmp_path, quantised)
        refused(
            lambda: load_hf(path),
            f"the weights in {path} hold bitsandbytes-quantised tensors (",
            shown,
            f"but {path / 'config.json'} has no `quantization_config`",
        )
    else:
        refused(
            lambda: from_hf_state_dict(quantised, DecoderConfig(**CONFIG)),
            "`state_dict` holds bitsandbytes-quantised tensors (",
            shown,
            "Pass the state dict of a full-precision model",
        )
    assert compiles.count == 0


def test_a_real_bitsandbytes_checkpoint_stripped_of_its_quantization_config_is_refused(
    tmp_path,
):
    """The names the test above writes by hand are the ones bitsandbytes writes."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    base = tmp_path / "base"
    fields = CONFIG | {"intermediate_size": 64, "hidden_size": 64}
    hf_config = transformers.MistralConfig(**{k: v for k, v in fields.items() if k != "dtype"})
    torch.manual_seed(0)
    transformers.MistralForCausalLM(hf_config).save_pretrained(base)
    settings = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32
    )
    transformers.MistralForCausalLM.from_pretrained(
        base, quantization_config=settings, device_map="cpu", dtype=torch.float32
    ).save_pretrained(tmp_path / "bnb")
    config_file = tmp_path / "bnb" / "config.json"
    config = json.loads(config_file.read_text())
    del config["quantization_config"]
    config_file.write_text(json.dumps(config))
    refused(
        lambda: load_hf(tmp_path / "bnb"),
        "hold bitsandbytes-quantised tensors ('model.layers.0.mlp.down_proj.weight.",
        f"but {config_file} has no `quantization_config`",
    )


# --- a LoRA scale that is not a normal float32 ------------------------------------------------

FILE = "adapters/adapter_config.json"
# (fields replaced in the adapter config, the scale the message must show)
BAD_SCALES: dict[str, tuple[dict[str, Any], str]] = {
    "alpha 1e308": ({"lora_alpha": 1e308, "r": 8}, "1.25e+307"),
    "alpha over float32": ({"lora_alpha": 1e39, "r": 1}, "1e+39"),
    "rsLoRA over float32": ({"lora_alpha": 1e39, "r": 4, "use_rslora": True}, "5e+38"),
    "alpha below float32": ({"lora_alpha": 1e-40, "r": 1}, "1e-40"),
}


@pytest.mark.parametrize("case", list(BAD_SCALES))
def test_lora_scales_that_are_not_a_normal_float32_are_refused_naming_alpha_and_file(
    compiles, case
):
    fields, scale = BAD_SCALES[case]
    adapter = to_peft(LoraConfig()) | fields
    message = refused(
        lambda: parse_adapter_config(json.dumps(adapter).encode(), FILE),
        "adapter config field `lora_alpha` must give a scale `lora_alpha / ",
        f"it gives {scale}",
        f"{FILE} has {json.dumps(fields['lora_alpha'])}",
    )
    assert ("sqrt(r)" in message) == fields.get("use_rslora", False)
    # Made by hand, the same settings are refused too.
    refused(lambda: LoraConfig(**fields), "`lora_alpha` must give a scale", f"it gives {scale}")
    assert compiles.count == 0


def test_an_infinite_alpha_made_by_hand_is_refused():
    with pytest.raises(ValueError, match="`lora_alpha` must be a positive number; got inf"):
        LoraConfig(lora_alpha=float("inf"))
    with pytest.raises(ValueError, match="`lora_alpha` must be a positive number; got 1000"):
        LoraConfig(lora_alpha=10**400)
    adapter = json.dumps(to_peft(LoraConfig()) | {"lora_alpha": 10**400}).encode()
    with pytest.raises(ValueError, match=f"`lora_alpha` must be a positive number; {FILE} has"):
        parse_adapter_config(adapter, FILE)


# --- a NUL byte in an index entry -------------------------------------------------------------


@pytest.mark.parametrize("where", ["tensor name", "file name"])
def test_an_index_entry_holding_a_nul_byte_is_refused_naming_index_and_entry(
    tmp_path, tensors, compiles, where
):
    path = write_checkpoint(tmp_path, tensors)
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    weight_map = {name: "model-00001-of-00001.safetensors" for name in tensors}
    if where == "tensor name":
        weight_map["model.layers.0.mlp.up\x00proj.weight"] = "model-00001-of-00001.safetensors"
        entry = r"'model.layers.0.mlp.up\x00proj.weight' holds a NUL byte"
    else:
        weight_map["model.norm.weight"] = "model\x00.safetensors"
        entry = r"names 'model\x00.safetensors' as the file of tensor 'model.norm.weight'"
    index = path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    refused(lambda: load_hf(path), str(index), entry)
    assert compiles.count == 0


# --- a state dict with more layers than its config --------------------------------------------


@pytest.mark.parametrize("held", [1, 3])
def test_a_state_dict_whose_layer_count_is_not_the_configs_is_refused(compiles, held):
    config = DecoderConfig(**CONFIG)
    message = refused(
        lambda: from_hf_state_dict(state_dict(layers=held), config),
        f"`state_dict` must hold the {config.num_hidden_layers} layers "
        "`config.num_hidden_layers` gives; ",
        f"it holds {held}",
    )
    assert ("Pass a config with 3 layers" in message) == (held == 3)
    assert re.search(r"'model\.layers\.\{i\}\.…' for i < \d", message)
    assert compiles.count == 0
