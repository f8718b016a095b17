"""What a checkpoint must hold for a load: every named tensor, of the right shape and dtype,
the model's layer count, and no tensor that nothing loads.

Everything here reads only headers, and runs before anything is allocated.
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from .._core import KeyPath, is_floating
from .names import LAYER, TensorName, split_layer
from .snapshot import Checkpoint


IGNORED_BUFFERS = ("rotary_emb.inv_freq",)
"""Tensors a strict load accepts unmapped: buffers that `transformers` computes from the
config and that some checkpoints store anyway (names ending with one of these after a dot)."""

_SHOWN = 5  # names listed in a message, before "and N more"


class Leaf(NamedTuple):
    path: KeyPath
    struct: jax.ShapeDtypeStruct  # the loaded leaf: full shape, the dtype it is loaded as
    name: TensorName | None  # None: not stored, `source` is returned as is
    source: Any
    sharding: jax.sharding.Sharding | None


def describe_leaf(leaf: Leaf) -> str:
    return jax.tree_util.keystr(leaf.path)


def _listed(names: Sequence[str], checkpoint: Checkpoint | None = None) -> str:
    def one(name: str) -> str:
        if checkpoint is None:
            return repr(name)
        return f"{name!r} (in {checkpoint.tensors[name].file.name})"

    shown = ", ".join(one(n) for n in names[:_SHOWN])
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return shown + more


def select_layers(layers: Any, num_layers: int | None) -> tuple[int, ...] | None:
    """The checkpoint layer loaded into each layer of `like` (None: no stacked leaf)."""
    if layers is None:
        return None if num_layers is None else tuple(range(num_layers))
    if num_layers is None:
        raise ValueError(
            f"`layers` chooses the checkpoint layers of the leaves named with {LAYER}, but no "
            f"leaf of `like` is named with {LAYER}."
        )
    if isinstance(layers, bool) or not isinstance(layers, int | range):
        raise TypeError(
            "`layers` must be an int N (the checkpoint's first N layers) or a `range` of "
            f"checkpoint layers; got {layers!r}."
        )
    selected = range(layers) if isinstance(layers, int) else layers
    if len(selected) == 0 or min(selected) < 0:
        raise ValueError(
            f"`layers` must select at least one layer, with non-negative indices; got {layers!r}."
        )
    if len(selected) != num_layers:
        raise ValueError(
            f"`layers` selects {len(selected)} checkpoint layers ({layers!r}), but the stacked "
            f"leaves of `like` have {num_layers}: it must select one checkpoint layer per layer "
            "of `like`."
        )
    return tuple(selected)


def _tensor_problems(
    leaf: Leaf, checkpoint: Checkpoint, selected: Sequence[int] | None
) -> tuple[list[str], list[str]]:
    """The missing tensor names and the mismatch messages for one leaf."""
    assert leaf.name is not None
    stacked = leaf.name.stacked
    per_layer_shape = leaf.struct.shape[1:] if stacked else leaf.struct.shape
    expected_shape = leaf.name.stored_shape(per_layer_shape)
    layers: Sequence[int | None] = (selected or ()) if stacked else [None]
    missing, mismatched = [], []
    first_of_dtype: dict[str, str] = {}  # each stored dtype, with the first tensor stored in it
    for layer in layers:
        tensor_name = leaf.name.at(layer)
        tensor = checkpoint.tensors.get(tensor_name)
        if tensor is None:
            missing.append(tensor_name)
            continue
        first_of_dtype.setdefault(str(tensor.dtype), tensor_name)
        where = f"Tensor {tensor_name!r} (for leaf {describe_leaf(leaf)}) in {tensor.file}"
        if tensor.shape != expected_shape:
            transposed = f", stored transposed by {leaf.name.transpose}" * bool(leaf.name.transpose)
            mismatched.append(
                f"{where} has shape {list(tensor.shape)}; expected {list(expected_shape)} "
                f"(the leaf's shape{' per layer' if stacked else ''}{transposed})."
            )
        dtype = leaf.struct.dtype
        if is_floating(dtype) and not is_floating(tensor.dtype):
            mismatched.append(
                f"{where} has dtype {tensor.dtype}; expected a floating dtype, cast to {dtype}."
            )
        elif not is_floating(dtype) and tensor.dtype != dtype:
            mismatched.append(
                f"{where} has dtype {tensor.dtype}; expected {dtype} (only floating tensors are "
                "cast)."
            )
    if len(first_of_dtype) > 1:
        # A stacked leaf is filled from one stored dtype (compiled writes stage every layer in
        # it), so layers stored in different dtypes are refused, on every platform alike.
        shown = ", ".join(f"{dtype} ({name!r})" for dtype, name in first_of_dtype.items())
        mismatched.append(
            f"The tensors for leaf {describe_leaf(leaf)} are stored in different dtypes across "
            f"layers: {shown}; every layer of a stacked leaf must be stored in one dtype."
        )
    return missing, mismatched


def _layer_prefixes(leaves: Sequence[Leaf]) -> set[str]:
    """The text before `{i}` in every stacked name: a tensor named that, then a number, is
    one layer's tensor."""
    return {leaf.name.name.split(LAYER)[0] for leaf in leaves if leaf.name and leaf.name.stacked}


