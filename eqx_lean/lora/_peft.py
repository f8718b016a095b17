"""LoRA adapters in Hugging Face PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

For a `MistralForCausalLM` wrapped by `peft.get_peft_model`, PEFT 0.21's `save_pretrained`
names the tensors `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (`[r, in]`)
and `...lora_B.weight` (`[out, r]`); [`save_adapters`][] writes the same names with
`eqx_lean.save_tensors` (`{i}` templates over the stacked adapters), so that
`peft.PeftModel.from_pretrained` loads them, and [`load_adapters`][] reads them back with
`eqx_lean.load_tensors`. A configuration loads only if this example computes exactly what
PEFT does with it: [`parse_adapter_config`][] checks every field against the table of PEFT
0.21.2's `LoraConfig` in `peft_fields.py` and refuses anything else (per-module ranks, DoRA and
the other variants, an initialisation that changes the base weights, trained biases,
`modules_to_save`, a subset of layers, other modules) with an error naming the field and the
file, never silently ignoring it.
"""

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_lean

from ..hf._checkpoint import stored_layers
from ..hf._model import Mistral
from ._lora import (
    TARGETS,
    LoraConfig,
    apply_adapters,
    init_adapters,
    lora_config_of,
    lora_filter,
    target_name,
)
from ._peft_fields import FIELDS, check_fields, field_error


