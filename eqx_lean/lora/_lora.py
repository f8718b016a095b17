"""LoRA adapters for the Mistral example, stacked on the layer axis.

A LoRA-adapted projection computes `y = x W^T + scale * (dropout(x) A^T) B^T`, with `A` of
shape `[r, in]` and `B` of shape `[out, r]`, inside the layer call: the merged weight is never
formed during training. [`add_lora`][] wraps the chosen projections of the stacked blocks in
[`LoraLinear`][]s whose adapters are built with [`eqx_lean.build_stacked`][] (`A` drawn as PEFT
draws it, kaiming-uniform with `a=sqrt(5)`, `B` zero), so the model runs through
`eqx_lean.scan` unchanged. [`lora_filter`][] selects the adapters for `eqx.partition`: the base
stays frozen and only the adapters get gradients and optimizer state. [`merge_lora`][] folds
the adapters into the base weights one layer at a time. `peft_format.py` saves and loads the
adapters in Hugging Face PEFT's format.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

import eqx_lean

from .. import _platform
from .._core import as_bits
from .._product import linear_product
from ..hf._model import DecoderBlock, Mistral


# PEFT's module name -> (its path inside a layer, the projection in a `DecoderBlock`).
TARGETS: dict[str, tuple[str, Callable[[DecoderBlock], Any]]] = {
    "q_proj": ("self_attn.q_proj", lambda b: b.self_attn.q_proj),
    "k_proj": ("self_attn.k_proj", lambda b: b.self_attn.k_proj),
    "v_proj": ("self_attn.v_proj", lambda b: b.self_attn.v_proj),
    "o_proj": ("self_attn.o_proj", lambda b: b.self_attn.o_proj),
    "gate_proj": ("mlp.gate_proj", lambda b: b.mlp.gate_proj),
    "up_proj": ("mlp.up_proj", lambda b: b.mlp.up_proj),
    "down_proj": ("mlp.down_proj", lambda b: b.mlp.down_proj),
}


def target_name(name: str) -> str:
    """PEFT's module name for a target given as `q`, `q_proj` or `self_attn.q_proj` (etc.)."""
    for module, (path, _) in TARGETS.items():
        if name in (module, module.removesuffix("_proj"), path):
            return module
    raise ValueError(
        f"a LoRA target must be one of {list(TARGETS)} (or the short forms "
        f"{[m.removesuffix('_proj') for m in TARGETS]}); got {name!r}."
    )


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """The LoRA settings this example implements, with PEFT's field names.

    **Arguments:**

    - `r`: the rank of every adapter.
    - `lora_alpha`: the scale numerator: adapters are scaled by `lora_alpha / r`, or by
        `lora_alpha / sqrt(r)` with `use_rslora`.
    - `target_modules`: the adapted projections, a subset of [`TARGETS`][] (any order; short
        names such as `"q"` are accepted).
    - `use_rslora`: rank-stabilised scaling (`alpha / sqrt(r)`).
    - `lora_dropout`: dropout on the adapter's input, applied when the model is called with a
        `key` (training), not without one (inference).
    """

    r: int = 8
    lora_alpha: float = 8
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    use_rslora: bool = False
    lora_dropout: float = 0.0

    def __post_init__(self):
        if not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"`r` must be a positive integer; got {self.r!r}.")
        if not isinstance(self.lora_alpha, int | float) or self.lora_alpha <= 0:
            raise ValueError(f"`lora_alpha` must be a positive number; got {self.lora_alpha!r}.")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"`lora_dropout` must be in [0, 1); got {self.lora_dropout!r}.")
        if isinstance(self.target_modules, str) or not self.target_modules:
            raise ValueError(
                "`target_modules` must be a non-empty list of projection names such as "
                f"['q_proj', 'v_proj']; got {self.target_modules!r}."
            )
        chosen = {target_name(t) for t in self.target_modules}
        # A canonical order (the model's), so that equal settings compare equal.
        object.__setattr__(self, "target_modules", tuple(t for t in TARGETS if t in chosen))

    @property
    def scale(self) -> float:
        """The factor on `B A`: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


class LoraLinear(eqx.Module):
    """A bias-free linear layer with a LoRA adapter: `x W^T + scale * (dropout(x) A^T) B^T`.

    The adapter reads `x` cast to its own dtype (float32 adapters on a bfloat16 base, as PEFT
    keeps them), and the sum is rounded once to the base output's dtype, as PEFT does.
    """

    base: eqx.nn.Linear
    lora_A: Float[Array, "r in"]
    lora_B: Float[Array, "out r"]
    config: LoraConfig = eqx.field(static=True)

    def project(
        self, x: Float[Array, "... in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... out"]:
        """Applies the layer to `x` (any leading axes); dropout only when `key` is given."""
        y = linear_product(x, self.base.weight)
        h = x.astype(self.lora_A.dtype)
        rate = self.config.lora_dropout
        if key is not None and rate > 0:
            keep = jax.random.bernoulli(key, 1.0 - rate, h.shape)
            h = jnp.where(keep, h / (1.0 - rate), jnp.zeros_like(h))
        delta = linear_product(linear_product(h, self.lora_A), self.lora_B) * self.config.scale
        with jax.numpy_dtype_promotion("standard"):  # bfloat16 + float32 sum in float32
            total = jnp.promote_types(y.dtype, delta.dtype)
        return (y.astype(total) + delta.astype(total)).astype(y.dtype)


class LoraPair(eqx.Module):
    """One projection's adapter matrices (stacked on a leading layer axis when built)."""

    lora_A: Float[Array, "r in"]
    lora_B: Float[Array, "out r"]


