"""Gemma 3's multimodal checkpoints (`Gemma3ForConditionalGeneration`: Gemma 3 4B, 12B and 27B
as released): their text tower, read as the `Gemma3ForCausalLM` it is.

The tower's tensors carry a prefix before a `Gemma3ForCausalLM`'s `model.` names:
`language_model.model.` on the hub and as `transformers` 5.18's `save_pretrained` writes them,
`model.language_model.` as `transformers` 5 holds them in memory (and some writers store them).
The vision tower and the projector are not read: a load ignores their tensors, and refuses any
other tensor it has no leaf for.
"""

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any


PREFIXES = ("language_model.model.", "model.language_model.")
_VISION = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
_EMBED = "embed_tokens.weight"


def is_multimodal(hf: Mapping[str, Any]) -> bool:
    """Whether a `config.json` is a `Gemma3ForConditionalGeneration`'s (`model_type` 'gemma3')."""
    return hf.get("model_type") == "gemma3"


def text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The text tower's `config.json` fields, as a `Gemma3ForCausalLM`'s: `text_config` with
    the fields the outer config states for the whole model (its dtype, whether the head is
    tied, the end ids where the tower gives none)."""
    text = hf.get("text_config")
    if text is None:
        text = {}  # transformers builds the default text tower
    if not isinstance(text, dict):
        raise ValueError(f"`text_config` must be a JSON object; got {text!r}.")
    text = dict(text, model_type="gemma3_text")
    for name in ("dtype", "torch_dtype", "tie_word_embeddings"):
        if hf.get(name) is not None:
            text[name] = hf[name]
    for name in ("bos_token_id", "eos_token_id"):
        if text.get(name) is None and hf.get(name) is not None:
            text[name] = hf[name]
    return text


def tower_prefix(stored: Collection[str], config_file: str) -> str:
    """The prefix of the text tower's tensors in a multimodal checkpoint."""
    found = [prefix for prefix in PREFIXES if prefix + _EMBED in stored]
    if len(found) != 1:
        raise ValueError(
            f"{config_file} describes a Gemma3ForConditionalGeneration, whose text tower's "
            f"tensors must be named under one of {list(PREFIXES)}; the checkpoint holds "
            f"{'both' if found else 'neither'} ('{PREFIXES[0]}{_EMBED}')."
        )
    return found[0]


@dataclasses.dataclass(frozen=True)
class TowerNames:
    """The tensor name of a decoder leaf in a multimodal checkpoint: the causal model's name
    (`base`) with `model.` replaced by the tower's prefix; the head keeps its name. Equal by
    value, so that loads of one layout share their compiled writes."""

    prefix: str
    base: Callable[[Any, Any], str]

    def __call__(self, path: Any, leaf: Any) -> str:
        name = self.base(path, leaf)
        return self.prefix + name.removeprefix("model.") if name.startswith("model.") else name


def check_extras(stored: Collection[str], names: Collection[str], config_file: str) -> None:
    """Every tensor of a multimodal checkpoint is the text tower's, the vision tower's or the
    projector's: anything else means the checkpoint is not the model `config.json` says."""
    names = set(names)
    extra = [
        name
        for name in stored
        if name not in names
        and not name.startswith(_VISION)
        and not name.endswith("rotary_emb.inv_freq")
    ]
    if extra:
        raise ValueError(
            f"{config_file} describes a Gemma3ForConditionalGeneration, but its checkpoint holds "
            f"tensors that are neither its text tower's (as config.json sizes it) nor its vision "
            f"tower's or projector's: {sorted(extra)[:5]}."
        )
