"""The decoder families read from and written to `config.json`: Mistral, Llama and Qwen2.

Each family reads its own fields, with `transformers`' defaults for those a file leaves out,
and refuses the values this implementation does not compute (another activation, attention
dropout, a rotary scaling other than `default` and `llama3`, ...), naming the field.
"""

from typing import Any

from .. import _arguments as arguments
from ._rope import read_rope, rope_parameters


FAMILIES = ("mistral", "llama", "qwen2")
DTYPE_NAMES = ("float32", "bfloat16", "float16")

# `transformers`' defaults for the fields a file may leave out, per family.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        sliding_window=4096,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen2": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
    ),
}
_SHAPE = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "bos_token_id",
)
_ARCHITECTURES = {
    "mistral": "MistralForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def unknown_family(model_type: Any) -> ValueError:
    """The error for a `model_type` no family reads, pointing to the generic loader."""
    return ValueError(
        f"`model_type` is {model_type!r}, not one of the families eqx_lean.hf reads "
        f"({', '.join(repr(f) for f in FAMILIES)}). Load such a checkpoint with "
        "`eqx_lean.load_tensors(path, like, names)` and a name map from your model's leaves "
        "to its tensor names (see docs/io.md)."
    )


def _flag(hf: dict[str, Any], name: str) -> bool:
    """A true-or-false field, false when missing or null (as `transformers` reads it): a string
    "false" or a 0 is refused, not taken for its truth value."""
    value = hf.get(name)
    return False if value is None else arguments.boolean(value, f"`{name}`")


def _common(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The fields every family shares, checked for what this implementation computes."""
    defaults = _DEFAULTS[family]
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"`hidden_act` must be 'silu' (SwiGLU); got {act!r}.")
    dropout = hf.get("attention_dropout", 0.0)
    if dropout not in (0, 0.0, None) or isinstance(dropout, bool):
        raise ValueError(f"`attention_dropout` must be 0; got {dropout!r}.")
    kwargs = {name: hf.get(name, defaults.get(name)) for name in _SHAPE}
    heads = kwargs["num_attention_heads"]
    kv = hf.get("num_key_value_heads", defaults["num_key_value_heads"])
    kwargs["num_key_value_heads"] = heads if kv is None else kv
    kwargs["head_dim"] = hf.get("head_dim")
    theta, scaling = read_rope(hf, 10000.0)
    kwargs.update(rope_theta=theta, rope_scaling=scaling, model_type=family)
    # A list becomes a tuple; `DecoderConfig` checks every id.
    kwargs["eos_token_id"] = hf.get("eos_token_id", defaults["eos_token_id"])
    if "initializer_range" in hf:
        kwargs["initializer_range"] = hf["initializer_range"]
    # transformers builds a config without a dtype in its default, float32 (`load_hf` then
    # takes the weights' own, as `from_pretrained`'s `dtype="auto"` does).
    kwargs["dtype"] = stated_dtype(hf) or "float32"
    return kwargs


def stated_dtype(hf: dict[str, Any]) -> str | None:
    """The dtype a `config.json` states: `dtype`, else the older `torch_dtype` (as transformers
    reads them); `None` when it gives neither."""
    given = {name: hf[name] for name in ("dtype", "torch_dtype") if hf.get(name) is not None}
    if len(set(map(str, given.values()))) > 1:
        raise ValueError(
            f"`dtype` and `torch_dtype` must agree when both are given; got {given['dtype']!r} "
            f"and {given['torch_dtype']!r}."
        )
    for name, value in given.items():
        if value == "auto":
            raise ValueError(
                f"`{name}` must name the model's dtype, one of {DTYPE_NAMES}; got 'auto', which "
                "is `from_pretrained`'s argument, not a config value (transformers cannot read it "
                "in config.json). Leave it out to load the weights in their own dtype."
            )
        if value not in DTYPE_NAMES:
            raise ValueError(f"`{name}` must be one of {DTYPE_NAMES}; got {value!r}.")
        return value
    return None


def _read_mistral(hf: dict[str, Any]) -> dict[str, Any]:
    if _flag(hf, "tie_word_embeddings"):
        raise ValueError("`tie_word_embeddings` must be false for Mistral: its head is untied.")
    return _common(hf, "mistral") | {"sliding_window": hf.get("sliding_window", 4096)}


def _read_llama(hf: dict[str, Any]) -> dict[str, Any]:
    tp = hf.get("pretraining_tp", 1)
    if tp not in (1, None) or isinstance(tp, bool):
        raise ValueError(f"`pretraining_tp` must be 1 (no sliced projections); got {tp!r}.")
    attention_bias = _flag(hf, "attention_bias")
    return _common(hf, "llama") | dict(
        sliding_window=None,
        attention_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=_flag(hf, "mlp_bias"),
        tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
    )


def _read_qwen2(hf: dict[str, Any]) -> dict[str, Any]:
    layers = hf.get("num_hidden_layers", _DEFAULTS["qwen2"]["num_hidden_layers"])
    # As `transformers`' `Qwen2Config`: the window exists only with `use_sliding_window`, and
    # `layer_types` (else `max_window_layers`) says which layers use it.
    window = hf.get("sliding_window", 4096) if _flag(hf, "use_sliding_window") else None
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first = 0
        if window is not None:  # read only then, as transformers reads it
            first = arguments.integer(
                hf.get("max_window_layers", 28), "`max_window_layers`", minimum=0
            )
        layer_types = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(layers)
        ]
    if not isinstance(layer_types, list):
        raise ValueError(f"`layer_types` must be a list of strings; got {layer_types!r}.")
    return _common(hf, "qwen2") | dict(
        sliding_window=window,
        layer_types=tuple(layer_types),
        attention_bias=True,
        tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
    )


_READERS = {"mistral": _read_mistral, "llama": _read_llama, "qwen2": _read_qwen2}


def declared_layers(hf: dict[str, Any]) -> int | None:
    """The layer count a `config.json` gives (its family's default when it gives none), read
    before the config is built: `None` when the file is not one a config is built from, which
    building it then reports."""
    family = hf.get("model_type", "mistral")
    if not isinstance(family, str) or family not in _DEFAULTS:
        return None
    layers = hf.get("num_hidden_layers", _DEFAULTS[family]["num_hidden_layers"])
    return layers if isinstance(layers, int) and not isinstance(layers, bool) else None


def read_family(hf: dict[str, Any]) -> dict[str, Any]:
    """The configuration fields (keyword arguments of `DecoderConfig`) of a `config.json`.

    A file without `model_type` is read as Mistral (as this library always has).
    """
    family = hf.get("model_type", "mistral")
    if not isinstance(family, str) or family not in _READERS:
        raise unknown_family(family)
    return _READERS[family](hf)


def write_family(config: Any) -> dict[str, Any]:
    """The transformers-5 `config.json` dictionary of a `DecoderConfig`."""
    family = config.model_type
    hf: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[family]],
        "model_type": family,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "bos_token_id": config.bos_token_id,
        "eos_token_id": (
            list(config.eos_token_id)
            if isinstance(config.eos_token_id, tuple)
            else config.eos_token_id
        ),
        "head_dim": config.head_dim,
        "hidden_size": config.hidden_size,
        "initializer_range": config.initializer_range,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope_parameters(config.rope_theta, config.rope_scaling),
        "tie_word_embeddings": config.tie_word_embeddings,
        "use_cache": True,
        "vocab_size": config.vocab_size,
        "dtype": config.dtype,
    }
    if family == "mistral":
        hf["sliding_window"] = config.sliding_window
    elif family == "llama":
        hf.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias, pretraining_tp=1)
    else:
        windows = config.layer_windows
        hf.update(
            use_sliding_window=any(w is not None for w in windows),
            sliding_window=config.sliding_window,
            max_window_layers=config.num_hidden_layers,
            layer_types=list(config.layer_types or ["full_attention"] * len(windows)),
        )
    return hf
