"""`QuantizedArray`: a frozen weight held as codes and scales, and `quantize` to make one."""

from typing import Any, Literal

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._int8 import int8_decode, int8_encode
from ._nf4 import nf4_decode, nf4_encode, num_blocks
from ._ops import batched


Scheme = Literal["nf4", "int8"]
_SCHEMES = ("nf4", "int8")


class QuantizedArray(eqx.Module):
    """A weight (or a stack of them) held quantised: codes and float32 scales.

    Made by [`eqx_lean.quant.quantize`][]. Leading batch axes (a stack's layer axis) come
    first on both `codes` and `scales`; each tensor along them is quantised on its own, as
    bitsandbytes quantises one weight. It is a pytree like any Equinox module: it stacks,
    slices with `jax.tree.map`, and passes through `jax.jit`; `dequantize` gives the values.

    **Attributes:**

    - `codes`: `nf4`: `uint8`, two 4-bit codes per byte (first in the high nibble), shape
        `batch + (ceil(size / 2),)`; `int8`: `int8`, shape `batch + shape`.
    - `scales`: float32; `nf4`: one per block of `blocksize` values, `batch + (blocks,)`;
        `int8`: one per output channel, `batch + (shape[0],)`.
    - `shape`: one tensor's shape (without the batch axes).
    - `scheme`: `"nf4"` or `"int8"`.
    - `blocksize`: values per scale for `nf4` (0 for `int8`).
    - `dtype`: the dtype it was quantised from, which `dequantize` gives by default.
    """

    codes: Array
    scales: Array
    shape: tuple[int, ...] = eqx.field(static=True)
    scheme: str = eqx.field(static=True)
    blocksize: int = eqx.field(static=True)
    dtype: np.dtype = eqx.field(static=True)

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The leading batch axes (a stack's layers), `()` for one tensor."""
        return tuple(self.scales.shape[:-1])

    @property
    def full_shape(self) -> tuple[int, ...]:
        """`batch_shape + shape`: the shape `dequantize` returns."""
        return self.batch_shape + self.shape

    @property
    def nbytes(self) -> int:
        """The bytes of its codes and scales."""
        return self.codes.nbytes + self.scales.nbytes

    def dequantize(self, dtype: Any = None) -> Array:
        """The values, `code * scale` in float32 rounded to `dtype` (default: `self.dtype`).

        **Arguments:**

        - `dtype`: the output dtype; `None` for the dtype it was quantised from.

        **Returns:**

        An array of shape `full_shape`.
        """
        out = jnp.dtype(self.dtype if dtype is None else dtype)
        batch = len(self.batch_shape)
        if self.scheme == "nf4":
            shape, blocksize = self.shape, self.blocksize

            def decode(codes: Array, scales: Array) -> Array:
                return nf4_decode(codes, scales, shape, blocksize, out)

        else:

            def decode(codes: Array, scales: Array) -> Array:
                return int8_decode(codes, scales, out)

        return batched(decode, batch)(self.codes, self.scales)


def quantize(
    x: Array, scheme: Scheme = "nf4", *, blocksize: int = 64, batch_dims: int = 0
) -> QuantizedArray:
    """Quantises a floating array: NF4 in blocks (QLoRA's, bit for bit bitsandbytes') or int8
    per output channel.

    ```python
    q = eqx_lean.quant.quantize(linear.weight)                 # NF4, blocks of 64
    stack = eqx_lean.quant.quantize(blocks.mlp.weight, batch_dims=1)  # each layer on its own
    w = q.dequantize(jnp.bfloat16)
    ```

    NF4 flattens each tensor (row-major) into blocks of `blocksize` values, scales each block
    by its largest magnitude and stores the index of the NormalFloat4 bin each value falls in;
    the codes and scales equal bitsandbytes 0.50.2's `quantize_4bit(quant_type="nf4",
    blocksize=...)` (its CPU backend). int8 stores `round(x / scale)` with one symmetric scale
    per output channel (the first axis after the batch axes).

    **Arguments:**

    - `x`: the array, of a floating dtype.
    - `scheme`: `"nf4"` or `"int8"`.
    - `blocksize`: values per NF4 scale (bitsandbytes uses 64 for QLoRA); unused by int8.
    - `batch_dims`: leading axes along which each tensor is quantised on its own (1 for a
        stack of layers).

    **Returns:**

    A [`eqx_lean.quant.QuantizedArray`][].
    """
    if scheme not in _SCHEMES:
        raise ValueError(f"scheme must be one of {_SCHEMES}, got {scheme!r}.")
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"quantize needs a floating array `x`, got {getattr(x, 'dtype', type(x).__name__)}."
        )
    if not isinstance(batch_dims, int) or not 0 <= batch_dims <= x.ndim:
        raise ValueError(
            f"batch_dims must be an integer from 0 to x.ndim={x.ndim}, got {batch_dims!r}."
        )
    shape = tuple(x.shape[batch_dims:])
    if scheme == "nf4":
        if not isinstance(blocksize, int) or blocksize < 1:
            raise ValueError(f"blocksize must be a positive integer, got {blocksize!r}.")
        if not shape or 0 in shape:
            raise ValueError(f"nf4 needs tensors with values; x's tensors have shape {shape}.")
        codes, scales = batched(lambda t: nf4_encode(t, blocksize), batch_dims)(x)
        assert scales.shape[-1] == num_blocks(int(np.prod(shape)), blocksize)
    else:
        if not shape:
            raise ValueError(
                "int8 needs tensors of at least one axis (the output channels) after the "
                f"batch axes; x has shape {x.shape} with batch_dims={batch_dims}."
            )
        codes, scales = batched(int8_encode, batch_dims)(x)
        blocksize = 0
    return QuantizedArray(codes, scales, shape, scheme, blocksize, np.dtype(x.dtype))


def is_quantized(x: Any) -> bool:
    """Whether `x` is a [`eqx_lean.quant.QuantizedArray`][] (for `is_leaf=` in tree maps)."""
    return isinstance(x, QuantizedArray)
