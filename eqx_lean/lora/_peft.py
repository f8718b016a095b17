"""LoRA adapters in Hugging Face PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

For a torch model wrapped by `peft.get_peft_model`, PEFT 0.21's `save_pretrained` names the
tensors `base_model.model.<module>.lora_A.weight` (`[r, in]`) and `...lora_B.weight`
(`[out, r]`), where `<module>` is the adapted module's name in the torch model
(`model.layers.0.self_attn.q_proj`). [`save_adapters`][] and [`load_adapters`][] work on any
Equinox model given the same name function as [`eqx_lean.save_tensors`][] /
[`eqx_lean.load_tensors`][] take for the model (`(path, leaf) -> name`, `{i}` for the layer of
a stacked leaf): applied to the base weight of each adapted linear layer, its name minus
`.weight` is `<module>`. A configuration loads only if this library computes exactly what PEFT
does with it: [`parse_adapter_config`][] checks every field against the table of PEFT 0.21.2's
`LoraConfig` in `_peft_fields.py` and refuses anything else (per-module ranks, DoRA and the
other variants, an initialisation that changes the base weights, trained biases,
`modules_to_save`, `layers_to_transform`) with an error naming the field and the file, never
silently ignoring it. `target_modules` may be a list of names (PEFT's suffix rule), a regular
expression or `"all-linear"`, matched against the per-layer module names; per-layer entries
(`model.layers.0.self_attn.q_proj`) adapt only those layers (see [`LoraLinear`][]'s `layers`).
"""

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

import eqx_lean

from .._io.names import stored_layer_count
from ..quant._linear import QuantizedLinear
from ._lora import (
    LoraLinear,
    TargetError,
    adapter_shardings,
    lora_config_of,
    lora_sites,
    module_name,
    place,
    replace_modules,
    select,
    zero_unselected,
)
from ._peft_fields import FIELDS, check_fields, field_error
from ._select import LoraConfig


Names = Callable[[Any, Any], str]
_PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def to_peft(
    config: LoraConfig,
    *,
    task_type: str | None = None,
    base_model_name_or_path: str | None = None,
) -> dict[str, Any]:
    """The `adapter_config.json` dictionary of `config` for PEFT 0.21 (the fields that
    matter for a plain LoRA; PEFT fills in its defaults for the rest).

    **Arguments:**

    - `config`: the [`LoraConfig`][].
    - `task_type`: PEFT's task type (`"CAUSAL_LM"` for a HF decoder), or `None`.
    - `base_model_name_or_path`: recorded for PEFT's `from_pretrained`, or `None`.
    """
    targets = config.target_modules
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "use_rslora": config.use_rslora,
        "target_modules": targets if isinstance(targets, str) else list(targets),
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
    """Reads a decoded `adapter_config.json`, refusing what this library does not load exactly.

    Every field is checked against [`_peft_fields.FIELDS`][] (PEFT 0.21.2's `LoraConfig`): the
    fields this library implements must hold valid values, every other field its default, and
    a field PEFT 0.21.2 does not have must be null, false, 0 or empty. Whether
    `target_modules` names modules of the model is checked by [`load_adapters`][].

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

    targets = get("target_modules")
    if targets is None:
        raise field_error("target_modules", "must be set", targets, file)
    try:
        return LoraConfig(
            r=get("r"),
            lora_alpha=get("lora_alpha"),
            target_modules=targets,
            use_rslora=get("use_rslora"),
            lora_dropout=float(get("lora_dropout")),
        )
    except ValueError as error:
        raise field_error("target_modules", f"must be valid ({error})", targets, file) from error


def _tensor(module: str, matrix: str, layer: int | None = None) -> str:
    """PEFT's name of one adapter matrix (`matrix` is `lora_A` or `lora_B`)."""
    if layer is not None:
        module = module.replace("{i}", str(layer))
    return f"{_PEFT_PREFIX}{module}.{matrix}.weight"


def _by_name(path: Any, leaf: Any) -> str:
    """The name function of a `{tensor name: array}` dict."""
    del leaf
    return path[0].key


def save_adapters(
    model: PyTree,
    path: str | os.PathLike,
    names: Names,
    *,
    task_type: str | None = None,
    base_model_name_or_path: str | None = None,
) -> None:
    """Writes the adapters of `model` in PEFT's format: `adapter_config.json` and
    `adapter_model.safetensors` (PEFT's tensor names, one tensor per layer and matrix).

    One atomic directory, as for any `eqx_lean` save: after a crash `path` holds the old
    adapter or the new one, weights and config together. Other files (a README) are kept.

    **Arguments:**

    - `model`: a model with unmerged adapters sharing one [`LoraConfig`][].
    - `path`: the directory to write.
    - `names`: the model's name function (`(path, leaf) -> name`, paths relative to the whole
        model, `{i}` for a stacked leaf's layer), applied to each adapted layer's base weight
        as the model without adapters has it (`.layers.self_attn.q_proj.weight` ->
        `model.layers.{i}.self_attn.q_proj.weight`).
    - `task_type`, `base_model_name_or_path`: written to `adapter_config.json` for PEFT.

    A stacked adapter selected in some layers only (see [`LoraLinear`][]) is written for those
    layers, and refused if another layer holds a nonzero adapter (which PEFT could not load).
    """
    config = lora_config_of(model)
    tensors: dict[str, Any] = {}
    for where, layer in lora_sites(model):
        shown = jax.tree_util.keystr(where)
        if layer.merged:
            raise ValueError(
                f"`model` must hold unmerged adapters to save them; {shown} is merged "
                "(`unmerge_lora(model)` first)."
            )
        module = module_name(where, layer.base.weight, names)
        for matrix in ("lora_A", "lora_B"):
            array = getattr(layer, matrix)
            if layer.layers is None:  # `{i}` in a stacked leaf's name: one tensor per layer
                tensors[_tensor(module, matrix)] = array
                continue
            others = [i for i in range(array.shape[0]) if i not in layer.layers]
            if np.any(np.asarray(array[np.asarray(others)]) != 0):
                raise ValueError(
                    f"{shown} is adapted in layers {list(layer.layers)} only, but its "
                    f"{matrix} is nonzero in layers {others}, which PEFT's `target_modules` "
                    f"{config.target_modules!r} does not adapt."
                )
            for i in layer.layers:
                tensors[_tensor(module, matrix, i)] = array[i]
    config_json = to_peft(
        config, task_type=task_type, base_model_name_or_path=base_model_name_or_path
    )
    config_bytes = (json.dumps(config_json, indent=2) + "\n").encode()
    # One adapter file holds no more than a few hundred MiB even at 7B, rank 64.
    eqx_lean.save_tensors(
        os.fspath(path),
        tensors,
        _by_name,
        weights_name=WEIGHTS_FILE,
        files={CONFIG_FILE: config_bytes},
    )


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


