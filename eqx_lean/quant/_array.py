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

from .. import _arguments as arguments
from .._compat import refuse_as_jax_value
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
    use (`w @ x`, `jnp.asarray(w)`, `jax.lax.dot(w, x)`, `w * 2`, `w.T`, `w.reshape(...)`,
    `w < 0`, `w == 0`, `len(w)`, `float(w)`, `bool(w)`) raises a `TypeError` naming the weight
    and what it supports; `w.dequantize()` gives a dense array to compute with. `==` between
    two QuantizedArrays is Equinox's equality of modules (`eqx.tree_equal`). Its
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

    def _not_an_array(self, use: str) -> TypeError:
        label = f"`{self.name}`" if self.name else "this QuantizedArray"
        return TypeError(
            f"{use} is not supported: {label} is a {self.scheme}-quantised weight of shape "
            f"{self.shape}, not an array: only eqx_lean.quant.QuantizedLinear (or a LoRA adapter "
            "on one) computes with it. A QuantizedArray supports only `.dequantize(dtype)` (its "
            "values, as a dense array to compute with: `q.dequantize().T`), `.shape`, `.ndim`, "
            "`.dtype`, `.nbytes`, `.scales` and pytree operations (`jax.tree.map`, `jax.jit`, "
            "`eqx.filter_jit`, `eqx.tree_equal`, `==` between two QuantizedArrays). Quantise "
            "only linear layers that the model calls (`quantize_linears`)."
        )

    @staticmethod
    def _refusing(use: str) -> Any:
        def refuse(self: "QuantizedArray", *_: Any, **__: Any) -> Any:
            raise self._not_an_array(use)

        return refuse

    # A property, not a method: `jnp.asarray` and friends read it with `hasattr`, which passes
    # this `TypeError` on (an `AttributeError` it would swallow), and JAX's primitives
    # (`jax.lax.dot`), which refuse any object that has a `__jax_array__` method with a
    # `ValueError` telling the user to convert it with `jnp.array`, find none and give a
    # `TypeError` naming the type instead, caused by this class's sentence (registered below).
    # `eqx.is_array_like` of a QuantizedArray raises it too, rightly: it is no array.
    @property
    def __jax_array__(self) -> Any:
        raise self._not_an_array("Converting it to a JAX array")

    __array__ = _refusing("Converting it to a NumPy array")
    __matmul__ = __rmatmul__ = _refusing("`@`")
    __mul__ = __rmul__ = _refusing("`*`")
    __add__ = __radd__ = _refusing("`+`")
    __sub__ = __rsub__ = _refusing("`-`")
    __truediv__ = __rtruediv__ = _refusing("`/`")
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _refusing("`//` or `%`")
    __pow__ = __rpow__ = _refusing("`**`")
    __neg__ = __pos__ = __abs__ = __invert__ = _refusing("A unary operator (`-`, `+`, `abs`, `~`)")
    __lt__ = __le__ = __gt__ = __ge__ = _refusing("Comparing it (`<`, `<=`, `>`, `>=`)")
    __getitem__ = _refusing("Indexing it")
    __len__ = _refusing("`len`")
    __bool__ = _refusing("`bool` (or `if`, `and`, `or`)")
    __float__ = __int__ = __complex__ = __index__ = _refusing("Converting it to a Python number")
    astype = _refusing("`.astype`")
    reshape = _refusing("`.reshape`")
    transpose = _refusing("`.transpose`")
    ravel = flatten = squeeze = swapaxes = _refusing("Reshaping it")
    sum = mean = max = min = _refusing("Reducing it")
    item = tolist = _refusing("Reading its values")

    @property
    def T(self) -> Any:
        raise self._not_an_array("`.T`")

    @property
    def mT(self) -> Any:
        raise self._not_an_array("`.mT`")

    @property
    def at(self) -> Any:
        raise self._not_an_array("`.at`")

    def __eq__(self, other: object, /) -> Any:
        """Equinox's equality of modules (`eqx.tree_equal`, one bool), which JAX and Equinox
        use for static fields and caches; compared with an array or a number, a `TypeError`:
        a QuantizedArray has no elements to compare."""
        if isinstance(other, jax.Array | np.ndarray | np.generic | int | float | complex):
            raise self._not_an_array("Comparing it with `==` or `!=` to an array or a number")
        return super().__eq__(other)

    # Defining `__eq__` drops the inherited hash: keep Equinox's (static fields, jit caches).
    __hash__ = eqx.Module.__hash__


refuse_as_jax_value(
    QuantizedArray, lambda q: q._not_an_array("Passing it to a JAX primitive (`jax.lax.dot`, ...)")
)


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
    whatever their sign; an int8 channel holding a NaN or an infinity has a NaN or infinite
    scale and codes 0, and decodes to NaN throughout (bitsandbytes' `int8_vectorwise_quant`).
    An int8 tensor with no output channels (shape `(0, n)`) gives an empty QuantizedArray, as
    bitsandbytes does; channels with no values are refused. Decoding is plain float32
    arithmetic: a decoded value below 2^-126 (in an NF4 block whose scale is below about
    2^-122) is zero on XLA:CPU, which flushes it.
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
    batch_dims = arguments.integer(batch_dims, "`batch_dims`", minimum=0, maximum=x.ndim)
    # Checked for int8 too, which does not use it: `blocksize=True` is a mistake either way.
    blocksize = arguments.integer(blocksize, "`blocksize`", minimum=1)
    shape = tuple(x.shape[batch_dims:])
    source_dtype = np.dtype(x.dtype)
    if scheme == "nf4":
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
        if 0 in shape[1:]:
            # No output channel is fine (an empty QuantizedArray, as bitsandbytes'
            # `int8_vectorwise_quant` gives for shape (0, n)); a channel of no values has no
            # scale, and bitsandbytes fails on it (a `ZeroDivisionError`).
            raise ValueError(
                f"int8 needs output channels with values: `x` (shape {tuple(x.shape)}, "
                f"batch_dims={batch_dims}) has tensors of shape {shape}, whose channels (the "
                "first axis) hold no values; a channel's scale is its largest magnitude."
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
