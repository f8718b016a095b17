"""Loading a HF checkpoint with quantised linear layers: each weight quantised as it streams.

`load_hf(..., quantize=...)` loads the unquantised leaves (embeddings, norms, biases, the head)
with `eqx_lean.load_tensors` as always, and each chosen stacked linear weight with
`eqx_lean.quant._load.load_quantized_stack`, a few rows at a time: the process never holds a
full-precision layer stack, nor the file's pages beyond the chunk being read.
"""

import json
from collections.abc import Collection
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_lean

from .._io.checks import IGNORED_BUFFERS
from .._targets import dotted
from ..quant._linear import QuantConfig, QuantizedLinear, chosen_modules
from ..quant._load import load_quantized_stack
from ._model import Mistral


def quant_config(quantize: Any) -> QuantConfig | None:
    """`load_hf`'s `quantize=`: `None`, `"nf4"`, `"int8"` or a `QuantConfig`."""
    if quantize is None or isinstance(quantize, QuantConfig):
        return quantize
    if quantize in ("nf4", "int8"):
        return QuantConfig(quantize)
    raise ValueError(
        "`quantize` must be None, 'nf4', 'int8' or an eqx_lean.quant.QuantConfig; "
        f"got {quantize!r}."
    )


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
    path: str,
    expected: Collection[str],
) -> Mistral:
    """`like` loaded with the linears `config` chooses quantised (see the module docstring);
    with `strict`, a checkpoint tensor outside `expected` (the model's names) is an error."""
    if strict:  # before anything is allocated
        stored = eqx_lean.checkpoint_tensors(checkpoint)
        extra = sorted(n for n in stored if n not in expected and not n.endswith(IGNORED_BUFFERS))
        if extra:
            raise ValueError(
                f"The checkpoint in {path} holds tensors the model has no leaf for: {extra[:5]}"
                f"{' ...' if len(extra) > 5 else ''}. Pass `strict=False` to ignore them."
            )
    chosen = _chosen_linears(like, config)
    weight_paths = {(*p, jax.tree_util.GetAttrKey("weight")) for p in chosen}
    placeholder = jnp.zeros((0,), jnp.uint8)

    def without_chosen(leaf_path: Any, leaf: Any) -> Any:
        return placeholder if leaf_path in weight_paths else leaf

    def names(leaf_path: Any, leaf: Any) -> str | None:
        if leaf_path in weight_paths:
            return None
        return name_of(leaf_path, leaf)

    rest = jax.tree_util.tree_map_with_path(without_chosen, like)
    loaded = eqx_lean.load_tensors(checkpoint, rest, names, layers=layers, strict=False)
    count = like.config.num_hidden_layers
    stacks = {}
    for module_path, node in chosen.items():
        weight_path = (*module_path, jax.tree_util.GetAttrKey("weight"))
        _, out_features, in_features = node.weight.shape
        stacks[module_path] = load_quantized_stack(
            checkpoint,
            name_of(weight_path, node.weight),
            range(count),
            (out_features, in_features),
            node.weight.dtype,
            config,
            f"{dotted(jax.tree_util.keystr(module_path))}.weight",
        )

    def with_quantized(node_path: Any, node: Any) -> Any:
        if node_path not in stacks:
            return node
        return QuantizedLinear(stacks[node_path], node.bias, node.in_features, node.out_features)

    return jax.tree_util.tree_map_with_path(
        with_quantized, loaded, is_leaf=lambda n: isinstance(n, eqx.nn.Linear)
    )
