"""LoRA adapters for any Equinox model, stacked or plain, and Hugging Face PEFT's adapter format."""

from ._lora import (
    LoraLinear as LoraLinear,
    add_lora as add_lora,
    lora_filter as lora_filter,
    lora_paths as lora_paths,
)
from ._merge import merge_lora as merge_lora, unmerge_lora as unmerge_lora
from ._peft import load_adapters as load_adapters, save_adapters as save_adapters
from ._select import LoraConfig as LoraConfig
