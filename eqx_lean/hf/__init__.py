"""Hugging Face checkpoints as stacked Equinox models: load, save, generate and fine-tune.

Its dependencies come with the `hf` extra. One model, `Decoder`, configured by `DecoderConfig`,
reads every family (Mistral, Llama, Qwen2, Qwen3, Gemma 2, Gemma 3): the families are specs in
`_families.py`, the config in `_config.py`, the block in `_model.py`, the checkpoint conversion
in `_checkpoint.py`, LoRA with PEFT's format in `eqx_lean.lora`.
"""

import warnings
from typing import Any

from ._adapters import load_adapters as load_adapters, save_adapters as save_adapters
from ._checkpoint import (
    abstract_model as abstract_model,
    from_hf_state_dict as from_hf_state_dict,
    load_hf as load_hf,
    save_hf as save_hf,
    to_hf_state_dict as to_hf_state_dict,
)
from ._config import DecoderConfig as DecoderConfig
from ._data import (
    HFTokenizer as HFTokenizer,
    PackedRows as PackedRows,
    load_rows as load_rows,
    pack_documents as pack_documents,
)
from ._finetune import (
    FinetuneSettings as FinetuneSettings,
    finetune as finetune,
    make_lora_step as make_lora_step,
    step_memory as step_memory,
)
from ._generate import decode_step as decode_step, generate as generate, sample as sample
from ._model import (
    LAYER_INPUT as LAYER_INPUT,
    MLP_CHUNK_BYTES as MLP_CHUNK_BYTES,
    Decoder as Decoder,
    DecoderBlock as DecoderBlock,
    KVCache as KVCache,
    init as init,
    make_block as make_block,
)
from ._plan import (
    fsdp_shardings as fsdp_shardings,
    longest_context as longest_context,
    lora_config_of_rank as lora_config_of_rank,
    plan_lora_step as plan_lora_step,
    plan_train_step as plan_train_step,
)
from ._state import (
    FinetuneState as FinetuneState,
    load_state as load_state,
    save_state as save_state,
)
from ._train import (
    adamw as adamw,
    make_train_step as make_train_step,
    next_token_loss as next_token_loss,
)


# The names before issue 45, kept for one release: the same classes (so `isinstance`, equality
# and pickles are unchanged), reached with a `DeprecationWarning`.
_DEPRECATED = {"Mistral": "Decoder", "MistralConfig": "DecoderConfig"}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new = _DEPRECATED[name]
        warnings.warn(
            f"`eqx_lean.hf.{name}` is deprecated: use `eqx_lean.hf.{new}`, the same class (the "
            "decoder of every family eqx_lean.hf reads). The old name will be removed in the "
            "next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
