"""The decoder families read from and written to `config.json`: Mistral, Llama, Qwen2, Qwen3,
Gemma 2 and Gemma 3 (text).

Each family is a small declarative [`Family`][] spec: the `config.json` fields it reads with
`transformers`' defaults for those a file leaves out, the options of the one decoder block it
sets (norm style, post-norms, q/k norms, activation, embedding scale), which biases it may
hold, and the few fields of its own a function reads and writes. Values this implementation
does not compute (another activation, attention dropout, a rotary scaling not computed, ...)
are refused, naming the field.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from .. import _arguments as arguments
from ._rope import read_layer_ropes, read_rope, rope_parameters
from ._tower import is_multimodal, text_config


DTYPE_NAMES = ("float32", "bfloat16", "float16")

# The block options a family fixes (`DecoderConfig` fields), and their values for the families
# that leave them at the plain pre-norm SwiGLU decoder's.
PLAIN_OPTIONS: dict[str, Any] = dict(
    hidden_act="silu",
    norm_unit_offset=False,
    post_norms=False,
    qk_norm=False,
    scale_embeddings=False,
)
_GEMMA_OPTIONS = dict(
    hidden_act="gelu_pytorch_tanh", norm_unit_offset=True, post_norms=True, scale_embeddings=True
)


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder family: what `DecoderConfig.from_hf` reads and `to_hf` writes for it.

    - `model_type`, `architecture`: `config.json`'s names (`"qwen3"`, `"Qwen3ForCausalLM"`).
    - `defaults`: `transformers`' defaults for the shape fields a file may leave out.
    - `options`: the block options the family fixes (`PLAIN_OPTIONS`' keys).
    - `biases`: the `(attention_bias, o_proj_bias, mlp_bias)` its `transformers` model can hold.
    - `read`: the family's own fields (a window, soft caps, ...) from the file, as
        `DecoderConfig` keyword arguments; `write`: the same fields back, for `config.json`.
    - `rope_theta`: the rotary base when the file gives none.
    - `layered`: whether `layer_types` (per-layer windows) exist in this family.
    """

    model_type: str
    architecture: str
    defaults: dict[str, Any]
    options: dict[str, Any]
    biases: tuple[tuple[bool, bool, bool], ...]
    read: Callable[[dict[str, Any]], dict[str, Any]]
    write: Callable[[Any], dict[str, Any]]
    rope_theta: float = 10000.0
    layered: bool = False


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


def _common(hf: dict[str, Any], family: "Family") -> dict[str, Any]:
    """The fields every family shares, checked for what this implementation computes."""
    defaults = family.defaults
    if family.options["hidden_act"] == "silu":
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"`hidden_act` must be 'silu' (SwiGLU); got {act!r}.")
    else:
        # Gemma's MLP reads `hidden_activation` (its `hidden_act` is not read by transformers).
        act = hf.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(
                f"`hidden_activation` must be 'gelu_pytorch_tanh' (GeGLU with tanh GELU); got "
                f"{act!r}."
            )
    dropout = hf.get("attention_dropout", 0.0)
    if dropout not in (0, 0.0, None) or isinstance(dropout, bool):
        raise ValueError(f"`attention_dropout` must be 0; got {dropout!r}.")
    kwargs = {name: hf.get(name, defaults.get(name)) for name in _SHAPE}
    heads = kwargs["num_attention_heads"]
    kv = hf.get("num_key_value_heads", defaults["num_key_value_heads"])
    kwargs["num_key_value_heads"] = heads if kv is None else kv
    kwargs["head_dim"] = hf.get("head_dim", defaults.get("head_dim"))
    if family.model_type != "gemma3_text":
        theta, scaling = read_rope(hf, family.rope_theta)
        kwargs.update(rope_theta=theta, rope_scaling=scaling)
    kwargs.update(family.options, model_type=family.model_type)
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


def _layer_types(hf: dict[str, Any], layers: int, default: Callable[[int], bool]) -> tuple:
    """`layer_types` as the file gives it, else `default(i)` (whether layer `i` slides)."""
    layer_types = hf.get("layer_types")
    if layer_types is None:
        return tuple("sliding_attention" if default(i) else "full_attention" for i in range(layers))
    if not isinstance(layer_types, list):
        raise ValueError(f"`layer_types` must be a list of strings; got {layer_types!r}.")
    return tuple(layer_types)


