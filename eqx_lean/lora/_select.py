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


# The adapter's product is scaled in float32 or narrower: a scale above the largest float32 is
# an infinity there (every output it touches infinite or NaN), one below the smallest normal
# float32 is 0 or loses its precision (the adapter does nothing, or not what was trained).
_FLOAT32 = (1.1754943508222875e-38, 3.4028234663852886e38)


def scale_problem(alpha: float, r: int, use_rslora: bool) -> str | None:
    """What is wrong with the scale a positive `alpha` and `r` give (`alpha / r`, or
    `alpha / sqrt(r)` with `use_rslora`, as PEFT computes it), as "must ..."; `None` when it is
    a normal float32. PEFT checks nothing here: a `lora_alpha` of 1e308 scales by infinity."""
    scale = alpha / (math.sqrt(r) if use_rslora else r)
    low, high = _FLOAT32
    if low <= scale <= high:
        return None
    formula = "lora_alpha / sqrt(r)" if use_rslora else "lora_alpha / r"
    return (
        f"must give a scale `{formula}` from {low:.7g} to {high:.7g} (a normal float32, in "
        f"which the adapter is scaled); with r = {r} it gives {scale!r}"
    )


def _finite(alpha: float) -> bool:
    """Whether `alpha` is a positive float (an integer beyond every float is not)."""
    try:
        return 0 < float(alpha) < math.inf
    except OverflowError:
        return False


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA settings, with PEFT's field names.

    **Arguments:**

    - `r`: the rank of every adapter.
    - `lora_alpha`: the scale numerator: adapters are scaled by `lora_alpha / r`, or by
        `lora_alpha / sqrt(r)` with `use_rslora`, a scale that must be a normal float32 (from
        about 1.2e-38 to 3.4e38: the product is scaled in float32 or narrower).
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
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not _finite(alpha):
            raise ValueError(f"`lora_alpha` must be a positive number; got {alpha!r}.")
        if not isinstance(self.use_rslora, bool):
            raise ValueError(f"`use_rslora` must be True or False; got {self.use_rslora!r}.")
        problem = scale_problem(alpha, self.r, self.use_rslora)
        if problem is not None:
            raise ValueError(f"`lora_alpha` {problem}; got {alpha!r}.")
        rate = self.lora_dropout
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate < 1.0:
            raise ValueError(f"`lora_dropout` must be in [0, 1); got {rate!r}.")
        object.__setattr__(self, "target_modules", canonical_targets(self.target_modules))

    @property
    def scale(self) -> float:
        """The factor on `B A`: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)
