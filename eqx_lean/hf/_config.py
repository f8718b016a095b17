"""The decoder configuration (every family of `_families.py`): read from and written to
`config.json`."""

import dataclasses
import json
import os
from typing import Any

import numpy as np

from .. import _arguments as arguments
from ._families import DTYPE_NAMES, FAMILIES, read_family, unknown_family, write_family
from ._rope import LinearRope, Llama3Rope, RopeScaling, YarnRope


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The shape and numerics of a decoder of any family `eqx_lean.hf` reads (Mistral, Llama,
    Qwen2, Qwen3, Gemma 2, Gemma 3), with HuggingFace's field names (`MistralConfig`, its name
    before, is a deprecated alias).

    The defaults are Mistral-7B-v0.1. Use [`DecoderConfig.from_hf`][] to read a checkpoint's
    `config.json` (both the transformers<5 form, with `rope_theta` and `torch_dtype` at the top
    level, and the transformers-5 form, with a `rope_parameters` dict and `dtype`), and the
    presets [`DecoderConfig.v0_1`][] and [`DecoderConfig.v0_3`][] for the released shapes.

    `head_dim` may differ from `hidden_size // num_attention_heads`; `None` means that quotient.
    `sliding_window=None` means full causal attention; otherwise a query attends to the
    `sliding_window` most recent positions, itself included (HuggingFace's semantics). With
    `layer_types` (one `"full_attention"` or `"sliding_attention"` per layer, as Qwen2 has), only
    the sliding layers use the window.

    `model_type` is the family (`"mistral"`, `"llama"`, `"qwen2"`, `"qwen3"`, `"gemma2"` or
    `"gemma3_text"`), which `config.json` is written for. `attention_bias` puts biases on the
    q, k and v projections, `o_proj_bias` on the output projection, `mlp_bias` on the three
    MLP projections (Llama, Qwen3 and Gemma: `attention_bias` means both of the first two;
    Qwen2: q, k and v only). `rope_scaling` is `None` (default rotary embeddings) or a
    `Llama3Rope`, `LinearRope` or `YarnRope` (`eqx_lean.hf._rope`). With `tie_word_embeddings`
    the head is the embedding matrix itself (Llama, Qwen and Gemma; Mistral's head is untied). An
    `eos_token_id` is an id or a tuple of ids; `generation_eos_token_id`, when not `None`, is
    `generation_config.json`'s (which [`generate`][] prefers, as `transformers` does; `()`
    when that file names none: `transformers` then never stops). It is not compared: configs
    that differ only there are equal.

    The block's options, which the family fixes (`None`, their default, takes the family's;
    another value than the family's is refused, since `config.json` could not say it):
    `hidden_act` (`"silu"`, or Gemma's `"gelu_pytorch_tanh"`), `norm_unit_offset` (RMSNorm
    multiplies by `1 + w` in float32, Gemma's, rather than `w`), `post_norms` (Gemma 2/3's
    norms of the attention's and the MLP's outputs, `pre_feedforward_layernorm` before the
    MLP), `qk_norm` (an RMSNorm of each query and key head, Qwen3 and Gemma 3),
    `scale_embeddings` (the embeddings times `sqrt(hidden_size)` in the model's dtype, Gemma).
    Gemma's numbers: `query_pre_attn_scalar` (scores scaled by its inverse square root rather
    than `head_dim`'s; `None`: `head_dim`), `attn_logit_softcapping` and
    `final_logit_softcapping` (`tanh(x / cap) * cap` of the attention scores and of the
    logits; `None`: no cap), and Gemma 3's `rope_local_base_freq` (the sliding layers'
    rotary base, their rope the default one; the full layers take `rope_theta` and
    `rope_scaling`).

    `dtype` is the dtype a model is built and loaded in. Read from a file, it is what
    `transformers` reads: `config.json`'s `dtype`, else its older `torch_dtype` (they must
    agree if both are given; `"auto"` is refused, being `from_pretrained`'s argument, not a
    config value), else `"float32"`, `transformers`' default for a config that states none;
    [`load_hf`][] then takes the dtype the weights are stored in, as `from_pretrained` does.
    The Python default, `"bfloat16"`, is Mistral-7B-v0.1's, for configurations made by hand.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int | None = 4096
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    dtype: str = "bfloat16"
    model_type: str = "mistral"
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] | None = None
    # The block's options (`None`: the family's) and Gemma's numbers.
    hidden_act: str | None = None
    norm_unit_offset: bool | None = None
    post_norms: bool | None = None
    qk_norm: bool | None = None
    scale_embeddings: bool | None = None
    query_pre_attn_scalar: int | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_base_freq: float | None = None
    # Generation metadata from `generation_config.json`, not the model's `config.json`: it
    # changes no compiled program (`generate` passes the ids as an array) and is not compared,
    # so equal models compare equal whatever generation file sits beside them. `save_hf` writes
    # that file from these ids, and the text it was read from (kept here) byte for byte while
    # the ids are the ones it gave.
    generation_eos_token_id: tuple[int, ...] | None = dataclasses.field(default=None, compare=False)
    generation_config_text: str | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        # Every field in its canonical Python type, checked before anything is built from it:
        # a bool is not a size (`sliding_window: true` is not a window of 1), a string not an
        # epsilon, and a non-finite or negative epsilon or base computes garbage, not an error.
        for name in _POSITIVE:
            self._set(name, arguments.integer(getattr(self, name), f"`{name}`", minimum=1))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "`num_attention_heads` must be a multiple of `num_key_value_heads` (grouped-query "
                f"attention); got {self.num_attention_heads} and {self.num_key_value_heads}."
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    "`hidden_size` must be divisible by `num_attention_heads` when `head_dim` is "
                    f"not given; got {self.hidden_size} and {self.num_attention_heads}."
                )
            self._set("head_dim", self.hidden_size // self.num_attention_heads)
        try:
            head_dim = arguments.integer(self.head_dim, "`head_dim`", minimum=2)
        except (TypeError, ValueError):
            head_dim = None
        if head_dim is None or head_dim % 2:
            raise ValueError(
                f"`head_dim` must be a positive even integer (rotary embeddings rotate pairs); "
                f"got {self.head_dim!r}."
            )
        self._set("head_dim", head_dim)
        self._set(
            "sliding_window",
            arguments.optional_integer(self.sliding_window, "`sliding_window`", minimum=1),
        )
        for name in ("rms_norm_eps", "rope_theta"):
            self._set(name, arguments.number(getattr(self, name), f"`{name}`", above=0))
        self._set(
            "initializer_range",
            arguments.number(self.initializer_range, "`initializer_range`", minimum=0),
        )
        for name in ("attention_bias", "o_proj_bias", "mlp_bias", "tie_word_embeddings"):
            self._set(name, arguments.boolean(getattr(self, name), f"`{name}`"))
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_NAMES:
            raise ValueError(f"`dtype` must be one of {DTYPE_NAMES}; got {self.dtype!r}.")
        self._check_family()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A config pickled before the block options existed (issue 45) has none of them: they
        # are its family's, as `__post_init__` would have set them.
        for name, value in state.items():
            self._set(name, value)
        for name, value in FAMILIES[self.model_type].options.items():
            if name not in state:
                self._set(name, value)

    def _check_family(self) -> None:
        if not isinstance(self.model_type, str) or self.model_type not in FAMILIES:
            raise unknown_family(self.model_type)
        for name in ("eos_token_id", "generation_eos_token_id", "layer_types"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        self._set(
            "bos_token_id",
            arguments.optional_integer(self.bos_token_id, "`bos_token_id`", minimum=0),
        )
        self._set("eos_token_id", _token_ids(self.eos_token_id, "`eos_token_id`"))
        if self.layer_types is not None:
            kinds = ("full_attention", "sliding_attention")
            if (
                not isinstance(self.layer_types, tuple)
                or len(self.layer_types) != self.num_hidden_layers
                or not all(isinstance(kind, str) and kind in kinds for kind in self.layer_types)
            ):
                raise ValueError(
                    f"`layer_types` must give one of {sorted(kinds)} for each of the "
                    f"{self.num_hidden_layers} layers; got {list(self.layer_types)!r}."
                )
        if self.rope_scaling is not None and not isinstance(
            self.rope_scaling, Llama3Rope | LinearRope | YarnRope
        ):
            raise ValueError(
                "`rope_scaling` must be None or a Llama3Rope, LinearRope or YarnRope; got "
                f"{self.rope_scaling!r}."
            )
        family = FAMILIES[self.model_type]
        # The block options are the family's: `config.json` has no field for another value.
        for name, value in family.options.items():
            given = getattr(self, name)
            if given is None:
                self._set(name, value)
            elif given != value or type(given) is not type(value):
                raise ValueError(
                    f"`{name}` must be {value!r} for a {self.model_type!r} model (the family "
                    f"fixes it); got {given!r}."
                )
        # What each family's `transformers` model can hold, so that `to_hf` describes the model.
        biases = (self.attention_bias, self.o_proj_bias, self.mlp_bias)
        if biases not in family.biases:
            raise ValueError(
                f"a {self.model_type!r} model must have (attention_bias, o_proj_bias, mlp_bias) "
                f"among {list(family.biases)}; got {biases}."
            )
        if self.model_type == "llama" and self.sliding_window is not None:
            raise ValueError("a 'llama' model must have `sliding_window=None`: Llama has none.")
        if not family.layered and self.layer_types is not None:
            layered = [name for name, spec in FAMILIES.items() if spec.layered]
            raise ValueError(f"only {layered} models have `layer_types`; got {self.model_type!r}.")
        gemma = self.model_type in ("gemma2", "gemma3_text")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None:
                if not gemma:
                    raise ValueError(
                        f"`{name}` must be None for a {self.model_type!r} model (only Gemma 2 "
                        f"and 3 have it); got {value!r}."
                    )
                if name == "query_pre_attn_scalar":  # an int in transformers' config
                    self._set(name, arguments.integer(value, f"`{name}`", minimum=1))
                else:
                    self._set(name, arguments.number(value, f"`{name}`", above=0))
        local = self.rope_local_base_freq
        if (local is not None) != (self.model_type == "gemma3_text"):
            raise ValueError(
                "`rope_local_base_freq` must be given for a 'gemma3_text' model (its sliding "
                f"layers' rotary base) and only then; got {local!r} for {self.model_type!r}."
            )
        if local is not None:
            self._set(
                "rope_local_base_freq", arguments.number(local, "`rope_local_base_freq`", above=0)
            )

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (`None`: full causal attention)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_hidden_layers
        return tuple(
            self.sliding_window if kind == "sliding_attention" else None
            for kind in self.layer_types
        )

    @property
    def attention_scale(self) -> float:
        """The factor of the attention scores: `query_pre_attn_scalar ** -0.5` (Gemma), else
        `head_dim ** -0.5`."""
        scalar = self.query_pre_attn_scalar
        return (self.resolved_head_dim if scalar is None else scalar) ** -0.5

    @property
    def local_rope_layers(self) -> tuple[bool, ...] | None:
        """Which layers rotate with the local rope (`rope_local_base_freq`, Gemma 3's sliding
        layers); `None` when every layer rotates alike."""
        if self.rope_local_base_freq is None:
            return None
        return tuple(w is not None for w in self.layer_windows)

    @property
    def max_window(self) -> int | None:
        """The widest window of any layer, `None` if some layer attends to everything."""
        windows = self.layer_windows
        return None if None in windows else max(w for w in windows if w is not None)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids [`generate`][] stops at: `generation_eos_token_id`, else `eos_token_id`."""
        if self.generation_eos_token_id is not None:
            return self.generation_eos_token_id
        eos = self.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)

    @property
    def resolved_head_dim(self) -> int:
        """`head_dim` as an `int` (it is always resolved after construction)."""
        assert self.head_dim is not None
        return self.head_dim

    @classmethod
    def v0_1(cls) -> "DecoderConfig":
        """Mistral-7B-v0.1: sliding window 4096, vocabulary 32000, rope theta 1e4."""
        return cls()

    @classmethod
    def v0_3(cls) -> "DecoderConfig":
        """Mistral-7B-v0.3: no sliding window, vocabulary 32768, rope theta 1e6."""
        return cls(vocab_size=32768, rope_theta=1e6, sliding_window=None)

    @classmethod
    def tiny(cls) -> "DecoderConfig":
        """A 2-layer, width-128 Mistral over bytes (vocabulary 256: no tokenizer needed), window
        32, float32: 1.8 MiB of weights, for trying every command in seconds."""
        return cls(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=32,
            max_position_embeddings=256,
            dtype="float32",
        )

    @classmethod
    def preset(cls, name: str) -> "DecoderConfig":
        """A shape by name: `"v0.1"` or `"v0.3"` (released), or `"tiny"`."""
        presets = {"v0.1": cls.v0_1, "v0.3": cls.v0_3, "tiny": cls.tiny}
        if name not in presets:
            raise ValueError(f"`name` must be one of {sorted(presets)}; got {name!r}.")
        return presets[name]()

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "DecoderConfig":
        """Reads a HuggingFace config dictionary (the contents of `config.json`).

        **Arguments:**

        - `hf`: the dictionary of a `"mistral"`, `"llama"` or `"qwen2"` model (a missing
            `model_type` means Mistral), in the transformers-4 form (`rope_theta` and
            `rope_scaling`, `torch_dtype`) or the transformers-5 form (`rope_parameters`,
            `dtype`). Any other `model_type` is refused, as is any value this implementation
            does not compute (`hidden_act`, `attention_dropout`, a rope type other than
            `default` and `llama3` wherever the file names one, Llama's `pretraining_tp`,
            ...) and any two fields that disagree (`rope_parameters` and `rope_scaling`,
            `dtype` and `torch_dtype`).

        **Returns:**

        The `DecoderConfig` (alias `DecoderConfig`). Fields that change no numerics (cache
        flags) are ignored.
        """
        return cls(**read_family(hf))

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "DecoderConfig":
        """Reads `config.json`, or `path/config.json` if `path` is a directory."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, "rb") as f:
            return cls.from_json_bytes(f.read(), os.fspath(path))

    @classmethod
    def from_json_bytes(cls, raw: bytes, path: str) -> "DecoderConfig":
        """Reads the content of a `config.json` file; `path` names it in messages.

        **Arguments:**

        - `raw`: the file's bytes (as [`eqx_lean.Checkpoint.file`][] gives them).
        - `path`: where they were read from.

        **Returns:**

        The `DecoderConfig`, as [`DecoderConfig.from_hf`][] reads it.
        """
        return config_from_file(parse_config_json(raw, path), path)

    def to_hf(self) -> dict[str, Any]:
        """The transformers-5 `config.json` dictionary for this configuration."""
        return write_family(self)


# The name before issue 45, kept so that pickles naming `_config.MistralConfig` still load;
# the public deprecated alias is `eqx_lean.hf.MistralConfig`, which warns.
MistralConfig = DecoderConfig


def _token_ids(value: Any, what: str) -> int | tuple[int, ...] | None:
    """A token id field: `None`, an id or a tuple of ids, each a non-negative integer (a bool
    is not an id)."""
    if value is None:
        return None
    many = isinstance(value, tuple)
    if not all(_is_id(i) for i in (value if many else (value,))):
        shown = f"{list(value)!r} (list)" if many else f"{value!r} ({type(value).__name__})"
        raise ValueError(
            f"{what} must be an integer of at least 0, a list of them or null; got {shown}."
        )
    return tuple(int(i) for i in value) if many else int(value)


def _is_id(value: Any) -> bool:
    return (
        not isinstance(value, bool | np.bool_)
        and isinstance(value, int | np.integer)
        and bool(value >= 0)
    )


_POSITIVE = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)


def parse_config_json(raw: bytes, path: str) -> dict[str, Any]:
    """The JSON object a `config.json` file's bytes hold; `path` names the file in messages."""
    text = raw.decode("utf-8", errors="replace")
    try:
        hf = json.loads(text)
    except json.JSONDecodeError as e:
        empty = " (the file is empty: was it truncated?)" if not text.strip() else ""
        raise ValueError(
            f"{path} must hold a JSON object (a HuggingFace config), but it is not valid "
            f"JSON{empty}: {e.msg} at line {e.lineno}, column {e.colno}."
        ) from None
    if not isinstance(hf, dict):
        raise ValueError(
            f"{path} must hold a JSON object (a HuggingFace config); got a {type(hf).__name__}."
        )
    return hf


def config_from_file(hf: dict[str, Any], path: str) -> DecoderConfig:
    """[`DecoderConfig.from_hf`][] of the dictionary read from the file `path`, whose name
    starts every message."""
    try:
        return DecoderConfig.from_hf(hf)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{path} is not a config eqx_lean.hf reads: {e}") from e
