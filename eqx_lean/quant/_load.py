"""Quantising stacked weights as they stream from a checkpoint: never a full-precision stack.

Each layer's tensor is read from the memory map of its file a few rows at a time; each chunk
is cast to the model's dtype, quantised, and its codes and scales written into the stacked
buffers (allocated once, in their final size) by compiled writes that donate them. NF4 blocks
are runs of consecutive values of the row-major tensor, so a chunk of whole blocks quantises
exactly as the whole tensor would; only the last chunk can hold a partial block, as the whole
tensor's last block. With double quantisation, a layer's block scales (4 bytes a block, a few
MiB) are kept until its last chunk, then double-quantised and written.
"""

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

from .._core.sharding import explicit_part, has_explicit_axes
from .._io.safetensors import Maps
from .._io.snapshot import Checkpoint
from ._array import DoubleQuantizedScales, QuantizedArray, _bits, double_quantize
from ._int8 import int8_encode
from ._linear import QuantConfig
from ._nf4 import nf4_encode, num_blocks
from ._ops import widen_exactly
from ._sharding import UNPLACED, QuantizedShardings, place_scales


# Values quantised per compiled call: 4 Mi values (8 MiB of bfloat16, 16 MiB in float32).
# Test seam: tests/test_quant_load.py and test_quant_hf.py make chunks tiny.
_CHUNK_VALUES = 4 * 2**20


def _write(buffer: jax.Array, value: jax.Array, layer: jax.Array, start: jax.Array) -> jax.Array:
    """`buffer` (donated) with `value` written at `[layer, start, 0...]`."""
    sharding = buffer.sharding
    if not isinstance(sharding, NamedSharding) or not has_explicit_axes(sharding):
        return _writer(None)(buffer, value, layer, start)
    # On a mesh mixing Explicit and Auto axes, the type names only the Explicit ones.
    return _writer(explicit_part(sharding))(buffer, value, layer, start)


@functools.cache  # one program per explicit sharding: the sharding determines the program
def _writer(explicit: Any) -> Any:
    def write(buffer: jax.Array, value: jax.Array, layer: jax.Array, start: jax.Array) -> Any:
        index = (layer, start) + (0,) * (buffer.ndim - 2)
        return lax.dynamic_update_slice(buffer, value[None], index)

    if explicit is not None:
        # With Explicit mesh axes, an update must carry the buffer's sharding: the write is
        # traced with the axes made Auto, and its result given the buffer's sharding again.
        return jax.jit(jax.sharding.auto_axes(write, out_sharding=explicit), donate_argnums=0)
    return jax.jit(write, donate_argnums=0)


# Test seam: tests/test_quant_load.py records the calls (none on a refused load).
@functools.partial(jax.jit, static_argnames=("dtype", "scheme", "blocksize"))
def _encode(chunk: jax.Array, dtype: Any, scheme: str, blocksize: int) -> tuple[Any, Any]:
    values = widen_exactly(chunk.astype(dtype))
    if scheme == "nf4":
        return nf4_encode(values, blocksize)
    return int8_encode(values)


@jax.jit
def _nested(scales: jax.Array) -> DoubleQuantizedScales:
    return double_quantize(scales)


def _rows_per_chunk(shape: tuple[int, ...], blocksize: int) -> int:
    """Rows per chunk: about `_CHUNK_VALUES` values, whole NF4 blocks (of an even count)."""
    row = math.prod(shape[1:])
    step = blocksize // math.gcd(row, blocksize) if blocksize else 1
    return max(step, _CHUNK_VALUES // row // step * step)


def load_quantized_stack(
    checkpoint: Checkpoint,
    tensor_names: Sequence[str],
    shape: tuple[int, ...],
    dtype: Any,
    config: QuantConfig,
    name: str,
    shardings: QuantizedShardings = UNPLACED,
) -> QuantizedArray:
    """The stack of the tensors `tensor_names` (one per layer), quantised as it streams.

    **Arguments:**

    - `checkpoint`: the opened checkpoint.
    - `tensor_names`: each layer's tensor, in order.
    - `shape`: one tensor's shape (`[out, in]`), checked against the file by the caller.
    - `dtype`: the dtype values are cast to before quantising (the model's).
    - `config`: the [`eqx_lean.quant.QuantConfig`][].
    - `name`: what error messages call the weight.
    - `shardings`: where the stacked codes and scales are placed (from
        `eqx_lean.quant._sharding.quantized_shardings`); unplaced by default.

    **Returns:**

    The stacked [`eqx_lean.quant.QuantizedArray`][], equal to `config.quantize(stack,
    batch_dims=1)` of the full-precision stack cast to `dtype`.
    """
    count, size = len(tensor_names), math.prod(shape)
    nf4 = config.scheme == "nf4"
    blocksize = config.blocksize if nf4 else 0
    if nf4:
        codes = jnp.zeros((count, -(-size // 2)), jnp.uint8, device=shardings.codes)
        scale_count = num_blocks(size, blocksize)
    else:
        codes = jnp.zeros((count, *shape), jnp.int8, device=shardings.codes)
        scale_count = shape[0]
    scales = None
    if not config.double_quant:
        scales = jnp.zeros((count, scale_count), jnp.uint32, device=shardings.scales)
    nested: list[Any] = []
    rows = _rows_per_chunk(shape, blocksize)
    row_size = size // shape[0]
    maps = Maps(checkpoint.fds)
    try:
        for position, tensor_name in enumerate(tensor_names):
            tensor = checkpoint.tensors[tensor_name]
            stored = maps.view(tensor)
            layer_scales = []
            at = jnp.int32(position)
            for first in range(0, shape[0], rows):
                chunk = jnp.asarray(np.ascontiguousarray(stored[first : first + rows]))
                if nf4:
                    chunk = chunk.reshape(-1)
                chunk_codes, chunk_scales = _encode(
                    chunk, jnp.dtype(dtype), config.scheme, blocksize
                )
                start = first * row_size // 2 if nf4 else first
                codes = _write(codes, chunk_codes, at, jnp.int32(start))
                scale_start = first * row_size // blocksize if nf4 else first
                if scales is not None:
                    scales = _write(scales, _bits(chunk_scales), at, jnp.int32(scale_start))
                else:
                    layer_scales.append(chunk_scales)
            # Dispatch is asynchronous: the loop would run ahead of the quantising, and pages
            # released here would fault back in when a queued chunk is read. Measured at 7B:
            # 0.5 GiB more of the file resident at the peak without this wait.
            jax.block_until_ready((codes, scales, layer_scales))
            maps.release(tensor)
            if scales is None:
                nested.append(_nested(jnp.concatenate(layer_scales)))
    finally:
        maps.close()
    if scales is None:
        stacked: Any = jax.tree.map(lambda *xs: jnp.stack(xs), *nested)
        stacked = place_scales(stacked, shardings)
    else:
        stacked = scales
    return QuantizedArray(
        codes, stacked, tuple(shape), config.scheme, blocksize, np.dtype(dtype), name
    )
