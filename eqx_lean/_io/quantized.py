"""Loading with `quantize=`: the chosen linear weights quantised as they stream from the file.

A chosen weight is a leaf like any other until the buffers are filled: its tensor name, shape,
dtype, layers and sharding are resolved and checked with the rest (so `strict`, `layers` and
`sharding=` mean what they mean for every leaf). It is then read by
`eqx_lean.quant._load.load_quantized_stack`, a few rows at a time, instead of the chunked
writes, and its module becomes a `QuantizedLinear`.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax

from .._core import KeyPath
from .._targets import dotted
from ..quant._array import QuantizedArray
from ..quant._linear import QuantConfig, QuantizedLinear, chosen_modules
from ..quant._load import load_quantized_stack
from ..quant._sharding import place_scales, quantized_shardings
from .checks import Leaf
from .snapshot import Checkpoint


_WEIGHT = jax.tree_util.GetAttrKey("weight")


def quant_config(quantize: Any) -> QuantConfig | None:
    """`quantize=` of the loaders: `None`, `"nf4"`, `"int8"` or a `QuantConfig`."""
    if quantize is None or isinstance(quantize, QuantConfig):
        return quantize
    if isinstance(quantize, str) and quantize in ("nf4", "int8"):
        return QuantConfig(quantize)
    raise ValueError(
        "`quantize` must be None, 'nf4', 'int8' or an eqx_lean.quant.QuantConfig; "
        f"got {quantize!r}."
    )


def quantized_modules(like: Any, config: QuantConfig | None) -> dict[KeyPath, str]:
    """The linear layers of `like` that `config` quantises: key path to dotted name."""
    if config is None:
        return {}
    chosen = chosen_modules(
        like,
        config.target_modules,
        (eqx.nn.Linear,),
        "`quantize.target_modules`",
        "linear layer (eqx.nn.Linear) of `like`",
    )
    return {path: dotted(jax.tree_util.keystr(path)) for path in chosen}


def weight_path(module_path: KeyPath) -> KeyPath:
    return (*module_path, _WEIGHT)


def check_quantized_leaf(leaf: Leaf, module: str) -> None:
    """A chosen weight must be named, stored untransposed, and be one matrix per tensor."""
    where = f"`quantize` chooses the linear layer `{module}`"
    if leaf.name is None:
        raise ValueError(
            f"{where}, so `names` must give its weight a tensor to quantise from; it gives None."
        )
    if leaf.name.transpose is not None:
        raise ValueError(
            f"{where}, whose tensor {leaf.name.name!r} is named with transpose "
            f"{leaf.name.transpose}: a weight is quantised row by row as stored, so it must be "
            "stored as [out, in]. Leave it out of `quantize.target_modules`."
        )
    if len(leaf.struct.shape) != 2 + leaf.name.stacked:
        raise ValueError(
            f"{where}, whose weight has shape {leaf.struct.shape}: it must be [out, in] (or "
            "[layers, out, in] named with {i}) to be quantised."
        )


def load_quantized_leaf(
    checkpoint: Checkpoint,
    leaf: Leaf,
    selected: Sequence[int] | None,
    config: QuantConfig,
    module: str,
) -> QuantizedArray:
    """`leaf`'s tensors (one per selected layer, or its one tensor), quantised as they stream,
    its codes and scales placed as `leaf.sharding` places the weight."""
    assert leaf.name is not None
    stacked = leaf.name.stacked
    layers: Sequence[int | None] = (selected or ()) if stacked else [None]
    shape = leaf.struct.shape[1:] if stacked else leaf.struct.shape
    blocksize = config.blocksize if config.scheme == "nf4" else 0
    name = f"{module}.weight"
    shardings = quantized_shardings(
        leaf.sharding, leaf.struct.shape, int(stacked), config.scheme, blocksize, name
    )
    if stacked:
        return load_quantized_stack(
            checkpoint,
            [leaf.name.at(layer) for layer in layers],
            shape,
            leaf.struct.dtype,
            config,
            name,
            shardings,
        )
    one = load_quantized_stack(
        checkpoint, [leaf.name.at(None)], shape, leaf.struct.dtype, config, name
    )
    placed = jax.tree.map(lambda x: x[0], one)
    codes = jax.device_put(placed.codes, shardings.codes)
    scale_bits = place_scales(placed.scale_bits, shardings)
    return eqx.tree_at(lambda q: (q.codes, q.scale_bits), placed, (codes, scale_bits))


def with_quantized_linears(
    model: Any, modules: dict[KeyPath, str], weights: dict[KeyPath, QuantizedArray]
) -> Any:
    """`model` with each `eqx.nn.Linear` at `modules` made a `QuantizedLinear` of its weight
    in `weights` (by the weight's path) and its own bias."""

    def swap(path: KeyPath, node: Any) -> Any:
        if path not in modules:
            return node
        weight = weights[weight_path(path)]
        return QuantizedLinear(weight, node.bias, node.in_features, node.out_features)

    return jax.tree_util.tree_map_with_path(
        swap, model, is_leaf=lambda n: isinstance(n, eqx.nn.Linear)
    )