def load_adapters(
    model: PyTree,
    path: str | os.PathLike,
    names: Names,
    *,
    types: tuple[type, ...] = (eqx.nn.Linear, QuantizedLinear),
) -> PyTree:
    """Loads PEFT adapters (written by PEFT's `save_pretrained` or [`save_adapters`][]) onto
    `model`, in float32, with `eqx_lean.load_tensors`.

    The config is checked first (see [`parse_adapter_config`][]): a configuration this library
    does not load exactly raises a `ValueError` naming the field, before any tensor is read.
    `target_modules` is then matched against each candidate module's per-layer names (from
    `names`), as PEFT matches it against the torch model's module names; an entry that names
    no module of `model` is refused. A stacked module matched in some layers only gets
    adapters in those layers (zero elsewhere). The load is strict: a tensor no adapter is named
    for (a DoRA magnitude, a trained bias) is refused, naming it.

    **Arguments:**

    - `model`: a model without adapters at the selected modules.
    - `path`: the adapter directory (`adapter_config.json`, `adapter_model.safetensors`).
    - `names`: the model's name function, as for [`save_adapters`][].
    - `types`: the module types that may be adapted (as for [`add_lora`][]).

    **Returns:**

    `model` with [`LoraLinear`][]s holding the loaded adapters (placed like their bases).
    """
    path = os.fspath(path)
    types = tuple(types)
    with _open_adapters(path) as checkpoint:
        raw = checkpoint.file(CONFIG_FILE)
        file = os.path.join(path, CONFIG_FILE)
        if raw is None:
            raise _missing_config(file)
        config = parse_adapter_config(raw, file)
        try:
            sites = select(model, config, types, names)
        except TargetError as error:
            targets = config.target_modules
            raise field_error("target_modules", error.requirement, targets, file) from error
        like: dict[str, jax.ShapeDtypeStruct] = {}
        for site in sites:
            weight = site.module.weight
            module = module_name(site.path, weight, names)
            *layers, out_features, in_features = weight.shape
            shapes = {"lora_A": (config.r, in_features), "lora_B": (out_features, config.r)}
            for matrix, shape in shapes.items():
                if not layers or site.layers is None:
                    like[_tensor(module, matrix)] = jax.ShapeDtypeStruct(
                        (*layers, *shape), jnp.float32
                    )
                else:
                    for i in site.layers:
                        like[_tensor(module, matrix, i)] = jax.ShapeDtypeStruct(shape, jnp.float32)
        _check_layer_count(checkpoint, sites, names)
        loaded: dict[str, Any] = eqx_lean.load_tensors(
            checkpoint, like, _by_name, dtype=jnp.float32
        )
    new = {}
    for site in sites:
        weight = site.module.weight
        module = module_name(site.path, weight, names)
        pair = []
        for matrix in ("lora_A", "lora_B"):
            if site.layers is None:
                array = loaded[_tensor(module, matrix)]
            else:  # zero in the layers PEFT does not adapt
                per_layer = {i: loaded[_tensor(module, matrix, i)] for i in site.layers}
                zero = jnp.zeros_like(next(iter(per_layer.values())))
                array = jnp.stack([per_layer.get(i, zero) for i in range(weight.shape[0])])
            pair.append(array)
        a_sharding, b_sharding, layer_axis = adapter_shardings(weight)
        a = place(zero_unselected(pair[0], site.layers), a_sharding, layer_axis)
        b = place(pair[1], b_sharding, layer_axis)
        key = jax.tree_util.keystr(site.path)
        new[key] = LoraLinear(site.module, a, b, config, site.layers)
    return replace_modules(model, new, types)


def _check_layer_count(checkpoint: eqx_lean.Checkpoint, sites: list[Any], names: Names) -> None:
    """Adapters saved for another layer count are refused naming both counts (rather than
    by the first tensor the strict load misses or does not expect)."""
    stored = eqx_lean.checkpoint_tensors(checkpoint)
    for site in sites:
        weight = site.module.weight
        if weight.ndim != 3 or site.layers is not None:
            continue
        prefix = _tensor(module_name(site.path, weight, names), "lora_A").split("{i}", 1)[0]
        held, expected = stored_layer_count(stored, prefix), weight.shape[0]
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
