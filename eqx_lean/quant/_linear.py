"""`QuantizedLinear` and `quantize_linears`: the one way a model computes with quantised weights.

A [`QuantizedLinear`][] dequantises its weight for its own product only, at the moment of the
call: inside `eqx_lean.fold`/`eqx_lean.scan` that is one layer's matrix at a time, never a
dequantised stack. The weight is decoded in the dtype it was quantised from and then cast to
the input's dtype, as bitsandbytes' `Linear4bit` does (`dequantize_4bit(...).to(x.dtype)`);
the product accumulates in float32 (`eqx_lean._product.linear_product`).
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .. import _arguments as arguments
from .._product import linear_product
from .._targets import ALL_LINEAR, canonical_targets, dotted, matches, unmatched_entries
from ._array import QuantizedArray, Scheme, quantize
from ._product import decoded_for, quantized_product


M = TypeVar("M")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How [`quantize_linears`][] (and the loaders) quantise a model's linear layers.

    **Arguments:**

    - `scheme`: `"nf4"` (QLoRA's 4-bit NormalFloat, in blocks) or `"int8"` (per output
        channel).
    - `blocksize`: values per NF4 scale (64, as QLoRA).
    - `double_quant`: NF4 scales double-quantised (QLoRA's `bnb_4bit_use_double_quant`).
    - `target_modules`: which linear layers, by LoRA's (PEFT's) rule on their dotted paths
        (see [`eqx_lean.lora.LoraConfig`][]); `"all-linear"` (the default) is every linear
        layer except one named `lm_head`, as transformers' `load_in_4bit` leaves the head (and
        the embeddings and norms, which are not linear layers) unquantised.
    """

    scheme: Scheme = "nf4"
    blocksize: int = 64
    double_quant: bool = False
    target_modules: str | Sequence[str] = ALL_LINEAR

    def __post_init__(self):
        if self.scheme not in ("nf4", "int8"):
            raise ValueError(f"`scheme` must be 'nf4' or 'int8'; got {self.scheme!r}.")
        size = arguments.integer(self.blocksize, "`blocksize`", minimum=2)
        if size % 2:
            raise ValueError(f"`blocksize` must be an even integer of at least 2; got {size!r}.")
        object.__setattr__(self, "blocksize", size)
        if not isinstance(self.double_quant, bool):
            raise ValueError(f"`double_quant` must be True or False; got {self.double_quant!r}.")
        if self.double_quant and self.scheme != "nf4":
            raise ValueError("`double_quant` applies to the nf4 scheme only.")
        object.__setattr__(self, "target_modules", canonical_targets(self.target_modules))

    def quantize(self, weight: Array, *, batch_dims: int = 0, name: str = "") -> QuantizedArray:
        """`weight` quantised with these settings (see [`eqx_lean.quant.quantize`][])."""
        return quantize(
            weight,
            self.scheme,
            blocksize=self.blocksize,
            double_quant=self.double_quant,
            batch_dims=batch_dims,
            name=name,
        )


