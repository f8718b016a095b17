"""The state of a fine-tuning run, saved and resumed as one atomic checkpoint directory.

A resumed run must equal an uninterrupted one bit for bit, so everything a step depends on is
saved together: the adapters, the optimizer state, the step count (which is also the data
position: [`batches`][eqx_lean.hf._data.batches] replays its shuffles from it) and the RNG key of
LoRA dropout. They go through [`eqx_lean.save_tensors`][] into one directory, which it writes
beside the old one and swaps in atomically, so a run killed during a save resumes from the
previous save, never from a mix of two.
"""

import dataclasses
import json
import os
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

import eqx_lean


STATE_FILE = "finetune_state.json"
WEIGHTS_FILE = "finetune_state.safetensors"
_FORMAT = "eqx_lean.hf.finetune_state/1"


@dataclasses.dataclass(frozen=True)
class FinetuneState:
    """Everything a LoRA fine-tuning step depends on, besides the frozen base and the data.

    **Arguments:**

    - `adapters`: the trainable half of `eqx.partition(model, lora_filter(model))`.
    - `opt_state`: the optimizer state of the adapters.
    - `step`: the number of steps taken; the next batch is batch `step` of the data.
    - `key`: the RNG key of LoRA dropout; step `i` uses `jax.random.fold_in(key, i)`.
    - `info`: JSON-serialisable settings of the run (batch size, seed...), saved with it, so a
        resume can refuse settings that would not continue the same run.
    """

    adapters: Any
    opt_state: Any
    step: int
    key: PRNGKeyArray
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


def _names(path: Any, leaf: Any) -> str:
    del leaf
    # Dotted paths of the `{"adapters": ..., "opt_state": ..., "key": ...}` tree: unique, stable
    # across processes, and free of the `{i}` that would mean "one tensor per layer".
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _tree(state: FinetuneState) -> dict[str, Any]:
    return {
        "adapters": state.adapters,
        "opt_state": state.opt_state,
        "key": jax.random.key_data(state.key),
    }


def save_state(path: str | os.PathLike, state: FinetuneState) -> None:
    """Saves `state` as one checkpoint directory, replacing `path` atomically.

    **Arguments:**

    - `path`: the directory; a save replaces it whole (see [`eqx_lean.save_tensors`][]).
    - `state`: the [`FinetuneState`][] to save.

    **Returns:**

    Nothing.
    """
    meta = {"format": _FORMAT, "step": int(state.step), "info": state.info}
    eqx_lean.save_tensors(
        path,
        _tree(state),
        _names,
        weights_name=WEIGHTS_FILE,
        files={STATE_FILE: json.dumps(meta, indent=2).encode()},
    )


def load_state(path: str | os.PathLike, like: FinetuneState) -> FinetuneState:
    """Loads a state saved by [`save_state`][] into the structure of `like`.

    **Arguments:**

    - `path`: the directory [`save_state`][] wrote.
    - `like`: a state of the same structure, concrete or abstract (`jax.eval_shape`): fresh
        adapters and optimizer state built as for step 0; its `step`, `key` and `info` are
        ignored.

    **Returns:**

    The saved [`FinetuneState`][], its arrays of the dtypes and shapes of `like`'s.
    """
    abstract = jax.eval_shape(
        lambda adapters, opt_state, key: _tree(FinetuneState(adapters, opt_state, 0, key)),
        eqx.filter(like.adapters, eqx.is_array),
        eqx.filter(like.opt_state, eqx.is_array),
        like.key,
    )
    with eqx_lean.open_checkpoint(path, files=[STATE_FILE]) as checkpoint:
        raw = checkpoint.file(STATE_FILE)
        if raw is None:
            raise FileNotFoundError(
                f"{os.fspath(path)} holds no {STATE_FILE}: it is not a state saved by save_state."
            )
        meta = json.loads(raw)
        if meta.get("format") != _FORMAT:
            raise ValueError(
                f"{os.fspath(path)}/{STATE_FILE} has format {meta.get('format')!r}; this "
                f"version reads {_FORMAT!r}."
            )
        tree = eqx_lean.load_tensors(checkpoint, abstract, _names)
    return FinetuneState(
        adapters=tree["adapters"],
        opt_state=tree["opt_state"],
        step=int(meta["step"]),
        key=jax.random.wrap_key_data(jnp.asarray(tree["key"])),
        info=meta["info"],
    )
