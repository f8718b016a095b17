"""The Mistral configuration: read from (and written to) HuggingFace `config.json` files."""

import dataclasses
import json
import os
from typing import Any


_DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class MistralConfig:
    """The shape and numerics of a Mistral model, with HuggingFace's field names.

    The defaults are Mistral-7B-v0.1. Use [`MistralConfig.from_hf`][] to read a checkpoint's
    `config.json` (both the transformers<5 form, with `rope_theta` and `torch_dtype` at the top
    level, and the transformers-5 form, with a `rope_parameters` dict and `dtype`), and the
    presets [`MistralConfig.v0_1`][] and [`MistralConfig.v0_3`][] for the released shapes.

    `head_dim` may differ from `hidden_size // num_attention_heads`; `None` means that quotient.
    `sliding_window=None` means full causal attention; otherwise a query attends to the
    `sliding_window` most recent positions, itself included (HuggingFace's semantics).
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
    bos_token_id: int = 1
    eos_token_id: int = 2
    dtype: str = "bfloat16"

    def __post_init__(self):
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer; got {value!r}.")
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
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(
                f"`head_dim` must be a positive even integer (rotary embeddings rotate pairs); "
                f"got {self.head_dim!r}."
            )
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(
                f"`sliding_window` must be None or a positive integer; got {self.sliding_window!r}."
            )
        if self.dtype not in _DTYPE_NAMES:
            raise ValueError(f"`dtype` must be one of {_DTYPE_NAMES}; got {self.dtype!r}.")

    @property
    def resolved_head_dim(self) -> int:
        """`head_dim` as an `int` (it is always resolved after construction)."""
        assert self.head_dim is not None
        return self.head_dim

    @classmethod
    def v0_1(cls) -> "MistralConfig":
        """Mistral-7B-v0.1: sliding window 4096, vocabulary 32000, rope theta 1e4."""
        return cls()

    @classmethod
    def v0_3(cls) -> "MistralConfig":
        """Mistral-7B-v0.3: no sliding window, vocabulary 32768, rope theta 1e6."""
        return cls(vocab_size=32768, rope_theta=1e6, sliding_window=None)

    @classmethod
    def tiny(cls) -> "MistralConfig":
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
    def preset(cls, name: str) -> "MistralConfig":
        """A shape by name: `"v0.1"` or `"v0.3"` (released), or `"tiny"`."""
        presets = {"v0.1": cls.v0_1, "v0.3": cls.v0_3, "tiny": cls.tiny}
        if name not in presets:
            raise ValueError(f"`name` must be one of {sorted(presets)}; got {name!r}.")
        return presets[name]()

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "MistralConfig":
        """Reads a HuggingFace Mistral config dictionary (the contents of `config.json`).

        **Arguments:**

        - `hf`: the dictionary, in the transformers<5 form (`rope_theta`, `torch_dtype`) or the
            transformers-5 form (`rope_parameters={"rope_theta": ...}`, `dtype`).

        **Returns:**

        The `MistralConfig`. Fields this example does not use (dropout, cache flags) are ignored.
        """
        if hf.get("model_type", "mistral") != "mistral":
            raise ValueError(f"`hf` must describe a Mistral model; got {hf.get('model_type')!r}.")
        if hf.get("tie_word_embeddings", False):
            raise ValueError("`hf` must have `tie_word_embeddings=False`: the head is untied.")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"`hf` must use `hidden_act='silu'`; got {hf['hidden_act']!r}.")
        rope = hf.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"`hf` must use default rotary embeddings; got {rope_type!r}.")
        defaults = cls()
        theta = rope.get("rope_theta", hf.get("rope_theta", defaults.rope_theta))
        dtype = hf.get("dtype") or hf.get("torch_dtype") or defaults.dtype
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_theta", "dtype"}
        kwargs = {name: hf[name] for name in fields if name in hf}
        return cls(**kwargs, rope_theta=float(theta), dtype=str(dtype))

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "MistralConfig":
        """Reads `config.json`, or `path/config.json` if `path` is a directory."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, "rb") as f:
            return cls.from_json_bytes(f.read(), os.fspath(path))

    @classmethod
    def from_json_bytes(cls, raw: bytes, path: str) -> "MistralConfig":
        """Reads the content of a `config.json` file; `path` names it in messages.

        **Arguments:**

        - `raw`: the file's bytes (as [`eqx_lean.Checkpoint.file`][] gives them).
        - `path`: where they were read from.

        **Returns:**

        The `MistralConfig`, as [`MistralConfig.from_hf`][] reads it.
        """
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
        try:
            return cls.from_hf(hf)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{path} is not a Mistral config this example reads: {e}") from e

    def to_hf(self) -> dict[str, Any]:
        """The transformers-5 `config.json` dictionary for this configuration."""
        return {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": self.vocab_size,
            "dtype": self.dtype,
        }
