"""Folding LoRA adapters into the base weights, `W + scale * B A`, and back out again.

`merged_on_write` folds them as a save writes each layer instead, for bases that cannot be
updated in place (quantised ones: the merged weight is written in the dtype they were
quantised from, one layer at a time, never a dequantised stack).

[`merge_lora`][] returns a plain model (each [`LoraLinear`][] replaced by its base with the
adapter folded in), or, with `keep_adapters=True`, one whose `LoraLinear`s hold the merged
base and are marked `merged` (they then skip the adapter in their call), which
[`unmerge_lora`][] turns back by subtracting the same `scale * B A`. Every stacked weight is
updated one layer at a time by a compiled write that donates the stack, in float32, so a merge
holds at most one layer in float32 beside the model.
"""

import dataclasses
import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, PyTree

import eqx_lean

from .. import _platform
from .._core import as_bits
from .._io.save import ComputedTensor
from ..quant._array import QuantizedArray
from ..quant._linear import QuantizedLinear, linear_with_weight
from ..quant._ops import widen_exactly
from ._lora import LoraLinear, lora_sites, replace_modules


def _plus_delta(w: Array, lora_a: Array, lora_b: Array, scale: Array, dtype: Any) -> Array:
    """`w + scale * B A` from a float32 `w`, in float32, rounded once to `dtype`: the one
    arithmetic of every merge (and, with a negative scale, unmerge)."""
    f32 = jnp.float32
    delta = jnp.matmul(lora_b.astype(f32), lora_a.astype(f32), precision=lax.Precision.HIGHEST)
    return (w + delta * scale).astype(dtype)


def _bit_reads(weight: Array) -> bool:
    """Whether a stacked weight's layers are read as bits (see `_merged_layer`)."""
    return _platform.Tricks.for_platform(_platform.platform_of([weight.sharding])).bit_writes


@functools.partial(jax.jit, static_argnames="bit_reads")
def _merged_layer(
    weight: Float[Array, "layers out in"],
    lora_a: Float[Array, "layers r in"],
    lora_b: Float[Array, "layers out r"],
    scale: Float[Array, ""],
    index: Array,
    bit_reads: bool,
) -> Float[Array, "out in"]:
    """Layer `index` of `weight + scale * B A`, computed in float32, in `weight`'s dtype."""
    if bit_reads:
        # Read as unsigned bits of the same width: XLA:CPU slices bfloat16 through float32,
        # which would convert the whole stack first.
        w_bits = lax.dynamic_index_in_dim(as_bits(weight), index, keepdims=False)
        w = lax.bitcast_convert_type(w_bits, weight.dtype).astype(jnp.float32)
    else:
        w = lax.dynamic_index_in_dim(weight, index, keepdims=False).astype(jnp.float32)
    a = lax.dynamic_index_in_dim(lora_a, index, keepdims=False)
    b = lax.dynamic_index_in_dim(lora_b, index, keepdims=False)
    return _plus_delta(w, a, b, scale, weight.dtype)


@functools.partial(jax.jit, donate_argnums=0)
def _merged_plain(
    weight: Float[Array, "out in"],
    lora_a: Float[Array, "r in"],
    lora_b: Float[Array, "out r"],
    scale: Float[Array, ""],
) -> Float[Array, "out in"]:
    """`weight + scale * B A` for a plain (unstacked) weight, in float32, in `weight`'s dtype."""
    return _plus_delta(weight.astype(jnp.float32), lora_a, lora_b, scale, weight.dtype)


def _folded(layer: LoraLinear, sign: float, donate: bool) -> Array:
    """`layer.base.weight + sign * scale * B A`, per layer for a stacked weight."""
    assert isinstance(layer.base, eqx.nn.Linear)  # `merge_lora` refuses quantised bases
    weight = layer.base.weight if donate else jnp.copy(layer.base.weight)
    # The same float32 `scale * B A` is added by a merge and subtracted by an unmerge.
    scale = jnp.asarray(sign * layer.config.scale, jnp.float32)
    if weight.ndim == 2:
        return _merged_plain(weight, layer.lora_A, layer.lora_B, scale)
    bit_reads = _bit_reads(weight)
    for i in range(weight.shape[0]):
        merged_layer = _merged_layer(
            weight, layer.lora_A, layer.lora_B, scale, jnp.int32(i), bit_reads=bit_reads
        )
        weight = eqx_lean.write_layer(weight, merged_layer, i)
    return weight