@dataclasses.dataclass(frozen=True)
class _AdapterFactory:
    """Draws one layer's adapters; equal by value, so `build_stacked` reuses its compiled writes.

    `A` is kaiming-uniform with `a=sqrt(5)` (PEFT's default, torch's `nn.Linear` init): uniform
    on `[-1/sqrt(in), 1/sqrt(in)]`; `B` is zero, so a fresh adapter leaves the model unchanged.
    """

    shapes: tuple[tuple[str, int, int], ...]  # (target, out, in)
    r: int

    def __call__(self, key: PRNGKeyArray) -> dict[str, LoraPair]:
        pairs = {}
        for (target, out_features, in_features), k in zip(
            self.shapes, jax.random.split(key, len(self.shapes)), strict=True
        ):
            bound = 1.0 / math.sqrt(in_features)
            a = jax.random.uniform(k, (self.r, in_features), jnp.float32, -bound, bound)
            pairs[target] = LoraPair(a, jnp.zeros((out_features, self.r), jnp.float32))
        return pairs


def _base_linear(model: Mistral, target: str) -> eqx.nn.Linear:
    linear = TARGETS[target][1](model.layers)
    if not isinstance(linear, eqx.nn.Linear):
        raise ValueError(
            f"`model` must have plain projections; its `{target}` already has a LoRA adapter "
            "(merge it with `merge_lora` first)."
        )
    return linear


def init_adapters(
    model: Mistral, config: LoraConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32
) -> dict[str, LoraPair]:
    """Fresh stacked adapters for `model`, built one layer at a time with `build_stacked`.

    **Returns:**

    A dict from PEFT module name to a [`LoraPair`][] whose leaves have a leading layer axis.
    """
    shapes = []
    for target in config.target_modules:
        _, out_features, in_features = _base_linear(model, target).weight.shape
        shapes.append((target, out_features, in_features))
    factory = _AdapterFactory(tuple(shapes), config.r)
    keys = jax.random.split(key, model.config.num_hidden_layers)
    return eqx_lean.build_stacked(factory, keys, dtype)


