"""The target-module rule shared by LoRA (`LoraConfig`) and quantisation (`QuantConfig`):
PEFT's `target_modules`, matched against module names.

A module is named by its *dotted path*: [`jax.tree_util.keystr`][] of its key path relative
to the model (the library's one path convention, `.layers.self_attn.q_proj`), with list
indices and dict keys written as dotted components (`.blocks[0]` -> `.blocks.0`) and without
the leading dot: `layers.self_attn.q_proj`. When a name function is given (PEFT's format), the
module's name is instead its base weight's name without `.weight`, one name per layer
(`model.layers.0.self_attn.q_proj`), which is what PEFT matches against.
"""

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