def _with_weight(linear: Any, weight: Any) -> Any:
    return eqx.tree_at(lambda m: m.weight, linear, weight)


def merge_lora(model: PyTree, *, donate: bool = False, keep_adapters: bool = False) -> PyTree:
    """Folds every adapter into its base weight, `W + scale * B A`, one layer at a time.

    Each stacked base weight is updated by a compiled per-layer write that donates the stack
    and converts one layer at a time to float32, so a merge holds at most one layer in float32
    beside the model. The merged model computes the same function without the adapter's
    extra products (up to rounding of the merged weight to its dtype).

    **Arguments:**

    - `model`: a model with adapters ([`add_lora`][] or [`load_adapters`][]).
    - `donate`: update the base weights in place, never holding a second copy of a stacked
        weight. The base weights of `model` are then consumed: neither `model` nor any model
        sharing its base weights (such as the one given to [`add_lora`][]) may be used
        afterwards. With `False` (the default) each weight is copied once first, one module at
        a time.
    - `keep_adapters`: keep each [`LoraLinear`][] (with its merged base, marked `merged`, so
        its call no longer adds the adapter), so that [`unmerge_lora`][] can restore the base.

    **Returns:**

    A plain model (each `LoraLinear` replaced by its merged base linear layer), or with
    `keep_adapters=True` the model with merged `LoraLinear`s. An adapter already merged (with
    `keep_adapters=True` before) is not added again.
    """
    new = {}
    for path, layer in lora_sites(model):
        if isinstance(layer.base, QuantizedLinear):
            raise ValueError(
                f"`model` must have unquantised bases to merge into; "
                f"{jax.tree_util.keystr(path)} is a QuantizedLinear (its merged weight would "
                "not be quantised the same). Merge them as a save writes each layer with "
                "`save_hf(model, path, merge_adapters=True)`, or save the adapters alone with "
                "`save_adapters`."
            )
        if layer.merged:
            new_layer = layer if keep_adapters else layer.base
        else:
            base = _with_weight(layer.base, _folded(layer, 1.0, donate))
            new_layer = (
                dataclasses.replace(layer, base=base, merged=True) if keep_adapters else base
            )
        new[jax.tree_util.keystr(path)] = new_layer
    if not new:
        raise ValueError("`model` must have LoRA adapters to merge (see `add_lora`); it has none.")
    return replace_modules(model, new, ())


def unmerge_lora(model: PyTree, *, donate: bool = False) -> PyTree:
    """Subtracts each merged adapter from its base weight again: the inverse of
    `merge_lora(model, keep_adapters=True)`.

    The same float32 `scale * B A` is subtracted as was added, so for a float32 (or float64)
    base the original weights come back within that dtype's rounding. A 16-bit base is refused:
    rounding the merged weight to bfloat16 lost bits of the base that no subtraction restores.

    **Arguments:**

    - `model`: a model from `merge_lora(..., keep_adapters=True)`.
    - `donate`: update the base weights in place (as for [`merge_lora`][]).

    **Returns:**

    The model with unmerged [`LoraLinear`][]s, which add their adapters in their call again.
    """
    new = {}
    for path, layer in lora_sites(model):
        if not layer.merged:
            continue
        dtype = jnp.dtype(layer.base.weight.dtype)
        if jnp.finfo(dtype).bits < 32:
            raise ValueError(
                f"`unmerge_lora` must be given a float32 or float64 base; "
                f"{jax.tree_util.keystr(path)} is {dtype.name}, whose merge rounded the base "
                "weights, so subtracting the adapter would not restore them. Keep the base model "
                "(or a float32 copy) to go back to it."
            )
        base = _with_weight(layer.base, _folded(layer, -1.0, donate))
        new[jax.tree_util.keystr(path)] = dataclasses.replace(layer, base=base, merged=False)
    if not new:
        raise ValueError(
            "`model` must hold merged adapters (from `merge_lora(model, keep_adapters=True)`) "
            "to unmerge; it has none."
        )
    return replace_modules(model, new, ())


