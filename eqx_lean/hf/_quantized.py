"""Loading a HF checkpoint with quantised linear layers: each weight quantised as it streams.

`load_hf(..., quantize=...)` is `eqx_lean.load_tensors(..., quantize=...)` on the decoder's
stacked linears (the head and embeddings stay unquantised, as transformers' `load_in_4bit`
leaves them): each weight is read a few rows at a time, so the process never holds a
full-precision layer stack, nor the file's pages beyond the chunk being read. A checkpoint
saved quantised by transformers is refused here.
"""

import json
from collections.abc import Collection, Mapping
from typing import Any

import equinox as eqx
import jax

import eqx_lean

from .._targets import dotted
from ..quant._linear import QuantConfig, chosen_modules
from ._model import Decoder


def refuse_prequantized(raw_config: bytes, config_file: str) -> None:
    """A checkpoint saved quantised by transformers (bitsandbytes' `*-bnb-4bit`) is refused,
    naming `quantization_config`: its tensors are codes, not weights."""
    try:
        settings = json.loads(raw_config)
    except ValueError:
        return  # `DecoderConfig.from_json_bytes` reports a bad file
    if isinstance(settings, dict) and "quantization_config" in settings:
        method = settings["quantization_config"]
        method = method.get("quant_method") if isinstance(method, dict) else method
        raise ValueError(
            f"{config_file} has a `quantization_config` ({method!r}): the checkpoint holds "
            "quantised tensors, which eqx_lean does not load. Load the full-precision "
            "checkpoint with `quantize='nf4'` instead: each weight is quantised as it streams."
        )


# What bitsandbytes saves for a quantised `Linear`, by the end of the tensor's name: beside a
# 4-bit weight (`Params4bit`, its packed codes a uint8 column), its quant state; beside an
# 8-bit one (`Int8Params`, int8), the module's row scales and layout.
_BNB_4BIT = (
    ".absmax",
    ".quant_map",
    ".nested_absmax",
    ".nested_quant_map",
    ".quant_state.bitsandbytes__nf4",
    ".quant_state.bitsandbytes__fp4",
)
_BNB_8BIT = (".SCB", ".weight_format")
_PACKED = ("uint8", "int8")


def bitsandbytes_tensors(
    dtypes: Mapping[str, str], weights: Collection[str], limit: int = 3
) -> tuple[list[str], int]:
    """The tensors bitsandbytes' quantisation made, among `dtypes` (each tensor's name to its
    dtype's name): the quant state saved beside a quantised weight of `weights` (the tensor
    names the model reads), else those weights stored as uint8 or int8 (packed codes whose
    quant state was dropped too). Returns the first `limit` names, and how many there are.

    Without `quantization_config` (removed, or lost in a copy), such a checkpoint reaches the
    shape or dtype checks, whose messages would not say what the file is.
    """
    found = [
        name
        for name in dtypes
        if any(name.endswith(end) and name[: -len(end)] in weights for end in _BNB_4BIT)
        or any(name.endswith(end) and f"{name[: -len(end)]}.weight" in weights for end in _BNB_8BIT)
    ]
    if not found:
        found = [name for name, dtype in dtypes.items() if dtype in _PACKED and name in weights]
    return found[:limit], len(found)


def refuse_bitsandbytes(
    dtypes: Mapping[str, str], weights: Collection[str], holder: str, config_file: str | None
) -> None:
    """Refuses bitsandbytes-quantised tensors (see `bitsandbytes_tensors`).

    **Arguments:**

    - `dtypes`, `weights`: as for `bitsandbytes_tensors`.
    - `holder`: what holds them, the message's subject ("the weights in /path hold").
    - `config_file`: the checkpoint's `config.json` (which has no `quantization_config`, else
        `refuse_prequantized` refused it first); `None` for a state dict.
    """
    shown, count = bitsandbytes_tensors(dtypes, weights)
    if not count:
        return
    listed = ", ".join(repr(name) for name in shown)
    listed += f", ... ({count} in all)" if count > len(shown) else ""
    found = f"{holder} bitsandbytes-quantised tensors ({listed})"
    if config_file is None:
        raise ValueError(
            f"{found}: bitsandbytes' codes and scales, not weights. Pass the state dict of a "
            "full-precision model (transformers' `model.dequantize()` turns a bitsandbytes "
            "model back into one)."
        )
    raise ValueError(
        f"{found}, but {config_file} has no `quantization_config` (was it removed?): these "
        "are bitsandbytes' codes and scales, not weights, and eqx_lean does not load a "
        "quantised checkpoint. Load the full-precision checkpoint with `quantize='nf4'` "
        "instead: each weight is quantised as it streams."
    )


def _chosen_linears(like: Decoder, config: QuantConfig) -> dict[tuple[Any, ...], Any]:
    """The stacked decoder linears (key path to abstract module) that `config` quantises."""
    chosen = chosen_modules(
        like,
        config.target_modules,
        (eqx.nn.Linear,),
        "`quantize.target_modules`",
        "linear layer of the model",
    )
    for path, node in chosen.items():
        if node.weight.ndim != 3:
            raise ValueError(
                f"`quantize.target_modules` selects {dotted(jax.tree_util.keystr(path))}, which "
                "is not a stacked decoder layer; loading quantises the decoder layers only (the "
                "head and embeddings stay unquantised)."
            )
    return chosen


def load_quantized(
    checkpoint: eqx_lean.Checkpoint,
    like: Decoder,
    name_of: Any,
    config: QuantConfig,
    strict: bool,
    layers: int | None,
    sharding: Any,
    file_backed: bool = False,
) -> Decoder:
    """`like` loaded with the decoder linears `config` chooses quantised as they stream (see
    the module docstring). (`file_backed=True` is refused by `load_tensors`, naming both.)"""
    _chosen_linears(like, config)  # the head and embeddings stay unquantised
    return eqx_lean.load_tensors(
        checkpoint,
        like,
        name_of,
        sharding=sharding,
        layers=layers,
        strict=strict,
        quantize=config,
        file_backed=file_backed,
    )
