"""LoRA adapters for any Equinox model, stacked on the layer axis or plain.

A LoRA-adapted linear layer computes `y = x W^T (+ b) + scale * (dropout(x) A^T) B^T`, with `A`
of shape `[r, in]` and `B` of shape `[out, r]`, inside the layer call: the merged weight is
never formed during training. [`add_lora`][] wraps the chosen linear layers of a model in
[`LoraLinear`][]s. In a stacked model (leaves with a leading layer axis, as from
[`eqx_lean.build_stacked`][]) the adapters are stacked the same way and built with
`build_stacked` one layer at a time (`A` drawn as PEFT draws it, kaiming-uniform with
`a=sqrt(5)`, `B` zero), so the model runs through `eqx_lean.fold`/`eqx_lean.scan` unchanged.
[`lora_filter`][] selects the adapters for `eqx.partition`: the base stays frozen and only the
adapters get gradients and optimizer state. `_merge.py` folds the adapters into the base
weights, `_peft.py` saves and loads them in Hugging Face PEFT's format.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

import eqx_lean

from .._product import linear_product
from ..quant._array import QuantizedArray
from ..quant._linear import QuantizedLinear
from ._select import LoraConfig, dotted, matches, unmatched_entries


class LoraLinear(eqx.Module):
    """A linear layer with a LoRA adapter: `x W^T (+ b) + scale * (dropout(x) A^T) B^T`.

    A drop-in for `eqx.nn.Linear` (called on a vector `[in]`), that also maps any leading
    axes. The adapter reads `x` cast to its own dtype (float32 adapters on a bfloat16 base, as
    PEFT keeps them), the base product is accumulated in float32 (see
    `eqx_lean._product.linear_product`), and the sum (with the base's bias, if any) is rounded
    once to the base output's dtype, as PEFT does. In a stacked model every array has a leading
    layer axis, which `eqx_lean.fold`/`eqx_lean.scan` slice away before calling the layer.

    **Fields:**

    - `base`: the frozen `eqx.nn.Linear` (with or without bias), or a
        [`eqx_lean.quant.QuantizedLinear`][] (QLoRA), whose weight is dequantised for the
        base product only.
    - `lora_A`: `[*layers, r, in]`.
    - `lora_B`: `[*layers, out, r]`.
    - `config`: the [`LoraConfig`][] (static).
    - `layers`: for a stacked layer adapted in some layers only (as PEFT's per-layer
        `target_modules` select), the adapted layer indices; `None` for every layer. The other
        layers hold `A = B = 0`, so they contribute nothing, get zero gradients (they stay
        zero under training) and are not saved.
    - `merged`: whether `base` already holds `scale * B A` (see [`merge_lora`][] with
        `keep_adapters=True`); the adapters are then not applied again.
    """

    base: eqx.nn.Linear | QuantizedLinear
    lora_A: Float[Array, "*layers r in"]
    lora_B: Float[Array, "*layers out r"]
    config: LoraConfig = eqx.field(static=True)
    layers: tuple[int, ...] | None = eqx.field(static=True, default=None)
    merged: bool = eqx.field(static=True, default=False)

    def project(
        self, x: Float[Array, "... in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... out"]:
        """Applies the layer to `x` (any leading axes); dropout only when `key` is given."""
        if isinstance(self.base, QuantizedLinear):  # dequantised for this product only
            y = self.base.product(x)
        else:
            y = linear_product(x, self.base.weight)
        bias = self.base.bias
        if bias is not None:  # explicit leading axes: no implicit rank promotion
            bias = bias.reshape((1,) * (y.ndim - 1) + bias.shape)
        if self.merged:
            return y if bias is None else (y + bias.astype(y.dtype)).astype(y.dtype)
        h = x.astype(self.lora_A.dtype)
        rate = self.config.lora_dropout
        if key is not None and rate > 0:
            keep = jax.random.bernoulli(key, 1.0 - rate, h.shape)
            h = jnp.where(keep, h / (1.0 - rate), jnp.zeros_like(h))
        delta = linear_product(linear_product(h, self.lora_A), self.lora_B) * self.config.scale
        with jax.numpy_dtype_promotion("standard"):  # bfloat16 + float32 sum in float32
            total = jnp.promote_types(y.dtype, delta.dtype)
        out = y.astype(total) + delta.astype(total)
        if bias is not None:  # in the same wide sum, so the output is rounded once
            out = out + bias.astype(total)
        return out.astype(y.dtype)

    def __call__(
        self, x: Float[Array, "... in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... out"]:
        """As `eqx.nn.Linear.__call__` (and [`LoraLinear.project`][] for leading axes)."""
        return self.project(x, key=key)


class _Pair(eqx.Module):
    """One layer's adapter matrices (stacked on a leading layer axis when built)."""

    lora_A: Float[Array, "r in"]
    lora_B: Float[Array, "out r"]


@dataclasses.dataclass(frozen=True)
class _AdapterFactory:
    """Draws one layer's adapters; equal by value, so `build_stacked` reuses its compiled writes.

    `A` is kaiming-uniform with `a=sqrt(5)` (PEFT's default, torch's `nn.Linear` init): uniform
    on `[-1/sqrt(in), 1/sqrt(in)]`; `B` is zero, so a fresh adapter leaves the model unchanged.
    """

    out_features: int
    in_features: int
    r: int

    def __call__(self, key: PRNGKeyArray) -> _Pair:
        bound = 1.0 / math.sqrt(self.in_features)
        a = jax.random.uniform(key, (self.r, self.in_features), jnp.float32, -bound, bound)
        return _Pair(a, jnp.zeros((self.out_features, self.r), jnp.float32))


class Site(NamedTuple):
    """A module chosen for an adapter: its key path, the module, and its adapted layers."""

    path: tuple[Any, ...]
    module: Any
    layers: tuple[int, ...] | None


class TargetError(ValueError):
    """`target_modules` selects nothing, or names what the model does not have."""

    def __init__(self, requirement: str):
        super().__init__(f"`target_modules` {requirement}.")
        self.requirement = requirement


def _is_node(types: tuple[type, ...]) -> Callable[[Any], bool]:
    return lambda node: isinstance(node, (LoraLinear, *types))


def _linear_of(node: Any) -> Any:
    return node.base if isinstance(node, LoraLinear) else node


def weight_path(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """The key path of a module's weight in the model without adapters."""
    return (*path, jax.tree_util.GetAttrKey("weight"))


def module_name(path: tuple[Any, ...], weight: Any, names: Callable[[Any, Any], Any]) -> str:
    """The module name of a linear layer, as PEFT names adapters: its weight's tensor name.

    **Arguments:**

    - `path`: the key path of the linear layer (or of the `LoraLinear` in its place).
    - `weight`: its base weight.
    - `names`: the name function `(path, leaf) -> tensor name` of the model without adapters.

    **Returns:**

    The name `names` gives the weight, such as `"model.layers.{i}.self_attn.q_proj.weight"`,
    without its `.weight`; a `ValueError` where that name does not end in `.weight`.
    """
    name = names(weight_path(path), weight)
    if not isinstance(name, str) or not name.endswith(".weight"):
        raise ValueError(
            f"`names` must name the weight of {jax.tree_util.keystr(path)} '<module>.weight' "
            f"(PEFT names adapters after the module); it gave {name!r}."
        )
    return name.removesuffix(".weight")


def module_names(path: tuple[Any, ...], linear: Any, names: Any | None) -> list[str]:
    """The names `target_modules` is matched against: one dotted path (`names=None`), or one
    name per layer from `names` applied to the base weight (`model.layers.0.self_attn.q_proj`)."""
    if names is None:
        return [dotted(jax.tree_util.keystr(path))]
    weight = linear.weight
    module = module_name(path, weight, names)
    if weight.ndim == 3:
        if "{i}" not in module:
            raise ValueError(
                f"`names` must give the stacked weight of {jax.tree_util.keystr(path)} a name "
                f"with '{{i}}' (the layer index); it gave {module + '.weight'!r}."
            )
        return [module.replace("{i}", str(i)) for i in range(weight.shape[0])]
    return [module]


def select(
    model: PyTree, config: LoraConfig, types: tuple[type, ...], names: Any | None = None
) -> list[Site]:
    """The modules of one of `types` that `config.target_modules` adapts, in tree order.

    Raises a [`TargetError`][] when nothing matches or a list entry matches nothing (naming
    the candidates), and a `ValueError` when a matched module already holds adapters.
    """
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_node(types))[0]
    candidates = [(p, node) for p, node in flat if _is_node(types)(node)]
    named = [(p, node, module_names(p, _linear_of(node), names)) for p, node in candidates]
    every = [n for *_, ns in named for n in ns]
    shown = sorted(
        {dotted(jax.tree_util.keystr(p)) if names is None else ns[0] for p, _, ns in named}
    )
    kinds = ", ".join(t.__name__ for t in types)
    unmatched = unmatched_entries(config.target_modules, every)
    if unmatched:
        raise TargetError(
            f"must name modules of `model` ({kinds}), by PEFT's rule (a module whose name is an "
            f"entry or ends in '.' and the entry), but {unmatched} name none; the candidates "
            f"are {shown}"
        )
    sites = []
    for path, node, module in named:
        chosen = tuple(i for i, n in enumerate(module) if matches(config.target_modules, n))
        if not chosen:
            continue
        if isinstance(node, LoraLinear):
            raise ValueError(
                f"`model` must have plain modules where `target_modules` adds adapters; "
                f"{jax.tree_util.keystr(path)} already has a LoRA adapter (merge it with "
                "`merge_lora` first)."
            )
        weight = _linear_of(node).weight
        if weight.ndim not in (2, 3):
            raise ValueError(
                f"{jax.tree_util.keystr(path)} must have a weight [out, in] or, stacked, "
                f"[layers, out, in]; its weight has shape {weight.shape}."
            )
        full = len(chosen) == len(module)
        sites.append(Site(path, node, None if full or weight.ndim == 2 else chosen))
    if not sites:
        raise TargetError(
            f"must match at least one module of `model` ({kinds}); the candidates are {shown}"
        )
    return sites


def adapter_shardings(weight: Any) -> tuple[Any, Any, Any]:
    """`A`'s and `B`'s per-layer shardings for a base `weight` (its input dim for `A`, its
    output dim for `B`, the rank replicated), and the mesh axis of the base's layer axis;
    `None`s when the base is not a concrete `NamedSharding`-sharded array.

    A quantised base's codes pack its two dimensions into one, so its adapters are replicated
    over the mesh the codes lie on (they are small): left unplaced beside a sharded base, their
    products would mix arrays on no mesh with arrays on one, which JAX cannot differentiate
    on Explicit mesh axes.
    """
    if isinstance(weight, QuantizedArray):
        codes = weight.codes
        if not isinstance(codes, jax.Array) or isinstance(codes, Tracer):
            return None, None, None
        if not isinstance(codes.sharding, NamedSharding):
            return None, None, None
        replicated = NamedSharding(codes.sharding.mesh, PartitionSpec())
        layer = tuple(codes.sharding.spec)[:1] if codes.ndim > 1 else ()
        return replicated, replicated, layer[0] if layer else None
    if not isinstance(weight, jax.Array) or isinstance(weight, Tracer):
        return None, None, None
    sharding = weight.sharding
    if not isinstance(sharding, NamedSharding):
        return None, None, None
    spec = tuple(sharding.spec) + (None,) * (weight.ndim - len(sharding.spec))
    *layer, out_axis, in_axis = spec
    a = NamedSharding(sharding.mesh, PartitionSpec(None, in_axis))
    b = NamedSharding(sharding.mesh, PartitionSpec(out_axis, None))
    return a, b, layer[0] if layer else None


def place(array: Array, per_layer: Any, layer_axis: Any) -> Array:
    """`array` (an adapter matrix, stacked or not) placed as [`adapter_shardings`][] says."""
    if per_layer is None:
        return array
    if array.ndim == 2:
        return jax.device_put(array, per_layer)
    inner = tuple(per_layer.spec) + (None,) * (2 - len(per_layer.spec))
    return jax.device_put(array, NamedSharding(per_layer.mesh, PartitionSpec(layer_axis, *inner)))


def fresh_adapters(weight: Any, r: int, key: PRNGKeyArray, dtype: Any) -> tuple[Array, Array]:
    """PEFT's initial `A` and `B` for a base `weight` (stacked: built with `build_stacked`)."""
    out_features, in_features = weight.shape[-2:]
    factory = _AdapterFactory(out_features, in_features, r)
    a_sharding, b_sharding, layer_axis = adapter_shardings(weight)
    if weight.ndim == 3:
        sharding = None if a_sharding is None else _Pair(a_sharding, b_sharding)
        keys = jax.random.split(key, weight.shape[0])
        pair = eqx_lean.build_stacked(factory, keys, dtype, sharding)
        if layer_axis is None:
            return pair.lora_A, pair.lora_B
        # `build_stacked` keeps the layer axis replicated; the base's is sharded.
    else:
        pair = factory(key)
        pair = _Pair(pair.lora_A.astype(dtype), pair.lora_B.astype(dtype))
    return place(pair.lora_A, a_sharding, layer_axis), place(pair.lora_B, b_sharding, layer_axis)


def replace_modules(model: PyTree, new: dict[str, Any], types: tuple[type, ...]) -> PyTree:
    """`model` with the modules at the `keystr` paths in `new` replaced (nothing copied)."""

    def swap(path: Any, node: Any) -> Any:
        return new.get(jax.tree_util.keystr(path), node)

    return jax.tree_util.tree_map_with_path(swap, model, is_leaf=_is_node(types))


def add_lora(
    model: PyTree,
    config: LoraConfig,
    *,
    key: PRNGKeyArray,
    types: tuple[type, ...] = (eqx.nn.Linear, QuantizedLinear),
    dtype: Any = jnp.float32,
    names: Callable[[Any, Any], str] | None = None,
) -> PyTree:
    """Adds fresh LoRA adapters (PEFT's init) to the modules `config.target_modules` selects.

    Every module of one of `types` is a candidate, found anywhere in `model`: a stacked one
    (weight `[layers, out, in]`, as from `build_stacked`) gets stacked adapters built one
    layer at a time with [`eqx_lean.build_stacked`][], a plain one (weight `[out, in]`) plain
    adapters; a model may mix both (a stacked `layers` and a plain head). If the base weight is
    sharded with a `NamedSharding`, `A`'s input dim is sharded as the base's input dim, `B`'s
    output dim as the base's output dim, the rank replicated.

    **Check that the model calls the adapters.** [`lora_paths`][] lists the wrapped paths, but
    a layer that reads `self.q.weight` directly (instead of calling `self.q(x)`) bypasses the
    adapter silently. Set some `B` to nonzero values and compare outputs:

    ```python
    lora = eqx_lean.lora.add_lora(model, config, key=key)
    spec = eqx_lean.lora.lora_filter(lora)
    bumped = jax.tree.map(lambda x, s: x + 1.0 if s else x, lora, spec)
    assert not jnp.allclose(run(bumped, x), run(lora, x))  # the adapters are used
    ```

    **Arguments:**

    - `model`: any Equinox model without adapters at the selected paths.
    - `config`: the [`LoraConfig`][]; `target_modules` is matched against each candidate's
        dotted path (`layers.self_attn.q_proj`), see [`LoraConfig`][].
    - `key`: the random key for the `A` matrices.
    - `types`: the module types that may be adapted; they must have `weight` (`[out, in]`)
        and `bias` fields like `eqx.nn.Linear`. The default adapts `eqx.nn.Linear`s and
        quantised [`eqx_lean.quant.QuantizedLinear`][]s (QLoRA).
    - `dtype`: the adapters' dtype; float32 (master weights that small updates do not round
        away, as PEFT keeps them) whatever the base's dtype.
    - `names`: match `target_modules` against the names this function gives the base weights
        instead (`(path, leaf) -> name`, as for [`eqx_lean.load_tensors`][], minus
        `.weight`, one name per layer with `{i}` filled in), so that PEFT's per-layer entries
        (`model.layers.0.self_attn.q_proj`) adapt only those layers.

    **Returns:**

    The model with [`LoraLinear`][]s in place of the selected modules; its outputs equal the
    base model's, as `B = 0`. A `ValueError` names the candidate paths when nothing matches.
    """
    types = tuple(types)
    sites = select(model, config, types, names)
    keys = jax.random.split(key, len(sites))
    new = {}
    for site, k in zip(sites, keys, strict=True):
        a, b = fresh_adapters(site.module.weight, config.r, k, dtype)
        a = zero_unselected(a, site.layers)
        new[jax.tree_util.keystr(site.path)] = LoraLinear(site.module, a, b, config, site.layers)
    return replace_modules(model, new, types)


def zero_unselected(a: Array, layers: tuple[int, ...] | None) -> Array:
    """`A` with the layers outside `layers` zeroed: with `A = B = 0` there, both get zero
    gradients, so training leaves those layers without an adapter, as PEFT has none there."""
    if layers is None:
        return a
    keep = jnp.isin(jnp.arange(a.shape[0]), jnp.asarray(layers)).reshape(-1, 1, 1)
    return jnp.where(keep, a, jnp.zeros_like(a))


def lora_sites(model: PyTree) -> list[tuple[tuple[Any, ...], LoraLinear]]:
    """The `(key path, LoraLinear)` of every adapter in `model`, in tree order."""
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_node(()))[0]
    return [(p, node) for p, node in flat if isinstance(node, LoraLinear)]