@functools.partial(jax.jit, static_argnames=("with_adapter", "dtype"))
def _dequantized_layer(
    weight: QuantizedArray,
    lora_a: Array | None,
    lora_b: Array | None,
    scale: Array | None,
    index: Array | None,
    with_adapter: bool,
    dtype: Any,
) -> Array:
    """Layer `index` (`None`: all of an unstacked weight) of `weight` dequantised to `dtype`,
    plus `scale * B A` in float32 (rounded to `dtype` once) when `with_adapter`."""

    def pick(x: Array) -> Array:
        return x if index is None else lax.dynamic_index_in_dim(x, index, keepdims=False)

    w = jax.tree.map(pick, weight).dequantize(dtype)
    if not with_adapter:
        return w
    assert lora_a is not None and lora_b is not None and scale is not None
    # From the bits: the merge adds to the dequantised weight as stored in `dtype` (as
    # `merge_lora` of the dequantised model does), and XLA would otherwise skip its rounding.
    return _plus_delta(widen_exactly(w), pick(lora_a), pick(lora_b), scale, dtype)


def _computed_weight(weight: Any, adapter: LoraLinear | None) -> ComputedTensor:
    """The (merged) weight of one module, in its dtype (a quantised one's: the dtype it was
    quantised from), computed one layer at a time as a save writes it."""
    shape, dtype = tuple(weight.shape), weight.dtype
    stacked = len(shape) == 3
    lora_a = lora_b = scale = None
    if adapter is not None:
        lora_a, lora_b = adapter.lora_A, adapter.lora_B
        scale = jnp.asarray(adapter.config.scale, jnp.float32)

    def read(layer: int | None) -> Any:
        index = None if layer is None or not stacked else jnp.int32(layer)
        if isinstance(weight, QuantizedArray):
            value = _dequantized_layer(
                weight, lora_a, lora_b, scale, index, with_adapter=adapter is not None, dtype=dtype
            )
        elif index is None:
            value = _merged_plain(jnp.copy(weight), lora_a, lora_b, scale)
        else:
            value = _merged_layer(
                weight, lora_a, lora_b, scale, index, bit_reads=_bit_reads(weight)
            )
        return np.asarray(value)

    return ComputedTensor(shape, dtype, read)


def merged_on_write(model: PyTree, *, merge_adapters: bool) -> PyTree:
    """`model` as plain linear layers for a save, their weights computed as it writes them.

    Every [`eqx_lean.quant.QuantizedLinear`][] becomes an `eqx.nn.Linear` whose weight is
    dequantised to the dtype it was quantised from, one layer at a time. With
    `merge_adapters`, every [`LoraLinear`][] becomes its base with `W + scale * B A` (in
    float32, rounded once to the weight's dtype, as [`merge_lora`][] computes it), also one
    layer at a time; `model` itself is not changed. Without it, adapters are left as they are.
    """
    new = {}
    sites = lora_sites(model) if merge_adapters else []
    for path, layer in sites:
        base = layer.base
        if layer.merged:
            new[jax.tree_util.keystr(path)] = base
            continue
        weight = _computed_weight(base.weight, layer)
        if isinstance(base, QuantizedLinear):
            new[jax.tree_util.keystr(path)] = linear_with_weight(base, weight)
        else:
            new[jax.tree_util.keystr(path)] = _with_weight(base, weight)
    model = replace_modules(model, new, ())

    def plain(node: Any) -> Any:
        if isinstance(node, QuantizedLinear):
            return linear_with_weight(node, _computed_weight(node.weight, None))
        return node

    return jax.tree.map(plain, model, is_leaf=lambda x: isinstance(x, QuantizedLinear | LoraLinear))
