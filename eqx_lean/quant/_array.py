"""`QuantizedArray`: a frozen weight held as codes and scales, and `quantize` to make one."""

import functools
import math
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from ._dynamic8 import dynamic8_decode, dynamic8_encode
from ._int8 import int8_decode, int8_encode
from ._nf4 import nf4_decode, nf4_encode, num_blocks
from ._ops import (
    batched,
    divide_exactly,
    down_exactly,
    halving_sum,
    largest_magnitude,
    one_by_one,
    subtract_exactly,
    up_exactly,
    widen_exactly,
)


Scheme = Literal["nf4", "int8"]
_SCHEMES = ("nf4", "int8")
_TWO_24 = np.float32(2.0**24).view(np.uint32)


def _bits(x: Array) -> Array:
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _floats(bits: Array) -> Array:
    return lax.bitcast_convert_type(bits, jnp.float32)


class DoubleQuantizedScales(eqx.Module):
    """NF4 block scales stored double-quantised, as QLoRA's `compress_statistics=True` does.

    Each tensor's scales are kept as `absmax - offset` (`offset` their mean), in 8-bit codes on
    the signed dynamic map, in blocks of 256 with a float32 scale each (see
    `eqx_lean.quant._dynamic8`): 1.03 bytes a block rather than 4. Float32 values are held as
    their `uint32` bit patterns, so that no gradient, optimizer or `eqx.is_inexact_array`
    filter ever treats them as parameters.

    **Attributes:**

    - `codes`: `uint8`, `batch + (blocks,)`.
    - `absmax_bits`: the float32 scales of blocks of `blocksize` codes, `batch + (groups,)`.
    - `offset_bits`: the float32 offset of each tensor, `batch`.
    - `blocksize`: codes per scale (256, as bitsandbytes).
    """

    codes: Array
    absmax_bits: Array
    offset_bits: Array
    blocksize: int = eqx.field(static=True, default=256)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the scales they stand for: `batch + (blocks,)`."""
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        """The bytes of the codes, scales and offsets."""
        return self.codes.nbytes + self.absmax_bits.nbytes + self.offset_bits.nbytes

    def decode(self) -> Float[Array, "*batch blocks"]:
        """The float32 scales: `map[code] * absmax + offset`, as bitsandbytes decodes them (a
        product or sum below 2^-126 flushed to zero where the platform flushes: XLA:CPU)."""
        blocksize = self.blocksize

        def decode_one(codes: Array, absmax: Array, offset: Array) -> Array:
            return dynamic8_decode(codes, absmax, blocksize) + offset

        batch = self.codes.ndim - 1
        absmax, offset = _floats(self.absmax_bits), _floats(self.offset_bits)
        return batched(decode_one, batch)(self.codes, absmax, offset)


def double_quantize(
    scales: Float[Array, "*batch blocks"], blocksize: int = 256
) -> DoubleQuantizedScales:
    """`scales` (each tensor's NF4 block scales, on the last axis) double-quantised."""

    def encode_one(values: Array) -> tuple[Array, Array, Array]:
        # Scales all below 2^24 are summed 2^64 times larger, so that subnormal ones count
        # (XLA:CPU reads them as zero), and their mean rounded back, subnormal or not. Among
        # larger ones, a subnormal cannot change the rounded sum.
        small = lax.bitcast_convert_type(largest_magnitude(values), jnp.uint32) < _TWO_24
        total = halving_sum(jnp.where(small, up_exactly(values), values))
        mean = divide_exactly(total, values.shape[0])
        # One offset, used as computed: without the barrier XLA may fuse a second copy of the
        # mean into the subtraction, computed another way, and store one but subtract another.
        offset = lax.optimization_barrier(jnp.where(small, down_exactly(mean), mean))
        codes, absmax = dynamic8_encode(subtract_exactly(values, offset), blocksize)
        return codes, _bits(absmax), _bits(offset)

    codes, absmax_bits, offset_bits = one_by_one(encode_one, scales, scales.ndim - 1)
    return DoubleQuantizedScales(codes, absmax_bits, offset_bits, blocksize)


class QuantizedArray(eqx.Module):
    """A frozen weight (or a stack of them) held quantised: codes and float32 scales.

    Made by [`eqx_lean.quant.quantize`][]. Leading batch axes (a stack's layer axis) come
    first on both `codes` and the scales; each tensor along them is quantised on its own, as
    bitsandbytes quantises one weight. It is a pytree like any Equinox module: it stacks,
    slices with `jax.tree.map`, and passes through `jax.jit`; `dequantize` gives the values.

    It is not an array: only [`eqx_lean.quant.QuantizedLinear`][] computes with it. Any other
    use (`w @ x`, `jnp.asarray(w)`, `w * 2`) raises a `TypeError` naming the weight. Its
    float32 scales are stored as `uint32` bit patterns, so it holds no inexact leaf: gradients
    (`eqx.filter_grad`, `fold`'s backward), optimizers and `eqx.is_inexact_array` filters pass
    it by as frozen, with no gradient buffer.

    **Attributes:**

    - `codes`: `nf4`: `uint8`, two 4-bit codes per byte (first in the high nibble), shape
        `batch + (ceil(size / 2),)`; `int8`: `int8`, shape `batch + tensor_shape`.
    - `scale_bits`: the float32 scales as `uint32` bits; `nf4`: one per block of `blocksize`
        values, `batch + (blocks,)`; `int8`: one per output channel, `batch +
        (tensor_shape[0],)`. Or, for NF4 with double quantisation, a
        [`eqx_lean.quant.DoubleQuantizedScales`][]. `scales` gives them as float32.
    - `tensor_shape`: one tensor's shape (without the batch axes).
    - `scheme`: `"nf4"` or `"int8"`.
    - `blocksize`: values per scale for `nf4` (0 for `int8`).
    - `dtype`: the dtype it was quantised from, which `dequantize` gives by default.
    - `name`: what error messages call it (the module path, when set by
        [`eqx_lean.quant.quantize_linears`][]).
    """

    codes: Array
    scale_bits: Array | DoubleQuantizedScales
    tensor_shape: tuple[int, ...] = eqx.field(static=True)
    scheme: str = eqx.field(static=True)
    blocksize: int = eqx.field(static=True)
    dtype: np.dtype = eqx.field(static=True)
    name: str = eqx.field(static=True, default="")

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The leading batch axes (a stack's layers), `()` for one tensor."""
        return tuple(self.scale_bits.shape[:-1])

    @property
    def shape(self) -> tuple[int, ...]:
        """`batch_shape + tensor_shape`: the shape `dequantize` returns."""
        return self.batch_shape + self.tensor_shape

    @property
    def ndim(self) -> int:
        """`len(shape)`."""
        return len(self.shape)

    @property
    def double_quantized(self) -> bool:
        """Whether the scales are double-quantised."""
        return isinstance(self.scale_bits, DoubleQuantizedScales)

    @property
    def scales(self) -> Float[Array, "*batch scales"]:
        """The float32 scales (decoded, if double-quantised)."""
        if isinstance(self.scale_bits, DoubleQuantizedScales):
            return self.scale_bits.decode()
        return _floats(self.scale_bits)

    @property
    def nbytes(self) -> int:
        """The bytes of its codes and scales."""
        return self.codes.nbytes + self.scale_bits.nbytes

    def dequantize(self, dtype: Any = None) -> Array:
        """The values, `code * scale` in float32 rounded to `dtype` (default: `self.dtype`).

        **Arguments:**

        - `dtype`: the output dtype; `None` for the dtype it was quantised from.

        **Returns:**

        An array of shape `shape`.
        """
        out = jnp.dtype(self.dtype if dtype is None else dtype)
        batch = len(self.batch_shape)
        if self.scheme == "nf4":
            shape, blocksize = self.tensor_shape, self.blocksize

            def decode(codes: Array, scales: Array) -> Array:
                return nf4_decode(codes, scales, shape, blocksize, out)

        else:

            def decode(codes: Array, scales: Array) -> Array:
                return int8_decode(codes, scales, out)

        return batched(decode, batch)(self.codes, self.scales)

    def _refuse(self, *_: Any, **__: Any) -> Any:
        label = f"`{self.name}`" if self.name else "This QuantizedArray"
        raise TypeError(
            f"{label} is a {self.scheme}-quantised weight of shape {self.shape}, not an array: "
            "only eqx_lean.quant.QuantizedLinear (or a LoRA adapter on one) computes with it. "
            "Quantise only linear layers that the model calls (`quantize_linears`), or call "
            "`.dequantize()` for its values."
        )

    __jax_array__ = __array__ = _refuse
    __matmul__ = __rmatmul__ = __mul__ = __rmul__ = __add__ = __radd__ = _refuse
    __sub__ = __rsub__ = __truediv__ = __getitem__ = __neg__ = astype = _refuse


def quantize(
    x: Array,
    scheme: Scheme = "nf4",
    *,
    blocksize: int = 64,
    double_quant: bool = False,
    batch_dims: int = 0,
    name: str = "",
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

    Both hold over the whole float32 range, subnormals included (computed as IEEE float32
    computes them, where XLA:CPU would flush them to zero). Non-finite values are quantised as
    bitsandbytes quantises them, not refused: an NF4 block holding a NaN decodes to NaN, and
    one holding an infinity decodes to NaN but for its infinities, which decode to `+inf`
    whatever their sign. Decoding is plain float32 arithmetic: a decoded value below 2^-126
    (in an NF4 block whose scale is below about 2^-122) is zero on XLA:CPU, which flushes it.
    The details are in `eqx_lean.quant._nf4` and `eqx_lean.quant._int8`.

    **Arguments:**

    - `x`: the array, of a floating dtype.
    - `scheme`: `"nf4"` or `"int8"`.
    - `blocksize`: values per NF4 scale (bitsandbytes uses 64 for QLoRA); unused by int8.
    - `double_quant`: NF4 only: store the scales double-quantised (QLoRA's
        `bnb_4bit_use_double_quant`), in 8-bit codes of blocks of 256; the codes equal
        bitsandbytes' `quantize_blockwise` of the same `scales - offset`. The offset, the mean
        of a tensor's scales, is a float32 sum whose order differs from torch's: it may differ
        from bitsandbytes' in the last bits (or overflow where torch's does not: a tensor whose
        scales sum beyond float32's largest value has an infinite offset, and every scale
        decodes to NaN, as in bitsandbytes). Decoded on XLA:CPU, a scale below about 2^-100
        may be off by less than 2^-126 (a flushed subnormal product or sum).
    - `batch_dims`: leading axes along which each tensor is quantised on its own (1 for a
        stack of layers).
    - `name`: what error messages call it (a module path).

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
    source_dtype = np.dtype(x.dtype)
    if scheme == "nf4":
        if not isinstance(blocksize, int) or blocksize < 1:
            raise ValueError(f"blocksize must be a positive integer, got {blocksize!r}.")
        if not shape or 0 in shape:
            raise ValueError(f"nf4 needs tensors with values; x's tensors have shape {shape}.")
    else:
        if double_quant:
            raise ValueError("double_quant applies to nf4 only; int8 has one scale per row.")
        if not shape:
            raise ValueError(
                "int8 needs tensors of at least one axis (the output channels) after the "
                f"batch axes; x has shape {x.shape} with batch_dims={batch_dims}."
            )
        blocksize = 0
    codes, stored = _encoded(x, scheme, blocksize, bool(double_quant), batch_dims)
    return QuantizedArray(codes, stored, shape, scheme, blocksize, source_dtype, name)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _encoded(
    x: Array, scheme: str, blocksize: int, double_quant: bool, batch_dims: int
) -> tuple[Array, Any]:
    """The codes and stored scales of `x`'s tensors, as one compiled program: the encoders'
    exact float32 arithmetic is many small operations, each its own compiled program when run
    eagerly (a fresh `quantize` call compiled about a hundred)."""
    x = widen_exactly(x)  # see its docstring: the values as stored, in float32
    if scheme == "nf4":
        codes, scales = one_by_one(lambda t: nf4_encode(t, blocksize), x, batch_dims)
        assert scales.shape[-1] == num_blocks(math.prod(x.shape[batch_dims:]), blocksize)
        return codes, double_quantize(scales) if double_quant else _bits(scales)
    codes, scales = one_by_one(int8_encode, x, batch_dims)
    return codes, _bits(scales)


def is_quantized(x: Any) -> bool:
    """Whether `x` is a [`eqx_lean.quant.QuantizedArray`][] (for `is_leaf=` in tree maps)."""
    return isinstance(x, QuantizedArray)
