"""Every field of PEFT 0.21.2's `LoraConfig`, and what an `adapter_config.json` may hold in it.

An allow-list: [`FIELDS`][] names each field of `dataclasses.fields(peft.LoraConfig)` with its
default (written out here, not read from `peft`, so that a new PEFT cannot change what loads; a
test compares the table with the installed PEFT). A field is either *understood* (its value is
checked: this example implements it) or must hold its default; a field the table does not know
(from a newer PEFT) is accepted only when it is null, false, 0 or empty. [`check_fields`][]
raises a `ValueError` naming the field, the file and what must be true.
"""

import json
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from ._select import scale_problem


class Field(NamedTuple):
    """One `LoraConfig` field: its PEFT default and what this example accepts in it.

    **Arguments:**

    - `default`: PEFT's default, as `adapter_config.json` writes it (a dataclass default as
        the object `dataclasses.asdict` gives).
    - `requirement`: for an understood field, what its value must be (`"must be ..."`); for
        any other field, why it must hold its default.
    - `accepts`: for an understood field, whether a value is acceptable; `None` for a field
        that must hold its default.
    - `note`: more for the message, after the value found (what to do instead).
    """

    default: Any
    requirement: str
    accepts: Callable[[Any], bool] | None = None
    note: str = ""


def same(value: Any, default: Any) -> bool:
    """Whether a JSON value equals `default`, a boolean never equal to a number (`true != 1`)."""
    if isinstance(value, bool) or isinstance(default, bool):
        return isinstance(value, bool) and isinstance(default, bool) and value == default
    if isinstance(value, dict) and isinstance(default, dict):
        return value.keys() == default.keys() and all(same(value[k], default[k]) for k in value)
    if isinstance(value, list) and isinstance(default, list):
        return len(value) == len(default) and all(map(same, value, default))
    return type(value) is type(default) and value == default


def _number(value: Any) -> bool:
    """A finite number, not a bool (nor an integer beyond every float, which JSON can hold)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _optional(kind: type) -> Callable[[Any], bool]:
    return lambda value: value is None or isinstance(value, kind)


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(same(value, v) for v in values)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _targets(value: Any) -> bool:
    if isinstance(value, str):  # "all-linear", or a regular expression (checked by LoraConfig)
        return bool(value)
    return isinstance(value, list) and bool(value) and all(isinstance(t, str) for t in value)


# The initialisations that leave the base weights as they are (`False` draws B at random too).
INITS = (True, False, "gaussian", "orthogonal")

_INIT_NOTE = (
    "PiSSA, OLoRA, CorDA, LoRA-GA and LoftQ change the base weights when the adapter is made, "
    "so that such an adapter does not apply to the original base model (and this example does "
    "not implement EVA or MiCA). PEFT's `save_pretrained(..., "
    "path_initial_model_for_weight_conversion=...)` turns a PiSSA, OLoRA, CorDA or LoRA-GA "
    "adapter into a plain LoRA adapter on the original base, which loads here."
)


_INERT = "must be a JSON object or null (read only by its own `init_lora_weights`)"


def _not(feature: str) -> str:
    return f"{feature} is not implemented"


# Every field of PEFT 0.21.2's `LoraConfig`, in its order.
FIELDS: dict[str, Field] = {
    "task_type": Field(
        None,
        'must be "CAUSAL_LM" or null (a LoRA on MistralForCausalLM)',
        _one_of(None, "CAUSAL_LM"),
    ),
    "peft_type": Field(None, 'must be "LORA"', _one_of(None, "LORA")),
    "auto_mapping": Field(None, "must be a JSON object or null", _optional(dict)),
    "peft_version": Field(None, "must be a string or null", _optional(str)),
    "base_model_name_or_path": Field(None, "must be a string or null", _optional(str)),
    "revision": Field(None, "must be a string or null", _optional(str)),
    "inference_mode": Field(False, "must be true or false", _is_bool),
    "r": Field(8, "must be a positive integer", _positive_int),
    "target_modules": Field(
        None,
        'must be a non-empty list of module names, a regular expression, or "all-linear"',
        _targets,
    ),
    "exclude_modules": Field(None, _not("excluding modules")),
    "lora_alpha": Field(8, "must be a positive number", lambda v: _number(v) and v > 0),
    "lora_dropout": Field(0.0, "must be a number in [0, 1)", lambda v: _number(v) and 0 <= v < 1),
    "fan_in_fan_out": Field(False, "the weights are stored [out, in]"),
    "bias": Field("none", "trained biases are not implemented"),
    "use_rslora": Field(False, "must be true or false", _is_bool),
    "modules_to_save": Field(None, "only adapters are loaded, not fully trained modules"),
    "init_lora_weights": Field(
        True,
        'must be true, false, "gaussian" or "orthogonal" (initialisations that leave the base '
        "weights as they are)",
        _one_of(*INITS),
        _INIT_NOTE,
    ),
    "layers_to_transform": Field(None, "every layer is adapted"),
    "layers_pattern": Field(None, "every layer is adapted"),
    "rank_pattern": Field({}, "one rank for every module"),
    "alpha_pattern": Field({}, "one alpha for every module"),
    "megatron_config": Field(None, _not("Megatron's parallel layers")),
    # Read only with `megatron_config`, which must be null.
    "megatron_core": Field("megatron.core", "must be a string or null", _optional(str)),
    "trainable_token_indices": Field(None, _not("training tokens")),
    # Read only by their own `init_lora_weights` (refused above): PEFT ignores them otherwise,
    # and a PiSSA, CorDA or LoRA-GA adapter converted to a plain one keeps its settings.
    "loftq_config": Field({}, _INERT, _optional(dict)),
    "eva_config": Field(None, _INERT, _optional(dict)),
    "corda_config": Field(None, _INERT, _optional(dict)),
    "lora_ga_config": Field(None, _INERT, _optional(dict)),
    "use_dora": Field(False, _not("DoRA")),
    "velora_config": Field(None, _not("VeLoRA")),
    "alora_invocation_tokens": Field(None, _not("activated LoRA")),
    "use_qalora": Field(False, _not("QALoRA")),
    # Read only with `use_qalora`, which must be false.
    "qalora_group_size": Field(16, "must be a positive integer", _positive_int),
    "monteclora_config": Field(None, _not("MonteCLoRA")),
    "layer_replication": Field(None, _not("layer replication")),
    # Never saved by PEFT, and ignored (with a warning) when a file holds it.
    "runtime_config": Field({"ephemeral_gpu_offload": False}, "may be anything", lambda v: True),
    "lora_bias": Field(False, _not("a bias on lora_B")),
    "target_parameters": Field(None, "only linear modules are adapted"),
    "use_bdlora": Field(None, _not("BD-LoRA")),
    "arrow_config": Field(None, _not("Arrow routing")),
    "kasa_config": Field(None, _not("KaSA (which also changes the base weights)")),
    "ensure_weight_tying": Field(False, "no tied module is adapted"),
}


def shown(value: Any, limit: int = 120) -> str:
    """`value` as JSON (`null`, `true`), shortened to about `limit` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def field_error(field: str, requirement: str, value: Any, file: str, note: str = "") -> ValueError:
    """The error for `field` holding `value` in `file`: `requirement` is what must be true."""
    message = f"adapter config field `{field}` {requirement}; {file} has {shown(value)}."
    return ValueError(f"{message} {note}" if note else message)


