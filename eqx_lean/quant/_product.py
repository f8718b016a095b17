"""The product of an input with a quantised weight: `x W^T`, `W` decoded for it alone.

`W` is a [`QuantizedArray`][eqx_lean.quant.QuantizedArray]: it is decoded in the dtype it was
quantised from and cast to `x`'s dtype (as bitsandbytes' `Linear4bit`), and the product
accumulates in float32 (as `linear_product`).

Evaluated (not differentiated) on CPU, as in generation, the weight is decoded and used a slice
of rows at a time (about a million values: 2 MiB of bfloat16, whole bytes and blocks), so the
decoded weight never exists whole: XLA:CPU cannot fuse decoding into a dot, and a whole decoded
matrix is a temporary of its own (112 MiB for a 14336 x 4096 matrix in bfloat16). XLA's CPU
plan of a Mistral-7B NF4 forward, sliced against whole, is in `docs/benchmarks.md`, "QLoRA: the
same step on an NF4 base". Each output is still one float32 dot over the whole input axis, but
XLA:CPU orders a dot's sum by its shape: a bfloat16 output is the same as the whole product's
(tested), a float32 one may differ in its last bits. Elsewhere (GPU, TPU), the weight is decoded
whole, as XLA plans it there.

Differentiated (training), the weight is decoded whole and kept for the backward pass's
`dy W` within the layer: decoding again there would add a third decoding per step to the
forward and the rematerialised one, and slices make the dots smaller and slower (the figures
are in the same section of `docs/benchmarks.md`). The weight gets no gradient (its leaves are
integers).
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from .._product import _accumulated_product, linear_product, product_sharding
from ._array import QuantizedArray
from ._int8 import int8_decode
from ._nf4 import nf4_decode


# Values of the decoded weight per slice on CPU: 2 MiB of bfloat16, within a core's cache.
# Test seam: tests/test_quant_linear.py makes slices small.
CHUNK_VALUES = 1 << 20


def rows_per_chunk(weight: QuantizedArray) -> int | None:
    """Rows of `weight` per slice: the most that hold at most `CHUNK_VALUES` values, divide
    the rows evenly and hold whole bytes and whole blocks of codes; `None` for one slice (a
    weight that small, or one no such slice divides)."""
    rows, columns = weight.tensor_shape
    chunk_values = CHUNK_VALUES
    if rows * columns <= chunk_values:
        return None
    unit = math.lcm(weight.blocksize, 2) if weight.scheme == "nf4" else 1
    fitting = [
        r
        for r in range(1, rows)
        if rows % r == 0 and (r * columns) % unit == 0 and r * columns <= chunk_values
    ]
    return max(fitting) if fitting else None


def _chunks(weight: QuantizedArray, rows: int) -> tuple[Array, Array]:
    """The codes and float32 scales of `weight` cut into slices of `rows` rows each."""
    count = weight.tensor_shape[0] // rows
    scales = weight.scales
    if weight.scheme == "nf4":
        return weight.codes.reshape(count, -1), scales.reshape(count, -1)
    return weight.codes.reshape(count, rows, -1), scales.reshape(count, rows)


def _decode(weight: QuantizedArray, codes: Array, scales: Array, rows: int, dtype: Any) -> Array:
    """One slice of `rows` rows decoded in `weight.dtype`, then cast to `dtype`."""
    if weight.scheme == "nf4":
        shape = (rows, weight.tensor_shape[1])
        decoded = nf4_decode(codes, scales, shape, weight.blocksize, weight.dtype)
    else:
        decoded = int8_decode(codes, scales, weight.dtype)
    return decoded.astype(dtype)


def _forward_in_chunks(x: Array, weight: QuantizedArray, rows: int) -> Array:
    def one(chunk: tuple[Array, Array]) -> Array:
        return linear_product(x, _decode(weight, *chunk, rows, x.dtype))

    ys = lax.map(one, _chunks(weight, rows))  # [chunks, ..., rows]
    return jnp.moveaxis(ys, 0, -2).reshape(*ys.shape[1:-1], -1)


def decoded_for(weight: QuantizedArray, dtype: Any) -> Array:
    """`weight` decoded in the dtype it was quantised from, then cast to `dtype` (bitsandbytes'
    `Linear4bit`: `dequantize_4bit(...).to(x.dtype)`)."""
    return weight.dequantize().astype(dtype)


def _forward(x: Array, weight: QuantizedArray) -> Array:
    rows = rows_per_chunk(weight)
    if rows is None:
        return linear_product(x, decoded_for(weight, x.dtype))
    return lax.platform_dependent(
        x,
        weight,
        cpu=lambda x, w: _forward_in_chunks(x, w, rows),
        default=lambda x, w: linear_product(x, decoded_for(w, x.dtype)),
    )


@jax.custom_vjp
def _product(x: Array, weight: QuantizedArray) -> Array:
    return _forward(x, weight)


def _product_fwd(x: Array, weight: QuantizedArray) -> tuple[Array, tuple[Array, QuantizedArray]]:
    w = decoded_for(weight, x.dtype)
    return _accumulated_product(x, w), (w, weight)


def _product_bwd(residuals: tuple[Array, QuantizedArray], dy: Array) -> tuple[Array, Any]:
    # The decoded weight from the forward pass: decoding it again would cost as much as the
    # product (see the module's docstring). Both operands in `dy`'s dtype, accumulated in
    # float32, as `linear_product`'s own backward pass.
    w, weight = residuals
    dx = jnp.einsum(
        "...o,oi->...i",
        dy,
        w,
        preferred_element_type=jnp.float32,
        out_sharding=product_sharding(dy, w, output_axis=1),
    )
    no_gradient = jax.tree.map(lambda leaf: np.zeros(leaf.shape, jax.dtypes.float0), weight)
    return dx.astype(dy.dtype), no_gradient


_product.defvjp(_product_fwd, _product_bwd)


def quantized_product(x: Float[Array, "... in"], weight: QuantizedArray) -> Float[Array, "... out"]:
    """`x @ W.T` for one quantised weight `W` (`[out, in]`, no batch axes), in `x`'s dtype, as
    `linear_product(x, W.dequantize().astype(x.dtype))` computes it (see the module's
    docstring for how, and why on CPU a slice of rows at a time). Reverse-mode
    differentiable in `x` (a custom VJP), not forward-mode."""
    return _product(x, weight)