def apply_adapters(model: Mistral, adapters: Mapping[str, LoraPair], config: LoraConfig) -> Mistral:
    """`model` with each projection in `adapters` wrapped in a [`LoraLinear`][] (no copies)."""
    for target, pair in adapters.items():
        where = TARGETS[target][1]
        layer = LoraLinear(_base_linear(model, target), pair.lora_A, pair.lora_B, config)
        model = eqx.tree_at(lambda m, where=where: where(m.layers), model, layer)
    return model


def add_lora(
    model: Mistral, config: LoraConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32
) -> Mistral:
    """Adds fresh LoRA adapters (PEFT's init) to the projections named in `config`.

    **Arguments:**

    - `model`: a [`Mistral`][] without adapters.
    - `config`: the [`LoraConfig`][].
    - `key`: the random key for the `A` matrices.
    - `dtype`: the adapters' dtype; float32 (master weights that small updates do not round
        away, as PEFT keeps them) whatever the base's dtype.

    **Returns:**

    The model with [`LoraLinear`][] projections; its logits equal the base model's, as `B = 0`.
    """
    return apply_adapters(model, init_adapters(model, config, key=key, dtype=dtype), config)


def _lora_layers(model: Mistral) -> dict[str, LoraLinear]:
    found = {}
    for target, (_, where) in TARGETS.items():
        layer = where(model.layers)
        if isinstance(layer, LoraLinear):
            found[target] = layer
    return found


def lora_config_of(model: Mistral) -> LoraConfig:
    """The [`LoraConfig`][] of a model with adapters."""
    layers = _lora_layers(model)
    if not layers:
        raise ValueError("`model` must have LoRA adapters (see `add_lora`); it has none.")
    return next(iter(layers.values())).config


def lora_filter(model: Mistral) -> PyTree[bool]:
    """The filter spec selecting the adapters: `eqx.partition(model, lora_filter(model))` gives
    `(adapters, frozen base)`, so gradients and optimizer state cover the adapters only."""
    spec = jax.tree.map(lambda _: False, model)
    for where in (TARGETS[t][1] for t in _lora_layers(model)):
        spec = eqx.tree_at(
            lambda m, where=where: (where(m.layers).lora_A, where(m.layers).lora_B),
            spec,
            (True, True),
        )
    return spec


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


def merge_lora(model: Mistral, *, donate: bool = False) -> Mistral:
    """Folds every adapter into its base weight, `W + scale * B A`, one layer at a time.

    Each stacked base weight is updated by a compiled per-layer write that donates the stack
    and converts one layer at a time to float32, so a merge holds at most one layer in float32
    beside the model.

    **Arguments:**

    - `model`: a model with adapters.
    - `donate`: update the base weights in place, never holding a second copy of a stacked
        weight (what the `merge` command does, at 7B). The base weights of `model` are then
        consumed: neither `model` nor any model sharing its base weights (such as the one
        given to [`add_lora`][] or [`load_adapters`][]) may be used afterwards. With `False`
        (the default) each stacked weight is copied once first, one target at a time.

    **Returns:**

    A plain [`Mistral`][] (no adapters) that [`save_hf`][] writes as a HF checkpoint.
    """
    for target, layer in _lora_layers(model).items():
        weight = layer.base.weight if donate else jnp.copy(layer.base.weight)
        scale = jnp.asarray(layer.config.scale, jnp.float32)
        platform = _platform.platform_of([weight.sharding])
        bit_reads = _platform.Tricks.for_platform(platform).bit_writes
        for i in range(weight.shape[0]):
            merged_layer = _merged_layer(
                weight, layer.lora_A, layer.lora_B, scale, jnp.int32(i), bit_reads=bit_reads
            )
            weight = eqx_lean.write_layer(weight, merged_layer, i)
        where = TARGETS[target][1]
        merged = eqx.tree_at(lambda m: m.weight, layer.base, weight)
        model = eqx.tree_at(lambda m, where=where: where(m.layers), model, merged)
    return model
