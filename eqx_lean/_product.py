"""The matrix product of linear layers, accumulated in float32: shared by the HF decoder and
LoRA adapters."""

import math
from typing import cast

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float

from ._core.sharding import axis_names, explicit_spec, explicit_type_sharding


def product_sharding(x: Array, weight: Array, *, output_axis: int = 0) -> NamedSharding | None:
    """Where `x @ weight.T` lands on Explicit mesh axes: the leading axes sharded as `x`'s,
    the output axis as `weight`'s rows unless that shards a mesh axis the leading axes already
    use (a batch over "data" times a head split over "data" by `fsdp`: the output keeps the
    batch's sharding). `None` when neither operand names Explicit axes: XLA chooses.

    `output_axis=1` is for `x @ weight`, whose output axis is `weight`'s columns (the input
    gradient of a product).
    """
    x_spec, weight_spec = explicit_spec(x), explicit_spec(weight)
    if x_spec is None and weight_spec is None:
        return None
    lead = (None,) * (x.ndim - 1) if x_spec is None else x_spec[:-1]
    rows = None if weight_spec is None else weight_spec[output_axis]
    if set(axis_names(rows)) & {name for entry in lead for name in axis_names(entry)}:
        rows = None
    sharding = cast(NamedSharding, explicit_type_sharding(x if x_spec is not None else weight))
    return sharding.update(spec=PartitionSpec(*lead, rows))


def _accumulated_product(x: Array, weight: Array) -> Array:
    out = jnp.einsum(
        "...i,oi->...o",
        x,
        weight,
        preferred_element_type=jnp.float32,
        out_sharding=product_sharding(x, weight),
    )
    return out.astype(x.dtype)


def _one_row_as_two(x: Array, weight: Array) -> Array:
    row = x.reshape(1, -1)
    out = _accumulated_product(jnp.concatenate([row, jnp.zeros_like(row)]), weight)
    return out[:1].reshape(*x.shape[:-1], -1)


def _low_precision_rows(x: Array, weight: Array) -> Array:
    """`_accumulated_product` for 16-bit operands, a single row padded to two on CPU.

    XLA:CPU lowers a 16-bit matrix-vector dot (one row, as each step of generation) by first
    copying the whole weight to float32 (for a Mistral-7B head, a 500 MiB copy). With two rows
    it reads the weight as it is. Rows are independent, so the padding row changes nothing but
    the kernel. XLA's plan of a Mistral-7B decode step before and after: `docs/benchmarks.md`,
    "QLoRA: the same step on an NF4 base".
    """
    if math.prod(x.shape[:-1]) != 1:
        return _accumulated_product(x, weight)
    return lax.platform_dependent(x, weight, cpu=_one_row_as_two, default=_accumulated_product)


@jax.custom_vjp
def _low_precision_product(x: Array, weight: Array) -> Array:
    return _low_precision_rows(x, weight)


def _low_precision_product_fwd(x: Array, weight: Array) -> tuple[Array, tuple[Array, Array]]:
    return _low_precision_rows(x, weight), (x, weight)


def _low_precision_product_bwd(
    residuals: tuple[Array, Array], cotangent: Array
) -> tuple[Array, Array]:
    # Autodiff would transpose the float32-result dot into a dot of a float32 cotangent with
    # the bfloat16 weight, for which XLA:CPU copies the weight to float32 (500 MiB for a
    # Mistral-7B head). The cotangent of the rounded output is bfloat16 already, so both
    # products take bfloat16 operands and accumulate in float32, as torch's backward does.
    # Each gradient is sharded as its primal: with Explicit mesh axes JAX cannot choose, as the
    # weight's gradient contracts the (batch-sharded) leading axes.
    x, weight = residuals
    f32 = jnp.float32
    dx = jnp.einsum(
        "...o,oi->...i",
        cotangent,
        weight,
        preferred_element_type=f32,
        out_sharding=explicit_type_sharding(x),
    )
    dweight = jnp.einsum(
        "...o,...i->oi",
        cotangent,
        x,
        preferred_element_type=f32,
        out_sharding=explicit_type_sharding(weight),
    )
    return dx.astype(x.dtype), dweight.astype(weight.dtype)


_low_precision_product.defvjp(_low_precision_product_fwd, _low_precision_product_bwd)


def linear_product(
    x: Float[Array, "... in"], weight: Float[Array, "out in"]
) -> Float[Array, "... out"]:
    """`x @ weight.T` over any leading axes, accumulated in float32 and rounded to `x`'s dtype.

    For bfloat16 operands this is torch's CPU semantics (float32 accumulation, one rounding of
    the output), and on XLA:CPU it is also what keeps the product lean: a plain bfloat16 dot
    is lowered by first copying the weight to float32 (a 16 MiB copy of a 2048 x 2048 matrix),
    whereas a dot asked for a float32 result reads the bfloat16 weight as it is. The
    gradients of a 16-bit product are computed the same way (a custom VJP), so forward-mode
    differentiation (`jax.jvp`) of a bfloat16 model is not supported; float32 models take
    JAX's own derivatives.
    """
    if x.dtype == weight.dtype and jnp.finfo(x.dtype).bits < 32:
        return _low_precision_product(x, weight)
    return _accumulated_product(x, weight)
