"""Mistral-7B built lean with eqx_lean: the model, HF conversion, generation and training.

Run from the repository root, e.g. `python -m examples.mistral7b --help`.
"""

from .config import MistralConfig as MistralConfig
from .model import (
    DecoderBlock as DecoderBlock,
    init as init,
    KVCache as KVCache,
    make_block as make_block,
    Mistral as Mistral,
)
