"""Where a quantised weight's codes and scales go, given the sharding of the weight itself.

A load (`eqx_lean.load_tensors(..., quantize=...)`) resolves `sharding=` for a quantised weight
as for any leaf: the rule sees the weight `[*layers, out, in]`, so one sharding policy serves
a model loaded quantised or not. This module turns that sharding into the shardings of the
[`QuantizedArray`][]'s leaves, refusing one that would split a block of codes from its scale:

- NF4 stores each tensor's values row-major in blocks of `blocksize`, so its codes can be split
  only between rows (and layers). The mesh axes that the weight's sharding names for its
  tensor dimensions (output or input) split its rows, and each shard must hold whole blocks;
  codes and block scales are split at the same rows. The double-quantised scales' own scales
  (one per 256 blocks) and offsets are tiny and replicated across the shards of a tensor.
- int8 codes have the weight's shape and take its sharding; the per-row scales take the
  sharding of the output dimension.
"""

import math
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from .._core.sharding import axis_names
from ._array import DoubleQuantizedScales, is_quantized


_CODES, _SCALES = jax.tree_util.GetAttrKey("codes"), jax.tree_util.GetAttrKey("scale_bits")


class QuantizedShardings(NamedTuple):
    """The shardings of a [`QuantizedArray`][]'s leaves (`None`: unplaced)."""

    codes: Sharding | None
    scales: Sharding | None  # the block scales (single) or the nested codes (double)
    nested: Sharding | None  # double quantisation's scales and offsets


UNPLACED = QuantizedShardings(None, None, None)


def _shards(mesh: Any, entry: Any) -> int:
    return math.prod(mesh.shape[name] for name in axis_names(entry))


def quantized_shardings(
    sharding: Sharding | None,
    shape: tuple[int, ...],
    batch_dims: int,
    scheme: str,
    blocksize: int,
    name: str,
) -> QuantizedShardings:
    """The shardings of the codes and scales of a weight of `shape` sharded by `sharding`.

    **Arguments:**

    - `sharding`: the weight's whole sharding (layer axes included), or `None`.
    - `shape`: the weight's shape, `batch + (out, *in)`.
    - `batch_dims`: the number of batch (layer) axes.
    - `scheme`, `blocksize`: as the [`QuantConfig`][].
    - `name`: the weight, for error messages.

    **Returns:**

    A `QuantizedShardings`. A `ValueError` names the weight when its sharding cannot be kept
    by the quantised form.
    """
    if sharding is None or not isinstance(sharding, NamedSharding):
        # One device, or any sharding that places every leaf whole: valid for every shape.
        if sharding is not None and not sharding.is_fully_replicated:
            raise ValueError(
                f"`sharding` for the quantised weight `{name}` must be a NamedSharding (or place "
                f"it whole); got {sharding}."
            )
        return QuantizedShardings(sharding, sharding, sharding)
    mesh = sharding.mesh
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    batch, out_entry, in_entries = spec[:batch_dims], spec[batch_dims], spec[batch_dims + 1 :]
    out_features, row = shape[batch_dims], math.prod(shape[batch_dims + 1 :])
    if scheme == "int8":  # codes as the weight; one scale per row
        return QuantizedShardings(
            sharding, NamedSharding(mesh, PartitionSpec(*batch, out_entry)), None
        )
    # NF4 rows are the one dimension whose shards hold whole blocks: the mesh axes that split
    # the weight (on its output or its input dimension) split the rows of its codes.
    axes = tuple(a for entry in (out_entry, *in_entries) for a in axis_names(entry))
    rows_entry = None if not axes else axes[0] if len(axes) == 1 else axes
    rows_sharding = NamedSharding(mesh, PartitionSpec(*batch, rows_entry))
    shards = _shards(mesh, rows_entry)
    if out_features % shards or out_features // shards * row % blocksize:
        raise ValueError(
            f"`sharding` ({sharding.spec}) splits the NF4 weight `{name}` over {shards} devices, "
            f"which split its codes between rows ({out_features} rows of {row} values), and "
            f"each shard must hold whole rows and whole blocks of {blocksize} values, so that a "
            f"block's codes and its scale are on one device; {out_features} rows in {shards} "
            "shards do not. Shard it over fewer devices, or leave it unsharded."
        )
    whole = NamedSharding(mesh, PartitionSpec(*batch))
    return QuantizedShardings(rows_sharding, rows_sharding, whole)


def place_scales(scale_bits: Any, shardings: QuantizedShardings) -> Any:
    """A `QuantizedArray`'s `scale_bits` (an array, or `DoubleQuantizedScales`) placed as
    `shardings` says; as they are where `shardings` leaves them unplaced."""
    if shardings.scales is None:
        return scale_bits
    if isinstance(scale_bits, DoubleQuantizedScales):
        return DoubleQuantizedScales(
            jax.device_put(scale_bits.codes, shardings.scales),
            jax.device_put(scale_bits.absmax_bits, shardings.nested),
            jax.device_put(scale_bits.offset_bits, shardings.nested),
            scale_bits.blocksize,
        )
    return jax.device_put(scale_bits, shardings.scales)


def check_layer_shardings(layer: Any, shardings: dict[Any, Sharding | None]) -> None:
    """`build_stacked`'s check of a quantised layer's shardings (the rule saw the codes and
    scales themselves): each NF4 weight's codes and block scales must be split by the same mesh
    axes, each shard holding whole blocks. A `ValueError` names the weight otherwise.

    **Arguments:**

    - `layer`: one layer's abstract tree.
    - `shardings`: each leaf's per-layer sharding, by key path.
    """
    flat = jax.tree_util.tree_flatten_with_path(layer, is_leaf=is_quantized)[0]
    for path, node in flat:
        if not (is_quantized(node) and node.scheme == "nf4"):
            continue
        codes = shardings.get((*path, _CODES))
        scale_path = (*path, _SCALES) + ((_CODES,) if node.double_quantized else ())
        scales = shardings.get(scale_path)
        split = [_split_axes(s) for s in (codes, scales)]
        name = node.name or jax.tree_util.keystr(path)
        size = math.prod(node.tensor_shape)
        shards = _shards(codes.mesh, split[0]) if isinstance(codes, NamedSharding) else 1
        if split[0] != split[1] or size % (shards * node.blocksize):
            raise ValueError(
                f"`sharding` splits the NF4 codes of `{name}` over mesh axes {split[0]} and its "
                f"block scales over {split[1]}: they must be split alike, each shard holding "
                f"whole blocks of {node.blocksize} values ({size} values in {shards} shards), so "
                "that a block's codes and its scale are on one device."
            )


def _split_axes(sharding: Sharding | None) -> tuple[str, ...]:
    if not isinstance(sharding, NamedSharding):
        return ()
    return tuple(a for entry in sharding.spec for a in axis_names(entry))
