"""The initializers `eqx_lean.init.chunked` can cut into tiles, and how each draws one tile.

Each `jax.nn.initializers` factory returns a closure; its code object says which factory made
it, whatever the settings, and (for `variance_scaling`) its cells hold those settings. That is
how an initializer that can be cut into tiles is told from one that cannot.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jaxtyping import PRNGKeyArray


_INITIALIZERS = jax.nn.initializers


def _code_of(factory_result: Any) -> Any:
    return factory_result.__code__


_VARIANCE_SCALING_CODE = _code_of(_INITIALIZERS.variance_scaling(1.0, "fan_in", "normal"))
_SHAPE_FREE_CODES = {
    _code_of(_INITIALIZERS.normal()): "normal",
    _code_of(_INITIALIZERS.uniform()): "uniform",
    _code_of(_INITIALIZERS.truncated_normal()): "truncated_normal",
    _code_of(_INITIALIZERS.constant(0.0)): "constant",
}
_SHAPE_FREE_FUNCTIONS = {
    _INITIALIZERS.zeros: "zeros",
    _INITIALIZERS.ones: "ones",
    jax.random.normal: "jax.random.normal",
    jax.random.uniform: "jax.random.uniform",
}
_COUPLED_CODES = {
    _code_of(_INITIALIZERS.orthogonal()): "orthogonal",
    _code_of(_INITIALIZERS.delta_orthogonal()): "delta_orthogonal",
}


#
# Drawing one tile
#


@dataclasses.dataclass(frozen=True)
class _ShapeFreeTiles:
    """Tiles of an initializer whose elements are i.i.d. with a law that ignores the shape."""

    initializer: Callable[..., Any]

    def draw(self, key: PRNGKeyArray, shape: tuple[int, ...], tile: tuple[int, ...], dtype: Any):
        del shape
        if dtype is None:
            return self.initializer(key, tile)
        return self.initializer(key, tile, dtype)


@dataclasses.dataclass(frozen=True)
class _VarianceScalingTiles:
    """Tiles of `jax.nn.initializers.variance_scaling`, at the variance of the whole tensor.

    `variance_scaling` computes its variance `scale / n` from the shape it is called with, where
    `n` is a fan of that shape. A tile is drawn by JAX's own `variance_scaling`, configured so that
    the fan it computes for the tile is the tile's size and its scale is rescaled by
    `tile size / n(full shape)`: the tile's elements then follow exactly the law the plain
    initializer gives the full tensor.
    """

    scale: float
    mode: str
    distribution: str
    in_axis: Any
    out_axis: Any
    batch_axis: Any
    default_dtype: Any

    def draw(self, key: PRNGKeyArray, shape: tuple[int, ...], tile: tuple[int, ...], dtype: Any):
        tile_size = math.prod(tile)
        scale = float(self.scale) * tile_size / self._denominator(shape)
        per_tile = _INITIALIZERS.variance_scaling(
            scale,
            "fan_in",
            self.distribution,  # pyright: ignore[reportArgumentType]
            in_axis=tuple(range(len(tile))),
            out_axis=(),
            batch_axis=(),
            dtype=self.default_dtype,
        )
        if dtype is None:
            return per_tile(key, tile)
        return per_tile(key, tile, dtype)

    def _denominator(self, shape: tuple[int, ...]) -> float:
        fan_in, fan_out = _fans(shape, self.in_axis, self.out_axis, self.batch_axis)
        if self.mode == "fan_in":
            return fan_in
        if self.mode == "fan_out":
            return fan_out
        if self.mode == "fan_avg":
            return (fan_in + fan_out) / 2
        if self.mode == "fan_geo_avg":
            return (fan_in * fan_out) ** 0.5
        raise ValueError(
            "`initializer` must have a variance-scaling mode of 'fan_in', 'fan_out', 'fan_avg' or "
            f"'fan_geo_avg'; got {self.mode!r}."
        )


def _axes_size(shape: tuple[int, ...], axes: int | Sequence[int]) -> int:
    if isinstance(axes, int):
        return shape[axes]
    return math.prod(shape[i] for i in axes)


def _fans(
    shape: tuple[int, ...], in_axis: Any, out_axis: Any, batch_axis: Any
) -> tuple[float, float]:
    """Fan-in and fan-out of a weight shape, as `jax.nn.initializers.variance_scaling` defines them.

    Axes outside `in_axis`, `out_axis` and `batch_axis` form the receptive field of a convolution.
    """
    if isinstance(in_axis, int) and in_axis == -2 and len(shape) <= 1:
        raise ValueError(
            f"`shape` must have at least 2 axes for this variance-scaling initializer (its fan-in "
            f"is taken from axis -2 by default); got {shape}. Pass `in_axis` explicitly to the "
            "initializer's factory to use it on a vector."
        )
    in_size = _axes_size(shape, in_axis)
    out_size = _axes_size(shape, out_axis)
    batch_size = _axes_size(shape, batch_axis)
    receptive_field = math.prod(shape) / in_size / out_size / batch_size
    return in_size * receptive_field, out_size * receptive_field


def _closure(fn: Any) -> dict[str, Any]:
    return {
        name: cell.cell_contents
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True)
    }


def _variance_scaling_tiles(initializer: Any) -> _VarianceScalingTiles:
    found = _closure(initializer)
    names = ("scale", "mode", "distribution", "in_axis", "out_axis", "batch_axis")
    if not all(name in found for name in names):  # pragma: no cover - depends on JAX internals
        raise TypeError(
            "`initializer` looks like a `jax.nn.initializers.variance_scaling` initializer, but "
            f"this JAX version stores its settings differently ({sorted(found)}); please report it."
        )
    defaults = initializer.__defaults__ or (None,)
    return _VarianceScalingTiles(
        scale=float(found["scale"]),
        mode=found["mode"],
        distribution=found["distribution"],
        in_axis=_hashable_axes(found["in_axis"]),
        out_axis=_hashable_axes(found["out_axis"]),
        batch_axis=_hashable_axes(found["batch_axis"]),
        default_dtype=defaults[0],
    )


def _hashable_axes(axes: int | Sequence[int]) -> int | tuple[int, ...]:
    return axes if isinstance(axes, int) else tuple(axes)


def tiles_of(initializer: Any, elementwise: bool) -> Any:
    if not callable(initializer):
        raise TypeError(
            "`initializer` must be a callable `(key, shape, dtype) -> array`, such as "
            f"`jax.nn.initializers.lecun_normal()`; got {type(initializer).__name__}."
        )
    code = getattr(initializer, "__code__", None)
    if code is _VARIANCE_SCALING_CODE:
        return _variance_scaling_tiles(initializer)
    if code in _COUPLED_CODES:
        raise ValueError(
            f"`initializer` (`jax.nn.initializers.{_COUPLED_CODES[code]}`) cannot be chunked: its "
            "elements are not independent (it orthogonalises the whole matrix), so no tile can be "
            "drawn without the others. Use the plain initializer."
        )
    if elementwise or code in _SHAPE_FREE_CODES or _is_known_function(initializer):
        return _ShapeFreeTiles(initializer)
    raise TypeError(
        "`initializer` must be one that `chunked` can cut into tiles: a "
        "`jax.nn.initializers` initializer (normal, uniform, truncated_normal, constant, zeros, "
        "ones, or any variance-scaling one such as lecun_normal, glorot_uniform or he_normal), "
        "`jax.random.normal` or `jax.random.uniform`; got "
        f"{getattr(initializer, '__qualname__', repr(initializer))}. If it draws every element "
        "independently from one distribution that does not depend on the shape it is asked for, "
        "pass `elementwise=True`."
    )


def _is_known_function(initializer: Any) -> bool:
    try:
        return initializer in _SHAPE_FREE_FUNCTIONS
    except TypeError:  # unhashable callables
        return False
