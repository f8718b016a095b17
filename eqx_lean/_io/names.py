"""Tensor names: templates such as `"model.layers.{i}.mlp.up_proj.weight"`, one per leaf."""

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._core import PATH_CONVENTION, KeyPath, Layout, describe_raised, rule_error


LAYER = "{i}"
"""The placeholder for the layer index in a tensor-name template."""


@dataclasses.dataclass(frozen=True)
class TensorName:
    """Where a leaf is stored in a checkpoint: a tensor name, and the order of its axes.

    A plain `str` in `names` is shorthand for `TensorName(name)`.

    **Arguments:**

    - `name`: the tensor's name in the checkpoint. For a stacked leaf (one with a leading layer
        axis) it is a template in which `{i}` stands for the layer index, such as
        `"model.layers.{i}.mlp.up_proj.weight"`; each layer is then its own tensor. A name
        without `{i}` is one tensor holding the whole leaf.
    - `transpose`: how the stored axes map to the leaf's axes (per layer, for a stacked leaf):
        the leaf is `stored.transpose(transpose)`, and saving stores the inverse permutation.
        `None` means the same order. (Hugging Face stores a linear weight as `[out, in]`, as
        `eqx.nn.Linear` does, so that needs none; a kernel kept as `[in, out]` needs `(1, 0)`.)
    """

    name: str
    transpose: tuple[int, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"`TensorName.name` must be a non-empty string; got {self.name!r}.")
        if self.transpose is not None:
            given = self.transpose
            # Integers only (NumPy's too): `int()` would truncate 1.5 and take True for 1.
            integral = (
                isinstance(given, Sequence)
                and not isinstance(given, str)
                and all(
                    isinstance(a, int | np.integer) and not isinstance(a, bool | np.bool_)
                    for a in given
                )
            )
            axes = tuple(int(a) for a in given) if integral else ()
            if not integral or sorted(axes) != list(range(len(axes))):
                raise ValueError(
                    "`TensorName.transpose` must be a permutation of the axes 0..n-1 given as "
                    f"integers, such as (1, 0); got {self.transpose!r} for {self.name!r}."
                )
            object.__setattr__(self, "transpose", axes)

    @property
    def stacked(self) -> bool:
        return LAYER in self.name

    def at(self, layer: int | None) -> str:
        return self.name if layer is None else self.name.replace(LAYER, str(layer))

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape a tensor of (per-layer) leaf shape `shape` has in the file."""
        if self.transpose is None:
            return shape
        stored = [0] * len(shape)
        for axis, size in zip(self.transpose, shape, strict=True):
            stored[axis] = size
        return tuple(stored)


def split_layer(tensor_name: str, prefix: str) -> tuple[int, str] | None:
    """Reads the layer index of a per-layer tensor's name: the one parser of the package.

    **Arguments:**

    - `tensor_name`: a tensor's name in a checkpoint, such as `"model.layers.12.mlp.w"`.
    - `prefix`: the text before `{i}` in the name's template, such as `"model.layers."`.

    **Returns:**

    `(layer, rest)`: the index written in ASCII digits right after `prefix` (`12`), and the rest
    of the name after them (`".mlp.w"`); `None` if `tensor_name` does not start with `prefix`
    followed by a digit.
    """
    if not tensor_name.startswith(prefix):
        return None
    after = tensor_name[len(prefix) :]
    digits = len(after) - len(after.lstrip("0123456789"))
    if not digits:
        return None
    return int(after[:digits]), after[digits:]


def stored_layer_count(tensor_names: Iterable[str], prefix: str) -> int:
    """How many layers tensors named `<prefix><n>.…` hold.

    **Arguments:**

    - `tensor_names`: the names of a checkpoint's tensors.
    - `prefix`: the text before the layer index, such as `"model.layers."`.

    **Returns:**

    One more than the highest index `n` of a name `<prefix><n>` or `<prefix><n>.…` (the index
    a whole dotted part of the name, as `split_layer` reads it); 0 where no name is one.
    """
    held = 0
    for name in tensor_names:
        found = split_layer(name, prefix)
        if found is not None and found[1][:1] in ("", "."):
            held = max(held, found[0] + 1)
    return held


def _is_name_leaf(x: Any) -> bool:
    return x is None or isinstance(x, str | TensorName)


def _as_name(value: Any, path: KeyPath, where: str) -> TensorName | None:
    if value is None or isinstance(value, TensorName):
        return value
    if isinstance(value, str):
        return TensorName(value)
    raise TypeError(
        f"{where} must be a str, an `eqx_lean.TensorName` or None for leaf "
        f"{jax.tree_util.keystr(path)}; got {type(value).__name__} ({value!r:.80})."
    )


# What the path a `names` function gets is relative to, in each function that takes one.
_RELATIVE_TO = {
    "load_stacked": "`like`, the stacked layers: one layer's paths, such as `.mlp.weight`",
    "save_stacked": "`stacked`, the stacked layers: one layer's paths, such as `.mlp.weight`",
    "load_tensors": "`like`, the whole model, such as `.blocks.mlp.weight`",
    "save_tensors": "`tree`, the whole model, such as `.blocks.mlp.weight`",
}


def _call_names(names: Any, path: KeyPath, leaf: Any, fn: str | None) -> Any:
    try:
        return names(path, leaf)
    except Exception as e:
        where = f"The `names` function of {fn}" if fn else "The `names` function"
        relative = f"{fn} gives it paths relative to {_RELATIVE_TO[fn]}. " if fn else ""
        raise rule_error(
            e,
            f"{where} raised {describe_raised(e)} for leaf {jax.tree_util.keystr(path)} "
            f"({leaf.dtype}{list(leaf.shape)}). {relative}A name map written for "
            "load_stacked/save_stacked (one layer's paths) does not serve load_tensors/"
            f"save_tensors (the whole model's paths), nor the reverse. {PATH_CONVENTION}",
        ) from e


def resolve_names(names: Any, layout: Layout, fn: str | None = None) -> list[TensorName | None]:
    """One name (or None: not stored) per array leaf of `layout`.

    `fn` is the public function resolving them, named in the message when `names` raises.
    """
    if callable(names) and not isinstance(names, eqx.Module):
        return [
            _as_name(_call_names(names, path, leaf, fn), path, "The `names` rule's result")
            for path, leaf in zip(layout.paths, layout.structs, strict=True)
        ]
    flat = dict(jax.tree_util.tree_flatten_with_path(names, is_leaf=_is_name_leaf)[0])
    resolved = []
    for path in layout.paths:
        if path not in flat:
            raise ValueError(
                "`names` must give a name (a str, an `eqx_lean.TensorName`, or None for a leaf "
                "that is not stored) at every array leaf of the model, in a pytree of the same "
                f"structure (e.g. built with `eqx.tree_at`), but it has none at leaf "
                f"{jax.tree_util.keystr(path)}. A function `(path, leaf) -> name` works too. "
                f"{PATH_CONVENTION}"
            )
        resolved.append(_as_name(flat[path], path, "`names`"))
    return resolved


def layer_count(layout: Layout, tensor_names: Sequence[TensorName | None]) -> int | None:
    """The length of the layer axis shared by every stacked leaf (None if there is none)."""
    lengths: dict[int, KeyPath] = {}
    for path, leaf, name in zip(layout.paths, layout.structs, tensor_names, strict=True):
        if name is None or not name.stacked:
            continue
        if len(leaf.shape) == 0:
            raise ValueError(
                f"Leaf {jax.tree_util.keystr(path)} is a scalar, so it has no layer axis, but its "
                f"name {name.name!r} contains {LAYER}: a stacked leaf must have a leading layer "
                "axis."
            )
        lengths.setdefault(leaf.shape[0], path)
    if len(lengths) > 1:
        found = ", ".join(f"{n} at {jax.tree_util.keystr(p)}" for n, p in lengths.items())
        raise ValueError(
            f"Every leaf whose name contains {LAYER} must have the same leading layer axis, "
            f"but found several lengths: {found}."
        )
    return next(iter(lengths), None)


def require_all_stacked(layout: Layout, tensor_names: Sequence[TensorName | None], fn: str):
    for path, name in zip(layout.paths, tensor_names, strict=True):
        if name is not None and not name.stacked:
            raise ValueError(
                f"`{fn}` needs every name to be a template with {LAYER} for the layer index, but "
                f"leaf {jax.tree_util.keystr(path)} is named {name.name!r}. For a model with "
                "plain tensors too (embedding, final norm, head), use "
                f"`{fn.replace('stacked', 'tensors')}`, which takes both kinds of name."
            )


def check_transpose_rank(path: KeyPath, name: TensorName, shape: tuple[int, ...]) -> None:
    if name.transpose is not None and len(name.transpose) != len(shape):
        raise ValueError(
            f"`TensorName.transpose` for {name.name!r} (leaf {jax.tree_util.keystr(path)}) must "
            f"permute all {len(shape)} axes of the leaf's shape {list(shape)}"
            f"{' per layer' if name.stacked else ''}; got {name.transpose}."
        )