def _read_mistral(hf: dict[str, Any]) -> dict[str, Any]:
    if _flag(hf, "tie_word_embeddings"):
        raise ValueError("`tie_word_embeddings` must be false for Mistral: its head is untied.")
    return {"sliding_window": hf.get("sliding_window", 4096)}


def _write_mistral(config: Any) -> dict[str, Any]:
    return {"sliding_window": config.sliding_window}


def _read_llama(hf: dict[str, Any]) -> dict[str, Any]:
    tp = hf.get("pretraining_tp", 1)
    if tp not in (1, None) or isinstance(tp, bool):
        raise ValueError(f"`pretraining_tp` must be 1 (no sliced projections); got {tp!r}.")
    attention_bias = _flag(hf, "attention_bias")
    return dict(
        sliding_window=None,
        attention_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=_flag(hf, "mlp_bias"),
        tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
    )


def _write_llama(config: Any) -> dict[str, Any]:
    return dict(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias, pretraining_tp=1)


def _read_qwen(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Qwen2 and Qwen3: the window exists only with `use_sliding_window`, and `layer_types`
    (else `max_window_layers`) says which layers use it, as `transformers`' configs read it."""
    layers = hf.get("num_hidden_layers", FAMILIES[family].defaults["num_hidden_layers"])
    window = hf.get("sliding_window", 4096) if _flag(hf, "use_sliding_window") else None
    first = 0
    if window is not None and hf.get("layer_types") is None:  # read only then, as transformers
        first = arguments.integer(hf.get("max_window_layers", 28), "`max_window_layers`", minimum=0)
    kwargs = dict(
        sliding_window=window,
        layer_types=_layer_types(hf, layers, lambda i: window is not None and i >= first),
        tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
    )
    if family == "qwen2":
        return kwargs | dict(attention_bias=True)
    attention_bias = _flag(hf, "attention_bias")  # Qwen3: on all four projections
    return kwargs | dict(attention_bias=attention_bias, o_proj_bias=attention_bias)


def _write_qwen(config: Any) -> dict[str, Any]:
    windows = config.layer_windows
    hf = dict(
        use_sliding_window=any(w is not None for w in windows),
        sliding_window=config.sliding_window,
        max_window_layers=config.num_hidden_layers,
        layer_types=list(config.layer_types or ["full_attention"] * len(windows)),
    )
    if config.model_type == "qwen3":
        hf["attention_bias"] = config.attention_bias
    return hf


def _soft_cap(hf: dict[str, Any], name: str, default: float | None) -> float | None:
    value = hf.get(name, default)
    if value is None:
        return None
    return arguments.number(value, f"`{name}`", above=0)


def _read_gemma(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Gemma 2 and Gemma 3 (text): a window on the layers `layer_types` names (every other
    layer for Gemma 2, five of six for Gemma 3), soft caps, the query scale, q/k norms."""
    spec = FAMILIES[family]
    if _flag(hf, "use_bidirectional_attention"):
        raise ValueError(
            "`use_bidirectional_attention` must be false: only causal attention is computed."
        )
    layers = hf.get("num_hidden_layers", spec.defaults["num_hidden_layers"])
    pattern = 2
    if family == "gemma3_text":
        pattern = arguments.integer(
            hf.get("sliding_window_pattern", 6), "`sliding_window_pattern`", minimum=1
        )
    attention_bias = _flag(hf, "attention_bias")
    kwargs = dict(
        sliding_window=hf.get("sliding_window", 4096),
        layer_types=_layer_types(hf, layers, lambda i: bool((i + 1) % pattern)),
        attention_bias=attention_bias,
        o_proj_bias=attention_bias,
        tie_word_embeddings=arguments.boolean(
            hf.get("tie_word_embeddings", True), "`tie_word_embeddings`"
        ),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        attn_logit_softcapping=_soft_cap(
            hf, "attn_logit_softcapping", 50.0 if family == "gemma2" else None
        ),
        final_logit_softcapping=_soft_cap(
            hf, "final_logit_softcapping", 30.0 if family == "gemma2" else None
        ),
    )
    if family == "gemma3_text":
        theta, scaling, local = read_layer_ropes(hf, 1e6, 1e4)
        kwargs.update(rope_theta=theta, rope_scaling=scaling, rope_local_base_freq=local)
    return kwargs


def _write_gemma(config: Any) -> dict[str, Any]:
    hf = dict(
        hidden_activation=config.hidden_act,
        sliding_window=config.sliding_window,
        layer_types=list(config.layer_types),
        attention_bias=config.attention_bias,
        query_pre_attn_scalar=config.query_pre_attn_scalar,
        attn_logit_softcapping=config.attn_logit_softcapping,
        final_logit_softcapping=config.final_logit_softcapping,
        use_bidirectional_attention=False,
    )
    if config.model_type == "gemma3_text":
        hf["rope_parameters"] = {
            "full_attention": rope_parameters(config.rope_theta, config.rope_scaling),
            "sliding_attention": rope_parameters(config.rope_local_base_freq, None),
        }
    return hf


_NONE, _QKV = ((False, False, False),), ((True, False, False),)
_FOUR = ((False, False, False), (True, True, False))
FAMILIES: dict[str, Family] = {
    "mistral": Family(
        "mistral",
        "MistralForCausalLM",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
        ),
        PLAIN_OPTIONS,
        _NONE,
        _read_mistral,
        _write_mistral,
    ),
    "llama": Family(
        "llama",
        "LlamaForCausalLM",
        dict(
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
        PLAIN_OPTIONS,
        tuple((a, a, m) for a in (False, True) for m in (False, True)),
        _read_llama,
        _write_llama,
    ),
    "qwen2": Family(
        "qwen2",
        "Qwen2ForCausalLM",
        dict(
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
        PLAIN_OPTIONS,
        _QKV,
        lambda hf: _read_qwen(hf, "qwen2"),
        _write_qwen,
        layered=True,
    ),
    "qwen3": Family(
        "qwen3",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=22016,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            head_dim=128,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            bos_token_id=None,
            eos_token_id=None,
        ),
        PLAIN_OPTIONS | dict(qk_norm=True),
        _FOUR,
        lambda hf: _read_qwen(hf, "qwen3"),
        _write_qwen,
        layered=True,
    ),
    "gemma2": Family(
        "gemma2",
        "Gemma2ForCausalLM",
        dict(
            vocab_size=256000,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
            bos_token_id=2,
            eos_token_id=1,
        ),
        PLAIN_OPTIONS | _GEMMA_OPTIONS,
        _FOUR,
        lambda hf: _read_gemma(hf, "gemma2"),
        _write_gemma,
        layered=True,
    ),
    "gemma3_text": Family(
        "gemma3_text",
        "Gemma3ForCausalLM",
        dict(
            vocab_size=262208,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            bos_token_id=2,
            eos_token_id=1,
        ),
        PLAIN_OPTIONS | _GEMMA_OPTIONS | dict(qk_norm=True),
        _FOUR,
        lambda hf: _read_gemma(hf, "gemma3_text"),
        _write_gemma,
        rope_theta=1e6,
        layered=True,
    ),
}


def declared_layers(hf: dict[str, Any]) -> int | None:
    """The layer count a `config.json` gives (its family's default when it gives none), read
    before the config is built: `None` when the file is not one a config is built from, which
    building it then reports."""
    if is_multimodal(hf):
        if not isinstance(hf.get("text_config", {}), dict):
            return None  # building the config reports it
        hf = text_config(hf)
    family = hf.get("model_type", "mistral")
    if not isinstance(family, str) or family not in FAMILIES:
        return None
    layers = hf.get("num_hidden_layers", FAMILIES[family].defaults["num_hidden_layers"])
    return layers if isinstance(layers, int) and not isinstance(layers, bool) else None


def read_family(hf: dict[str, Any]) -> dict[str, Any]:
    """The configuration fields (keyword arguments of `DecoderConfig`) of a `config.json`.

    A file without `model_type` is read as Mistral (as this library always has). A Gemma 3
    checkpoint with its vision tower (`Gemma3ForConditionalGeneration`, `model_type`
    `"gemma3"`) is read as its text tower (`text_config`), a `gemma3_text` model.
    """
    if is_multimodal(hf):
        hf = text_config(hf)
    family = hf.get("model_type", "mistral")
    if not isinstance(family, str) or family not in FAMILIES:
        raise unknown_family(family)
    spec = FAMILIES[family]
    return _common(hf, spec) | spec.read(hf)


def write_family(config: Any) -> dict[str, Any]:
    """The transformers-5 `config.json` dictionary of a `DecoderConfig`."""
    spec = FAMILIES[config.model_type]
    hf: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "attention_dropout": 0.0,
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
    if config.hidden_act == "silu":
        hf["hidden_act"] = "silu"
    return hf | spec.write(config)
