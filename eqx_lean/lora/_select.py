"""[`LoraConfig`][]: LoRA's settings, with PEFT's field names (its `target_modules` rule is
`eqx_lean._targets`, shared with quantisation)."""

import dataclasses
import math
from collections.abc import Sequence

from .._targets import (
    ALL_LINEAR as ALL_LINEAR,
    OUTPUT_HEAD as OUTPUT_HEAD,
    canonical_targets as canonical_targets,
    dotted as dotted,
    entry_matches as entry_matches,
    matches as matches,
    unmatched_entries as unmatched_entries,
)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA settings, with PEFT's field names.

    **Arguments:**

    - `r`: the rank of every adapter.
    - `lora_alpha`: the scale numerator: adapters are scaled by `lora_alpha / r`, or by
        `lora_alpha / sqrt(r)` with `use_rslora`.
    - `target_modules`: which modules are adapted, by PEFT's rule, matched against each
        candidate module's dotted path (`layers.self_attn.q_proj`, see the module docstring):
        - a list or tuple of names: a module is adapted if its path is a name or ends in `.`
            followed by a name, component-wise (`"q_proj"` and `"self_attn.q_proj"` match
            `layers.self_attn.q_proj`; `"q"` does not);
        - a string: a regular expression that must match the whole path
            (`r"layers\\.self_attn\\.(q|v)_proj"`);
        - `"all-linear"`: every candidate module except one named `lm_head` (the output head,
            which PEFT also leaves out).

        A list is kept sorted and without repeats, so equal settings compare equal.
    - `use_rslora`: rank-stabilised scaling (`alpha / sqrt(r)`).
    - `lora_dropout`: dropout on the adapter's input, applied when the model is called with a
        `key` (training), not without one (inference).
    """

    r: int = 8
    lora_alpha: float = 8
    target_modules: str | Sequence[str] = ("q_proj", "v_proj")  # a tuple once made
    use_rslora: bool = False
    lora_dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"`r` must be a positive integer; got {self.r!r}.")
        alpha = self.lora_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
            raise ValueError(f"`lora_alpha` must be a positive number; got {alpha!r}.")
        if not isinstance(self.use_rslora, bool):
            raise ValueError(f"`use_rslora` must be True or False; got {self.use_rslora!r}.")
        rate = self.lora_dropout
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate < 1.0:
            raise ValueError(f"`lora_dropout` must be in [0, 1); got {rate!r}.")
        object.__setattr__(self, "target_modules", canonical_targets(self.target_modules))

    @property
    def scale(self) -> float:
        """The factor on `B A`: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)
