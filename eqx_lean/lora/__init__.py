"""LoRA adapters for Equinox models, stacked or plain, and Hugging Face PEFT's adapter format."""

from ._lora import (
    LoraConfig as LoraConfig,
    LoraLinear as LoraLinear,
    add_lora as add_lora,
    lora_filter as lora_filter,
    merge_lora as merge_lora,
)
from ._peft import load_adapters as load_adapters, save_adapters as save_adapters
