"""Mistral-7B built lean with eqx_lean: model, HF conversion, generation, training, LoRA.

Run from the repository root, e.g. `python -m examples.mistral7b --help`.
"""

from .config import MistralConfig as MistralConfig
from .generate import decode_step as decode_step, generate as generate, sample as sample
from .hf import (
    from_hf_state_dict as from_hf_state_dict,
    load_hf as load_hf,
    save_hf as save_hf,
    to_hf_state_dict as to_hf_state_dict,
)
from .lora import (
    LoraConfig as LoraConfig,
    LoraLinear as LoraLinear,
    add_lora as add_lora,
    lora_filter as lora_filter,
    merge_lora as merge_lora,
)
from .model import (
    DecoderBlock as DecoderBlock,
    KVCache as KVCache,
    Mistral as Mistral,
    init as init,
    make_block as make_block,
)
from .peft_format import load_adapters as load_adapters, save_adapters as save_adapters
