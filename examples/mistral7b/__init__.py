"""Mistral-7B built lean with eqx_lean: the model, HF conversion, generation and training.

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
from .model import (
    DecoderBlock as DecoderBlock,
    KVCache as KVCache,
    Mistral as Mistral,
    init as init,
    make_block as make_block,
)
