"""Which modules a [`LoraConfig`][] adapts: the config itself and PEFT's `target_modules` rule.

A module is named by its *dotted path*: [`jax.tree_util.keystr`][] of its key path relative
to the model (the library's one path convention, `.layers.self_attn.q_proj`), with list
indices and dict keys written as dotted components (`.blocks[0]` -> `.blocks.0`) and without
the leading dot: `layers.self_attn.q_proj`. When a name function is given (PEFT's format), the
module's name is instead its base weight's name without `.weight`, one name per layer
(`model.layers.0.self_attn.q_proj`), which is what PEFT matches against.
"""

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any


ALL_LINEAR = "all-linear"
# PEFT's "all-linear" leaves out the output layer; a generic model has no `get_output_embeddings`,
# so the output layer is recognised by the name transformers gives it.
OUTPUT_HEAD = "lm_head"


def _check_entry(entry: Any) -> str:
    if not isinstance(entry, str) or not entry or entry != entry.strip(".") or ".." in entry:
        raise ValueError(
            "`target_modules` entries must be non-empty dotted module names such as 'q_proj' or "
            f"'self_attn.q_proj' (no leading, trailing or doubled dots); got {entry!r}."
        )
    return entry


def canonical_targets(targets: Any) -> str | tuple[str, ...]:
    """`target_modules` in canonical form: a regular expression string or `"all-linear"` as
    given, a list of names as a sorted tuple without repeats (so equal settings compare
    equal). Raises a `ValueError` naming the field for anything else."""
    if isinstance(targets, str):
        if targets == ALL_LINEAR:
            return targets
        try:
            re.compile(targets)
        except re.error as error:
            raise ValueError(
                f"`target_modules` given as a string must be a regular expression (or "
                f"'{ALL_LINEAR}'); {targets!r} is not one ({error})."
            ) from error
        return targets
    if not isinstance(targets, Sequence) or not targets:
        raise ValueError(
            "`target_modules` must be a non-empty list of module names (matched as suffixes of "
            f"a module's dotted path), a regular expression string, or '{ALL_LINEAR}'; got "
            f"{targets!r}."
        )
    return tuple(sorted({_check_entry(t) for t in targets}))


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


def dotted(keystr: str) -> str:
    """A `jax.tree_util.keystr` as a dotted path without the leading dot: `.blocks[0]['q']`
    -> `blocks.0.q`."""
    parts = re.sub(r"\[(?:'([^']*)'|\"([^\"]*)\"|([^\]]*))\]", r".\1\2\3", keystr)
    return parts.removeprefix(".")


def entry_matches(entry: str, name: str) -> bool:
    """PEFT's rule for one list entry: `name` is `entry` or ends in `.` + `entry`."""
    return name == entry or name.endswith("." + entry)


def matches(targets: str | Sequence[str], name: str) -> bool:
    """Whether `target_modules` (canonical) adapts the module named `name`."""
    if targets == ALL_LINEAR:
        return name.rsplit(".", 1)[-1] != OUTPUT_HEAD
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(entry_matches(entry, name) for entry in targets)


def unmatched_entries(targets: str | Sequence[str], names: Sequence[str]) -> list[str]:
    """The list entries of `target_modules` that match none of `names` (none for a string)."""
    if isinstance(targets, str):
        return []
    return [e for e in targets if not any(entry_matches(e, n) for n in names)]
