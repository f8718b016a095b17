"""PEFT adapters of the HF decoder: `eqx_lean.lora`'s PEFT format with the decoder's HF names.

`model.layers.{i}.self_attn.q_proj.weight` names a base weight, so its adapters are PEFT's
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (and `lora_B`), as PEFT's
`save_pretrained` writes them for a `*ForCausalLM` model.
"""

import os
from collections.abc import Callable
from typing import Any

from jaxtyping import PyTree

from ..lora import _peft
from ._checkpoint import _hf_name


# PEFT's module name -> (its path inside a decoder layer, the projection in a `DecoderBlock`):
# the seven projections LoRA targets in every family this package reads.
TARGETS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "q_proj": ("self_attn.q_proj", lambda b: b.self_attn.q_proj),
    "k_proj": ("self_attn.k_proj", lambda b: b.self_attn.k_proj),
    "v_proj": ("self_attn.v_proj", lambda b: b.self_attn.v_proj),
    "o_proj": ("self_attn.o_proj", lambda b: b.self_attn.o_proj),
    "gate_proj": ("mlp.gate_proj", lambda b: b.mlp.gate_proj),
    "up_proj": ("mlp.up_proj", lambda b: b.mlp.up_proj),
    "down_proj": ("mlp.down_proj", lambda b: b.mlp.down_proj),
}


def save_adapters(
    model: PyTree, path: str | os.PathLike, *, base_model_name_or_path: str | None = None
) -> None:
    """Writes the adapters of a HF decoder in PEFT's format (see
    [`eqx_lean.lora.save_adapters`][]): `peft.PeftModel.from_pretrained(<its *ForCausalLM>,
    path)` loads the directory.

    **Arguments:**

    - `model`: the decoder with unmerged adapters.
    - `path`: the directory to write.
    - `base_model_name_or_path`: recorded in `adapter_config.json`.
    """
    _peft.save_adapters(
        model,
        path,
        _hf_name,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
    )


def load_adapters(model: PyTree, path: str | os.PathLike) -> PyTree:
    """Loads PEFT adapters (from PEFT's `save_pretrained` or [`save_adapters`][]) onto a HF
    decoder, in float32 (see [`eqx_lean.lora.load_adapters`][]).

    **Arguments:**

    - `model`: the decoder without adapters.
    - `path`: the adapter directory (`adapter_config.json`, `adapter_model.safetensors`).

    **Returns:**

    The decoder with `LoraLinear` projections holding the loaded adapters.
    """
    return _peft.load_adapters(model, path, _hf_name)