def layer_of(tensor_name: str, prefixes: set[str]) -> int | None:
    """The layer index of a tensor whose name follows a template's pattern, else None."""
    for prefix in prefixes:
        found = split_layer(tensor_name, prefix)
        if found is not None:
            return found[0]
    return None


def _example(prefixes: set[str]) -> str:
    return f"{sorted(prefixes)[0]}{LAYER}…"


def check_layers(
    leaves: Sequence[Leaf], checkpoint: Checkpoint, selected: Sequence[int], layers_given: bool
) -> int:
    """Checks the layer count; returns the number of layers the checkpoint holds."""
    prefixes = _layer_prefixes(leaves)
    found = [layer_of(name, prefixes) for name in checkpoint.tensors]
    held = 1 + max((x for x in found if x is not None), default=-1)
    example = _example(prefixes)
    if layers_given:
        beyond = [x for x in selected if x >= held]
        if beyond:
            raise ValueError(
                f"`layers` selects checkpoint layer {max(beyond)}, but the checkpoint "
                f"({checkpoint.describe()}) holds {held} layers (tensors named {example!r})."
            )
    elif held > len(selected):
        raise ValueError(
            f"The checkpoint ({checkpoint.describe()}) holds {held} layers (tensors named "
            f"{example!r} up to layer {held - 1}), but the stacked leaves of `like` have "
            f"{len(selected)}: a load never drops layers silently. Pass `layers={len(selected)}` "
            f"(or a `range` of {len(selected)} checkpoint layers) to load only some of them."
        )
    return held


def check_tensors(
    leaves: Sequence[Leaf], checkpoint: Checkpoint, selected: Sequence[int] | None, held: int
) -> None:
    """Every named tensor is present, with the shape and dtype its leaf needs."""
    missing, mismatched = [], []
    for leaf in leaves:
        if leaf.name is not None:
            m, mm = _tensor_problems(leaf, checkpoint, selected)
            missing += m
            mismatched += mm
    if missing:
        counts = ""
        if selected and held < len(selected):
            counts = (
                f" The checkpoint holds {held} layers; the stacked leaves of `like` have "
                f"{len(selected)}."
            )
        raise KeyError(
            f"The checkpoint ({checkpoint.describe()}) must hold every tensor that `names` "
            f"refers to, but {len(missing)} are missing: {_listed(missing)}.{counts}"
        )
    if mismatched:
        more = f" ({len(mismatched) - 1} more mismatches follow it)" if len(mismatched) > 1 else ""
        raise ValueError(mismatched[0] + more)


def is_ignored(tensor_name: str) -> bool:
    return any(tensor_name == b or tensor_name.endswith("." + b) for b in IGNORED_BUFFERS)


def check_unmapped(
    leaves: Sequence[Leaf],
    checkpoint: Checkpoint,
    selected: Sequence[int] | None,
    whole_model: bool,
) -> None:
    """No tensor is left unloaded: per-layer tensors of the loaded layers (following a
    template's pattern) and, for a whole-model load, every other tensor too."""
    mapped: set[str] = set()
    for leaf in leaves:
        if leaf.name is not None:
            layers = (selected or ()) if leaf.name.stacked else [None]
            mapped.update(leaf.name.at(layer) for layer in layers)
    prefixes = _layer_prefixes(leaves)
    loaded_layers = set(selected or ())
    per_layer, other = [], []
    for name in checkpoint.tensors:
        if name in mapped or is_ignored(name):
            continue
        layer = layer_of(name, prefixes)
        if layer is None:
            other.append(name)
        elif layer in loaded_layers:
            per_layer.append(name)
    if per_layer:
        raise ValueError(
            f"The checkpoint ({checkpoint.describe()}) holds {len(per_layer)} per-layer tensors "
            f"(named like the templates, {_example(prefixes)!r}) that no leaf of `like` is named "
            f"for: {_listed(per_layer, checkpoint)}. A load must use every tensor of the layers "
            "it loads: name a leaf for each, or pass `strict=False` to ignore them."
        )
    if whole_model and other:
        raise ValueError(
            f"The checkpoint ({checkpoint.describe()}) holds {len(other)} tensors that no leaf of "
            f"`like` is named for: {_listed(other, checkpoint)}. A whole-model load must use "
            "every tensor (buffers named '*.rotary_emb.inv_freq' excepted): name a leaf for "
            "each, or pass `strict=False` to load a part of the checkpoint."
        )


def check_checkpoint(
    leaves: Sequence[Leaf],
    checkpoint: Checkpoint,
    selected: Sequence[int] | None,
    layers_given: bool,
    strict: bool,
    fn: str,
) -> None:
    """Refuses a checkpoint whose layers or tensors do not fit the leaves to load (or, with
    `strict`, that holds tensors they leave out), before anything is read."""
    held = 0
    if selected is not None:
        held = check_layers(leaves, checkpoint, selected, layers_given=layers_given)
    check_tensors(leaves, checkpoint, selected, held)
    if strict:
        check_unmapped(leaves, checkpoint, selected, whole_model=fn == "load_tensors")