_PEFT_PREFIX = "base_model.model.model.layers.{i}."
_HF_LAYERS = ["model", "layers"]  # the modules above a layer in `MistralForCausalLM`
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def to_peft(config: LoraConfig) -> dict[str, Any]:
    """The `adapter_config.json` dictionary of `config` for PEFT 0.21 (the fields that
    matter for a LoRA on `MistralForCausalLM`; PEFT fills in its defaults for the rest)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "use_rslora": config.use_rslora,
        "target_modules": list(config.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_dora": False,
        "lora_bias": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "inference_mode": True,
    }


def from_peft(peft: Mapping[str, Any], file: str = CONFIG_FILE) -> LoraConfig:
    """Reads a decoded `adapter_config.json`, refusing what this example does not load exactly.

    Every field is checked against [`peft_fields.FIELDS`][] (PEFT 0.21.2's `LoraConfig`): the
    fields this example implements must hold valid values, every other field its default, and
    a field PEFT 0.21.2 does not have must be null, false, 0 or empty.

    **Arguments:**

    - `peft`: the decoded JSON object.
    - `file`: the file it was read from, named in the messages.

    **Returns:**

    The [`LoraConfig`][]. Raises a `ValueError` naming the field, the file and what must be
    true for the first field that does not load exactly.
    """
    check_fields(peft, file)

    def get(name: str) -> Any:
        return peft.get(name, FIELDS[name].default)

    return LoraConfig(
        r=get("r"),
        lora_alpha=get("lora_alpha"),
        target_modules=_targets_of(get("target_modules"), file),
        use_rslora=get("use_rslora"),
        lora_dropout=float(get("lora_dropout")),
    )


_LAYER_INDEX = re.compile(r"0|[1-9][0-9]*")
_ALL_LAYERS = "every layer"


def _matched(entry: str) -> tuple[str, int | str] | None:
    """The projection a `target_modules` entry adapts, and in which layer (an index, or
    `_ALL_LAYERS`); `None` when it adapts no projection.

    PEFT's rule: an entry adapts each module whose name (`model.layers.0.self_attn.q_proj`)
    is the entry or ends in `.` followed by the entry.
    """
    parts = entry.split(".")
    for module, (path, _) in TARGETS.items():
        tail = path.split(".")
        if len(parts) <= len(tail):
            if parts == tail[len(tail) - len(parts) :]:
                return module, _ALL_LAYERS
            continue
        head, index = parts[: -len(tail) - 1], parts[-len(tail) - 1]
        if parts[-len(tail) :] == tail and _LAYER_INDEX.fullmatch(index):
            if head == _HF_LAYERS[len(_HF_LAYERS) - len(head) :]:
                return module, int(index)
    return None


def _targets_of(targets: Any, file: str) -> tuple[str, ...]:
    """The projections `target_modules` adapts, each of which it must adapt in every layer."""
    if targets == "all-linear":  # PEFT: every linear layer but the output head
        return tuple(TARGETS)
    matches = {entry: _matched(entry) for entry in targets}
    unknown = [entry for entry, match in matches.items() if match is None]
    if unknown:
        raise field_error(
            "target_modules",
            f"must name only the projections {list(TARGETS)} (by PEFT's rule: a module whose "
            "name is an entry or ends in '.' and the entry, such as 'q_proj' or "
            f"'model.layers.0.self_attn.q_proj'), but {unknown} name none",
            targets,
            file,
        )
    layers: dict[str, set[int | str]] = {}
    for match in matches.values():
        if match is not None:
            layers.setdefault(match[0], set()).add(match[1])
    # Named layer by layer (as PEFT writes "all-linear" for a small model): each projection in
    # the same layers 0, ..., n - 1 (the weights must then hold n layers).
    named = {m: sorted(int(i) for i in s) for m, s in layers.items() if _ALL_LAYERS not in s}
    count = max(map(len, named.values()), default=0)
    if any(indices != list(range(count)) for indices in named.values()):
        adapted = "; ".join(f"{m} in layers {indices}" for m, indices in named.items())
        raise field_error(
            "target_modules",
            "must adapt each projection it names in every layer (this example stacks one adapter "
            f"per layer, in layers 0 to n - 1), but it adapts {adapted}",
            targets,
            file,
        )
    return tuple(layers)


def _peft_name(target: str, matrix: str) -> str:
    """PEFT's tensor-name template of one adapter matrix (`matrix` is `lora_A` or `lora_B`)."""
    return f"{_PEFT_PREFIX}{TARGETS[target][0]}.{matrix}.weight"


def _model_adapter_names(path: Any, leaf: Any) -> str:
    """The name of an adapter leaf of a model (`.layers.mlp.up_proj.lora_A` and the like)."""
    del leaf
    module, matrix = jax.tree_util.keystr(path).removeprefix(".layers.").rsplit(".", 1)
    return _peft_name(target_name(module), matrix)


def _stacked_adapter_names(path: Any, leaf: Any) -> str:
    """The name of a leaf of `init_adapters`' dict (`['up_proj'].lora_A` and the like)."""
    del leaf
    target, matrix = path[0].key, path[1].name
    return _peft_name(target, matrix)


def _write_adapter_directory(path: str, adapters: Mistral, config_json: Mapping[str, Any]) -> None:
    """Writes `adapter_model.safetensors` and `adapter_config.json` into `path`, replacing it.

    One atomic directory, as for any `eqx_lean` save: after a crash `path` holds the old
    adapter or the new one, weights and config together. Other files (a README) are kept.
    """
    config_bytes = (json.dumps(dict(config_json), indent=2) + "\n").encode()
    eqx_lean.save_tensors(
        path,
        adapters,
        _model_adapter_names,
        weights_name=WEIGHTS_FILE,
        files={CONFIG_FILE: config_bytes},
    )


def save_adapters(model: Mistral, path: str | os.PathLike) -> None:
    """Writes the adapters of `model` in PEFT's format: `adapter_config.json` and
    `adapter_model.safetensors` (PEFT's tensor names, one tensor per layer and matrix).

    `peft.PeftModel.from_pretrained(MistralForCausalLM..., path)` loads the directory.
    """
    config = lora_config_of(model)
    adapters = eqx.filter(model, lora_filter(model))
    # One adapter file holds no more than a few hundred MiB even at 7B, rank 64.
    _write_adapter_directory(os.fspath(path), adapters, to_peft(config))


def parse_adapter_config(raw: bytes, file: str) -> LoraConfig:
    """Decodes and checks the bytes of an `adapter_config.json` (see [`from_peft`][]); no I/O.

    **Arguments:**

    - `raw`: the file's bytes.
    - `file`: the file's path, named in the messages.

    **Returns:**

    The [`LoraConfig`][]. A file that is not valid JSON (truncated, say) or a field that does
    not load exactly raises a `ValueError` naming the file (and the field).
    """
    try:
        peft = json.loads(raw)
    except ValueError as error:  # JSONDecodeError, or UnicodeDecodeError
        raise ValueError(
            f"{file} must be a PEFT adapter config, a complete JSON object; it is not valid "
            f"JSON ({error})."
        ) from error
    return from_peft(peft, file)


def _missing_config(file: str) -> FileNotFoundError:
    return FileNotFoundError(f"`path` must be a PEFT adapter directory; {file} is missing.")


def read_adapter_config(path: str | os.PathLike) -> LoraConfig:
    """Reads and checks `path/adapter_config.json` (see [`parse_adapter_config`][])."""
    file = os.path.join(os.fspath(path), CONFIG_FILE)
    if not os.path.isfile(file):
        raise _missing_config(file)
    with open(file, "rb") as f:
        return parse_adapter_config(f.read(), file)


def load_adapters(model: Mistral, path: str | os.PathLike) -> Mistral:
    """Loads PEFT adapters (written by PEFT's `save_pretrained` or [`save_adapters`][]) onto
    `model`, in float32, with `eqx_lean.load_tensors`.

    The config is checked first (see [`parse_adapter_config`][]): a configuration this example
    does not load exactly raises a `ValueError` naming the field, before any tensor is read.

    **Arguments:**

    - `model`: a [`Mistral`][] without adapters.
    - `path`: the adapter directory (`adapter_config.json`, `adapter_model.safetensors`).

    **Returns:**

    `model` with [`LoraLinear`][] projections holding the loaded adapters.
    """
    path = os.fspath(path)
    with _open_adapters(path) as checkpoint:
        raw = checkpoint.file(CONFIG_FILE)
        file = os.path.join(path, CONFIG_FILE)
        if raw is None:
            raise _missing_config(file)
        config = parse_adapter_config(raw, file)
        _check_layer_count(checkpoint, model)
        like = eqx.filter_eval_shape(
            init_adapters, model, config, key=jax.random.key(0), dtype=jnp.float32
        )
        # Strict, as every load: a tensor no adapter is named for (a DoRA magnitude, a trained
        # bias, an adapter on another module) is refused, naming it.
        adapters = eqx_lean.load_tensors(
            checkpoint, like, _stacked_adapter_names, dtype=jnp.float32
        )
    return apply_adapters(model, adapters, config)


def _check_layer_count(checkpoint: eqx_lean.Checkpoint, model: Mistral) -> None:
    prefix = _PEFT_PREFIX.removesuffix("{i}.")
    held = stored_layers(eqx_lean.checkpoint_tensors(checkpoint), prefix)
    expected = model.config.num_hidden_layers
    if held and held != expected:
        raise ValueError(
            f"{checkpoint.describe()} holds adapters for {held} layers ('{prefix}0.…' to "
            f"'{prefix}{held - 1}.…'), but `model` has {expected}: adapters load only onto a "
            "model with the layers they were trained on."
        )


def _open_adapters(path: str) -> eqx_lean.Checkpoint:
    """The adapter weights and `adapter_config.json`, opened as one checkpoint: a save
    replacing the directory meanwhile gives the old or the new adapters, never the config of
    one with the weights of the other."""
    try:
        return eqx_lean.open_checkpoint(os.path.join(path, WEIGHTS_FILE), files=[CONFIG_FILE])
    except FileNotFoundError:
        read_adapter_config(path)  # a missing or bad config is the first thing to say
        raise