class QuantizedLinear(eqx.Module):
    """A linear layer on a quantised weight: `x W^T (+ b)`, `W` dequantised for this product.

    A drop-in for `eqx.nn.Linear` (called on a vector `[in]`) that also maps any leading axes,
    and a base for LoRA adapters (`eqx_lean.lora.add_lora` selects it by default). No
    gradient reaches the weight: its codes and scales are integer leaves.

    **Fields:**

    - `weight`: the [`eqx_lean.quant.QuantizedArray`][], `[*layers, out, in]`.
    - `bias`: `[*layers, out]` or `None`, unquantised.
    - `in_features`, `out_features`: as for `eqx.nn.Linear`.
    """

    weight: QuantizedArray
    bias: Float[Array, "*layers out"] | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)

    def weight_for(self, dtype: Any) -> Float[Array, "*layers out in"]:
        """The weight dequantised for a product in `dtype`: decoded in the dtype it was
        quantised from, then cast, as bitsandbytes' `Linear4bit` does."""
        return decoded_for(self.weight, dtype)

    def product(self, x: Float[Array, "... in"]) -> Float[Array, "... out"]:
        """`x W^T` (no bias) in `x`'s dtype: `linear_product(x, self.weight_for(x.dtype))`,
        for one layer's weight computed a slice of rows at a time on CPU (see
        `eqx_lean.quant._product`)."""
        if self.weight.batch_shape == ():
            return quantized_product(x, self.weight)
        return linear_product(x, self.weight_for(x.dtype))

    def project(
        self, x: Float[Array, "... in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... out"]:
        """Applies the layer to `x` (any leading axes); `key` is unused."""
        del key
        y = self.product(x)
        if self.bias is not None:
            y = y + self.bias.astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))
        return y

    def __call__(
        self, x: Float[Array, "... in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... out"]:
        """As `eqx.nn.Linear.__call__` (and [`QuantizedLinear.project`][])."""
        return self.project(x, key=key)


def quantized_linear(linear: Any, config: QuantConfig, name: str = "") -> QuantizedLinear:
    """`linear` (an `eqx.nn.Linear`-like module, plain or stacked) with its weight quantised."""
    weight = linear.weight
    if weight.ndim not in (2, 3):
        raise ValueError(
            f"{name or 'A linear layer'} must have a weight [out, in] or, stacked, "
            f"[layers, out, in] to be quantised; its weight has shape {weight.shape}."
        )
    quantized = config.quantize(weight, batch_dims=weight.ndim - 2, name=f"{name}.weight")
    out_features, in_features = weight.shape[-2:]
    return QuantizedLinear(quantized, linear.bias, in_features, out_features)


def quantize_linears(
    model: M, config: QuantConfig = QuantConfig(), *, types: tuple[type, ...] = (eqx.nn.Linear,)
) -> M:
    """Replaces the chosen linear layers of `model` with [`QuantizedLinear`][]s.

    Every module of one of `types` is a candidate, found anywhere in `model`; a stacked one
    (weight `[layers, out, in]`, as from `eqx_lean.build_stacked`) is quantised layer by layer.
    To quantise while building or loading, never holding the full-precision model, see
    [`eqx_lean.quant.quantizing`][] and `eqx_lean.hf.load_hf(..., quantize=...)`.

    ```python
    base = eqx_lean.quant.quantize_linears(model, eqx_lean.quant.QuantConfig("nf4"))
    lora = eqx_lean.lora.add_lora(base, lora_config, key=key)  # QLoRA
    ```

    **Arguments:**

    - `model`: any Equinox model.
    - `config`: the [`QuantConfig`][]; its `target_modules` is matched against each
        candidate's dotted path (`layers.mlp.up_proj`).
    - `types`: the module types that may be quantised; they must have `weight` (`[out, in]`)
        and `bias` fields like `eqx.nn.Linear`, and be called by the model (a model that reads
        `self.q.weight` itself gets a `TypeError` naming the weight).

    **Returns:**

    The model with [`QuantizedLinear`][]s in place of the selected modules. A `ValueError`
    names the candidates when a `target_modules` entry matches none of them.
    """
    types = tuple(types)
    chosen = chosen_modules(
        model,
        config.target_modules,
        types,
        "`target_modules`",
        f"module of `model` of types {[t.__name__ for t in types]}",
    )

    def swap(path: Any, node: Any) -> Any:
        if path not in chosen:
            return node
        return quantized_linear(node, config, dotted(jax.tree_util.keystr(path)))

    return jax.tree_util.tree_map_with_path(swap, model, is_leaf=lambda n: isinstance(n, types))


def chosen_modules(
    model: Any, targets: Any, types: tuple[type, ...], field: str, noun: str
) -> dict[tuple[Any, ...], Any]:
    """The modules of one of `types` in `model` that `targets` (canonical `target_modules`)
    selects, by key path, in tree order. An entry naming none of the candidates is a
    `ValueError` that names `field`, what the candidates are (`noun`) and the candidates."""

    def is_candidate(node: Any) -> bool:
        return isinstance(node, types)

    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_candidate)[0]
    candidates = {
        dotted(jax.tree_util.keystr(p)): (p, node) for p, node in flat if is_candidate(node)
    }
    unmatched = unmatched_entries(targets, list(candidates))
    if unmatched:
        raise ValueError(
            f"{field} entries {unmatched} name no {noun}; the candidates are {sorted(candidates)}."
        )
    return {p: node for name, (p, node) in candidates.items() if matches(targets, name)}


def quantizing(make_layer: Any, config: QuantConfig, dtype: Any) -> Any:
    """A layer factory for [`eqx_lean.build_stacked`][] that quantises each layer it makes.

    Each layer is drawn, cast to `dtype` (as `build_stacked` casts) and its linear layers
    quantised at once, so a stack is built at the size of its quantised form plus one layer
    at full precision, never a full-precision stack. The result equals quantising (with
    [`quantize_linears`][]) the stack `build_stacked(make_layer, keys, dtype)` builds.

    ```python
    config = eqx_lean.quant.QuantConfig("nf4")
    make = eqx_lean.quant.quantizing(make_block, config, jnp.bfloat16)
    blocks = eqx_lean.build_stacked(make, keys, jnp.bfloat16)
    ```

    **Arguments:**

    - `make_layer`: `key -> layer`, as for `build_stacked`.
    - `config`: the [`QuantConfig`][].
    - `dtype`: the floating dtype the layer's floating leaves are cast to before quantising.

    **Returns:**

    The factory `key -> layer with QuantizedLinears`.
    """
    return _Quantizing(make_layer, config, jnp.dtype(dtype))


@dataclasses.dataclass(frozen=True)
class _Quantizing:
    """`quantizing`'s factory; equal by value, so `build_stacked` reuses its compiled writes."""

    make_layer: Any
    config: QuantConfig
    dtype: Any

    def __call__(self, key: PRNGKeyArray) -> Any:
        def cast(x: Any) -> Any:
            return x.astype(self.dtype) if eqx.is_inexact_array(x) else x

        return quantize_linears(jax.tree.map(cast, self.make_layer(key)), self.config)


def dequantized_linear(linear: QuantizedLinear, dtype: Any = None) -> eqx.nn.Linear:
    """An `eqx.nn.Linear` holding `linear`'s dequantised weight (in `dtype`, default the dtype
    it was quantised from) and its bias."""
    return linear_with_weight(linear, linear.weight.dequantize(dtype))


def linear_with_weight(linear: QuantizedLinear, weight: Any) -> eqx.nn.Linear:
    """An `eqx.nn.Linear` of `linear`'s features and bias holding `weight` (any leaf)."""
    abstract = eqx.filter_eval_shape(
        lambda: eqx.nn.Linear(
            linear.in_features,
            linear.out_features,
            use_bias=linear.bias is not None,
            key=jax.random.key(0),
        )
    )
    out = eqx.tree_at(lambda m: m.weight, abstract, weight)
    if linear.bias is not None:
        out = eqx.tree_at(lambda m: m.bias, out, linear.bias)
    return out
