"""Folding LoRA adapters into the base weights, `W + scale * B A`, and back out again.

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
from jax import lax
from jaxtyping import Array, Float, PyTree

import eqx_lean

from .. import _platform
from .._core import as_bits
from ..quant._linear import QuantizedLinear
from ._lora import LoraLinear, lora_sites, replace_modules


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
    a = lax.dynamic_index_in_dim(lora_a, index, keepdims=False).astype(jnp.float32)
    b = lax.dynamic_index_in_dim(lora_b, index, keepdims=False).astype(jnp.float32)
    delta = jnp.matmul(b, a, precision=lax.Precision.HIGHEST) * scale
    return (w + delta).astype(weight.dtype)


@functools.partial(jax.jit, donate_argnums=0)
def _merged_plain(
    weight: Float[Array, "out in"],
    lora_a: Float[Array, "r in"],
    lora_b: Float[Array, "out r"],
    scale: Float[Array, ""],
) -> Float[Array, "out in"]:
    """`weight + scale * B A` for a plain (unstacked) weight, in float32, in `weight`'s dtype."""
    f32 = jnp.float32
    delta = jnp.matmul(lora_b.astype(f32), lora_a.astype(f32), precision=lax.Precision.HIGHEST)
    return (weight.astype(f32) + delta * scale).astype(weight.dtype)


def _folded(layer: LoraLinear, sign: float, donate: bool) -> Array:
    """`layer.base.weight + sign * scale * B A`, per layer for a stacked weight."""
    assert isinstance(layer.base, eqx.nn.Linear)  # `merge_lora` refuses quantised bases
    weight = layer.base.weight if donate else jnp.copy(layer.base.weight)
    # The same float32 `scale * B A` is added by a merge and subtracted by an unmerge.
    scale = jnp.asarray(sign * layer.config.scale, jnp.float32)
    if weight.ndim == 2:
        return _merged_plain(weight, layer.lora_A, layer.lora_B, scale)
    platform = _platform.platform_of([weight.sharding])
    bit_reads = _platform.Tricks.for_platform(platform).bit_writes
    for i in range(weight.shape[0]):
        merged_layer = _merged_layer(
            weight, layer.lora_A, layer.lora_B, scale, jnp.int32(i), bit_reads=bit_reads
        )
        weight = eqx_lean.write_layer(weight, merged_layer, i)
    return weight


def _with_weight(linear: Any, weight: Array) -> Any:
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
                "not be quantised the same). Save the adapters with `save_adapters` instead."
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