def _is_unset(value: Any) -> bool:
    return any(same(value, empty) for empty in (None, False, 0, 0.0, "", [], {}))


def check_fields(config: Mapping[str, Any], file: str) -> None:
    """Checks every field of an `adapter_config.json` object against [`FIELDS`][].

    **Arguments:**

    - `config`: the decoded JSON object.
    - `file`: the file it was read from, for the messages.

    A missing field holds its default (as `peft.LoraConfig(**config)` reads it). Raises a
    `ValueError` naming the first unacceptable field, the file and what must be true.
    """
    if not isinstance(config, Mapping):
        raise ValueError(
            f"{file} must hold a JSON object (a PEFT adapter config); it holds {shown(config)}."
        )
    for name, field in FIELDS.items():  # in the table's order, whatever the file's
        if name not in config:
            continue
        value = config[name]
        if field.accepts is None:
            if not same(value, field.default):
                requirement = f"must be {shown(field.default)} ({field.requirement})"
                raise field_error(name, requirement, value, file)
        elif not field.accepts(value):
            raise field_error(name, field.requirement, value, file, field.note)
    for name, value in config.items():
        if name not in FIELDS and not _is_unset(value):
            raise field_error(
                name,
                "is not a field of PEFT 0.21.2's LoraConfig, so it must be null, false, 0 or "
                "empty (a setting this example does not know of cannot be loaded exactly)",
                value,
                file,
            )
    _check_scale(config, file)


def _check_scale(config: Mapping[str, Any], file: str) -> None:
    """The scale `lora_alpha`, `r` and `use_rslora` give together, each already accepted."""
    alpha, r, rslora = (
        config.get(name, FIELDS[name].default) for name in ("lora_alpha", "r", "use_rslora")
    )
    problem = scale_problem(alpha, r, rslora)
    if problem is not None:
        raise field_error("lora_alpha", problem, alpha, file)
