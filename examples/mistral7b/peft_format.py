"""LoRA adapters in Hugging Face PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

For a `MistralForCausalLM` wrapped by `peft.get_peft_model`, PEFT 0.21's `save_pretrained`
names the tensors `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (`[r, in]`)
and `...lora_B.weight` (`[out, r]`); [`save_adapters`][] writes the same names with
`eqx_lean.save_tensors` (`{i}` templates over the stacked adapters), so that
`peft.PeftModel.from_pretrained` loads them, and [`load_adapters`][] reads them back with
`eqx_lean.load_tensors`. Configurations this example does not implement (per-module ranks,
DoRA, trained biases, `modules_to_save`, a subset of layers, other modules) are refused with an
error naming the field, never silently ignored.
"""

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_lean

from .lora import (
    TARGETS,
    LoraConfig,
    apply_adapters,
    init_adapters,
    lora_config_of,
    lora_filter,
    target_name,
)
from .model import Mistral


_PEFT_PREFIX = "base_model.model.model.layers.{i}."
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


def from_peft(peft: Mapping[str, Any]) -> LoraConfig:
    """Reads a PEFT `adapter_config.json` dictionary, refusing what is not implemented.

    Per-module ranks or scales (`rank_pattern`, `alpha_pattern`), DoRA (`use_dora`),
    `modules_to_save`, `layers_to_transform`, a `bias` other than `"none"`, adapters on
    modules other than the seven projections, and other LoRA variants raise a `ValueError`
    naming the field.
    """
    _check_peft_fields(peft)
    targets = peft.get("target_modules")
    if targets == "all-linear":  # PEFT: every linear layer but the output head
        targets = list(TARGETS)
    elif isinstance(targets, str):
        raise ValueError(
            "`target_modules` must be a list of module names (a regular expression is not "
            f"supported); got {targets!r}."
        )
    if not isinstance(targets, Sequence) or not targets:
        raise ValueError(f"`target_modules` must be a non-empty list; got {targets!r}.")
    unknown = [t for t in targets if not _is_target(t)]
    if unknown:
        raise ValueError(
            f"`target_modules` must name only the projections {list(TARGETS)}; "
            f"{unknown} are not supported."
        )
    return LoraConfig(
        r=peft.get("r", 8),
        lora_alpha=peft.get("lora_alpha", 8),
        target_modules=tuple(targets),
        use_rslora=bool(peft.get("use_rslora", False)),
        lora_dropout=float(peft.get("lora_dropout", 0.0)),
    )


def _is_target(name: Any) -> bool:
    try:
        target_name(name)
    except (ValueError, TypeError):
        return False
    return True


def _is_empty(value: Any) -> bool:
    return value is None or value == {} or value == [] or value is False


# PEFT fields whose non-default values change the model in ways this example does not
# implement: field -> (is the value acceptable, what must hold).
_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "peft_type": (lambda v: v in (None, "LORA"), 'must be "LORA"'),
    "bias": (lambda v: v in (None, "none"), 'must be "none" (no trained biases)'),
    "rank_pattern": (_is_empty, "must be empty (one rank for every module)"),
    "alpha_pattern": (_is_empty, "must be empty (one alpha for every module)"),
    "use_dora": (_is_empty, "must be false (DoRA is not implemented)"),
    "modules_to_save": (_is_empty, "must be empty (only adapters are trained)"),
    "layers_to_transform": (_is_empty, "must be null (every layer is adapted)"),
    "layers_pattern": (_is_empty, "must be null (every layer is adapted)"),
    "fan_in_fan_out": (_is_empty, "must be false (weights are stored [out, in])"),
    "lora_bias": (_is_empty, "must be false (no bias on lora_B)"),
    "target_parameters": (_is_empty, "must be null (only linear modules are adapted)"),
    "layer_replication": (_is_empty, "must be null"),
    "trainable_token_indices": (_is_empty, "must be null (no trainable tokens)"),
    "exclude_modules": (_is_empty, "must be null"),
    "use_qalora": (_is_empty, "must be false"),
    "use_bdlora": (_is_empty, "must be null"),
    "alora_invocation_tokens": (_is_empty, "must be null (activated LoRA is not implemented)"),
}


def _check_peft_fields(peft: Mapping[str, Any]) -> None:
    if not isinstance(peft, Mapping):
        raise TypeError(f"the adapter config must be a JSON object; got {type(peft).__name__}.")
    for field, (acceptable, requirement) in _REFUSED.items():
        if field in peft and not acceptable(peft[field]):
            raise ValueError(
                f"adapter config field `{field}` {requirement} for this example's LoRA; "
                f"got {peft[field]!r}."
            )


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


def read_adapter_config(path: str | os.PathLike) -> LoraConfig:
    """Reads and checks `path/adapter_config.json` (see [`from_peft`][])."""
    file = os.path.join(os.fspath(path), CONFIG_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"`path` must be a PEFT adapter directory; {file} is missing.")
    with open(file) as f:
        return from_peft(json.load(f))


def load_adapters(model: Mistral, path: str | os.PathLike) -> Mistral:
    """Loads PEFT adapters (written by PEFT's `save_pretrained` or [`save_adapters`][]) onto
    `model`, in float32, with `eqx_lean.load_tensors`.

    **Returns:**

    `model` with [`LoraLinear`][] projections holding the loaded adapters.
    """
    path = os.fspath(path)
    config = read_adapter_config(path)
    like = eqx.filter_eval_shape(
        init_adapters, model, config, key=jax.random.key(0), dtype=jnp.float32
    )
    # Strict, as every load: a tensor no adapter is named for (a DoRA magnitude, a trained bias,
    # an adapter on another module) is refused, naming it.
    file = os.path.join(path, WEIGHTS_FILE)
    adapters = eqx_lean.load_tensors(file, like, _stacked_adapter_names, dtype=jnp.float32)
    return apply_adapters(model, adapters, config)
