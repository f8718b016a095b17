"""Mistral-7B built lean with eqx_lean: the command line and notebooks over `eqx_lean.hf` and
`eqx_lean.lora`, where the model, HF conversion, generation, training and LoRA live.

Run from the repository root, e.g. `python -m examples.mistral7b --help`.
"""

from eqx_lean.hf import (
    DecoderConfig as DecoderConfig,
    load_adapters as load_adapters,
    load_hf as load_hf,
    save_adapters as save_adapters,
    save_hf as save_hf,
)