def lora_paths(model: PyTree) -> tuple[str, ...]:
    """The paths (`jax.tree_util.keystr`, such as `.layers.self_attn.q_proj`) of the
    [`LoraLinear`][]s in `model`, in tree order."""
    return tuple(jax.tree_util.keystr(p) for p, _ in lora_sites(model))


def lora_filter(model: PyTree) -> PyTree[bool]:
    """The filter spec selecting the adapters: `eqx.partition(model, lora_filter(model))` gives
    `(adapters, frozen base)`, so gradients and optimizer state cover the adapters only."""

    def spec(node: Any) -> Any:
        if isinstance(node, LoraLinear):
            off = jax.tree.map(lambda _: False, node.base)
            return LoraLinear(off, True, True, node.config, node.layers, node.merged)  # pyright: ignore[reportArgumentType]
        return jax.tree.map(lambda _: False, node)

    return jax.tree.map(spec, model, is_leaf=_is_node(()))


def lora_config_of(model: PyTree) -> LoraConfig:
    """The one [`LoraConfig`][] of a model's adapters."""
    configs = {layer.config for _, layer in lora_sites(model)}
    if not configs:
        raise ValueError("`model` must have LoRA adapters (see `add_lora`); it has none.")
    if len(configs) > 1:
        raise ValueError(
            f"`model`'s adapters must share one LoraConfig to be saved together; found {configs}."
        )
    return configs.pop()
