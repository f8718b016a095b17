"""Loading a HF checkpoint with quantised linear layers: each weight quantised as it streams.

`load_hf(..., quantize=...)` is `eqx_lean.load_tensors(..., quantize=...)` on the decoder's
stacked linears (the head and embeddings stay unquantised, as transformers' `load_in_4bit`
leaves them): each weight is read a few rows at a time, so the process never holds a
full-precision layer stack, nor the file's pages beyond the chunk being read. A checkpoint
saved quantised by transformers is refused here.
"""

import json
from typing import Any

import equinox as eqx
import jax

import eqx_lean

from .._targets import dotted
from ..quant._linear import QuantConfig, chosen_modules
from ._model import Mistral


def refuse_prequantized(raw_config: bytes, config_file: str) -> None:
    """A checkpoint saved quantised by transformers (bitsandbytes' `*-bnb-4bit`) is refused,
    naming `quantization_config`: its tensors are codes, not weights."""
    try:
        settings = json.loads(raw_config)
    except ValueError:
        return  # `MistralConfig.from_json_bytes` reports a bad file
    if isinstance(settings, dict) and "quantization_config" in settings:
        method = settings["quantization_config"]
        method = method.get("quant_method") if isinstance(method, dict) else method
        raise ValueError(
            f"{config_file} has a `quantization_config` ({method!r}): the checkpoint holds "
            "quantised tensors, which eqx_lean does not load. Load the full-precision "
            "checkpoint with `quantize='nf4'` instead: each weight is quantised as it streams."
        )


def _chosen_linears(like: Mistral, config: QuantConfig) -> dict[tuple[Any, ...], Any]:
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
    like: Mistral,
    name_of: Any,
    config: QuantConfig,
    strict: bool,
    layers: int | None,
    sharding: Any,
    file_backed: bool = False,
) -> Mistral:
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
