"""Memory-lean initialisers for single huge tensors: drawn tile by tile into a preallocated output.

A plain initializer such as `jax.nn.initializers.lecun_normal()` draws the whole tensor at once,
so XLA holds the random bits, the intermediate floats and the result together: about three times
the tensor. [`eqx_lean.init.chunked`][] instead cuts the tensor into a fixed grid of tiles and draws
a few tiles per loop step, each from its own key, writing them into an output buffer in place.

The tile grid is a function of the tensor's shape only (`_TILE_ELEMENTS` elements per tile), so
the values depend on the key, shape and dtype alone: not on `max_chunk_bytes` (how many tiles one
step draws) and not on how the output is sharded. With a sharded output, every device draws only
the tiles that overlap its own shard.
"""

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, PRNGKeyArray

from ._core import (
    CompiledCache,
    aval_key,
    axis_names,
    check_spec,
    closed_jaxpr_key,
    has_tracers,
    settings_key,
)
from ._init_tiles import tiles_of


# The tile size fixes the values: changing it changes every tensor drawn by `chunked`. 2**18
# elements (1 MiB in float32, a 512 x 512 tile of a matrix) keeps a tile's temporaries small
# while each draw is still large enough to run at full speed.
_TILE_ELEMENTS = 2**18

# One float32 tile per loop step: XLA's temporaries are then about 6 MiB per device.
_DEFAULT_MAX_CHUNK_BYTES = 2**20


#
# The tile grid
#


def _integer_root(n: int, degree: int) -> int:
    """The largest integer `x >= 1` with `x ** degree <= n`."""
    x = max(1, int(round(n ** (1 / degree))))
    while x > 1 and x**degree > n:
        x -= 1
    while (x + 1) ** degree <= n:
        x += 1
    return x


def _tile_shape(shape: tuple[int, ...], budget: int = _TILE_ELEMENTS) -> tuple[int, ...]:
    """A near-square tile of at most `budget` elements: short axes whole, the rest shared evenly.

    Square tiles keep the overlap between a tile and any shard boundary small, whichever axes the
    output is sharded along.
    """
    tile = [1] * len(shape)
    remaining = budget
    by_length = sorted(range(len(shape)), key=lambda axis: (shape[axis], axis))
    for position, axis in enumerate(by_length):
        side = _integer_root(remaining, len(shape) - position)
        tile[axis] = min(shape[axis], side)
        remaining //= tile[axis]
    return tuple(tile)


@dataclasses.dataclass(frozen=True)
class _AxisPlan:
    """How one axis of the output is cut into tiles and split between devices."""

    length: int
    tile: int
    mesh_axes: tuple[str, ...]
    shards: int

    @property
    def local(self) -> int:
        return self.length // self.shards

    @property
    def num_tiles(self) -> int:
        return -(-self.length // self.tile)

    @property
    def tiles_per_shard(self) -> int:
        """The most tiles any one shard overlaps along this axis."""
        return max(
            (start + self.local - 1) // self.tile - start // self.tile + 1
            for start in range(0, self.length, self.local)
        )


def _axis_plans(
    shape: tuple[int, ...], tile: tuple[int, ...], sharding: NamedSharding | None
) -> tuple[_AxisPlan, ...]:
    spec = tuple(sharding.spec) if sharding is not None else ()
    spec = spec + (None,) * (len(shape) - len(spec))
    plans = []
    for length, side, entry in zip(shape, tile, spec, strict=True):
        mesh_axes = axis_names(entry)
        shards = math.prod(sharding.mesh.shape[a] for a in mesh_axes) if sharding else 1
        plans.append(_AxisPlan(length, side, mesh_axes, shards))
    return tuple(plans)


#
# Filling the output
#


def _unravel(index: Array, sizes: Sequence[int]) -> list[Array]:
    digits = []
    for size in reversed(sizes):
        digits.append(index % size)
        index = index // size
    return digits[::-1]


def _ravel(digits: Sequence[Array], sizes: Sequence[int]) -> Array:
    flat = jnp.zeros((), jnp.int32)
    for digit, size in zip(digits, sizes, strict=True):
        flat = flat * size + digit
    return flat


def _write_tile(out: Array, tile: Array, local_start: Sequence[Array]) -> Array:
    """Writes the part of `tile` (placed at `local_start`, possibly outside) that lies in `out`.

    The window written has static size `min(tile, out)` per axis and is clamped into `out`; the
    tile is shifted into it through padding, and positions the tile does not cover keep `out`'s
    values, so tiles may be written in any order and any number of times.
    """
    window = tuple(min(t, o) for t, o in zip(tile.shape, out.shape, strict=True))
    window_start = [
        jnp.clip(start, 0, o - w)
        for start, o, w in zip(local_start, out.shape, window, strict=True)
    ]
    padded = jnp.pad(tile, [(w, w) for w in window])
    offsets = [w + ws - s for w, ws, s in zip(window, window_start, local_start, strict=True)]
    shifted = lax.dynamic_slice(padded, offsets, window)
    inside = jnp.ones(window, bool)
    for axis, (w, t, offset) in enumerate(zip(window, tile.shape, offsets, strict=True)):
        source = lax.broadcasted_iota(jnp.int32, window, axis) + offset - w
        inside = inside & (source >= 0) & (source < t)
    current = lax.dynamic_slice(out, window_start, window)
    return lax.dynamic_update_slice(out, jnp.where(inside, shifted, current), window_start)


def _draw_shard(
    key: PRNGKeyArray,
    tiles: Any,
    plans: tuple[_AxisPlan, ...],
    dtype: Any,
    out_dtype: Any,
    group: int,
) -> Array:
    """Draws this device's shard: every tile overlapping it, `group` tiles per loop step."""
    shape = tuple(p.length for p in plans)
    tile_shape = tuple(p.tile for p in plans)
    grid = tuple(p.num_tiles for p in plans)
    shard_start = [
        (lax.axis_index(p.mesh_axes) * p.local if p.mesh_axes else jnp.zeros((), jnp.int32))
        for p in plans
    ]
    first_tile = [start // p.tile for start, p in zip(shard_start, plans, strict=True)]
    last_tile = [
        (start + p.local - 1) // p.tile for start, p in zip(shard_start, plans, strict=True)
    ]
    counts = tuple(p.tiles_per_shard for p in plans)
    num_local = math.prod(counts)

    def tile_coords(local_index):
        # Shards that overlap fewer tiles than `counts` revisit their last tile: rewriting a tile
        # writes the same values to the same place.
        digits = _unravel(local_index, counts)
        return [
            jnp.minimum(first + digit, last)
            for first, digit, last in zip(first_tile, digits, last_tile, strict=True)
        ]

    def draw(local_index):
        coords = tile_coords(local_index)
        tile_key = jax.random.fold_in(key, _ravel(coords, grid))
        return tiles.draw(tile_key, shape, tile_shape, dtype)

    def step(index, out):
        local_indices = jnp.minimum(
            index * group + jnp.arange(group, dtype=jnp.int32), num_local - 1
        )
        drawn = jax.vmap(draw)(local_indices)

        def write(member, out):
            coords = tile_coords(local_indices[member])
            start = [c * p.tile - s for c, p, s in zip(coords, plans, shard_start, strict=True)]
            return _write_tile(out, drawn[member], start)

        return lax.fori_loop(0, group, write, out)

    out = jnp.zeros(tuple(p.local for p in plans), out_dtype)
    sharded_over = tuple(name for p in plans for name in p.mesh_axes)
    if sharded_over:
        # Under `shard_map`, the buffer must be typed as differing between shards, as the tiles
        # written into it do.
        out = lax.pcast(out, sharded_over, to="varying")
    return lax.fori_loop(0, -(-num_local // group), step, out)


def _draw_tensor(
    key: PRNGKeyArray,
    *,
    tiles: Any,
    shape: tuple[int, ...],
    dtype: Any,
    sharding: NamedSharding | None,
    max_chunk_bytes: int,
) -> Array:
    tile_shape = _tile_shape(shape)
    plans = _axis_plans(shape, tile_shape, sharding)
    drawn = jax.eval_shape(lambda k: tiles.draw(k, shape, tile_shape, dtype), key)
    if drawn.shape != tile_shape:
        raise ValueError(
            f"`initializer` must return an array of the shape it is asked for; asked for "
            f"{tile_shape}, it returned {drawn.shape}."
        )
    if math.prod(p.num_tiles for p in plans) >= 2**31:
        raise ValueError(f"`shape` {shape} is too large: it would need 2**31 tiles or more.")
    tile_bytes = math.prod(tile_shape) * np.dtype(drawn.dtype).itemsize
    num_local = math.prod(p.tiles_per_shard for p in plans)
    group = int(min(num_local, max(1, max_chunk_bytes // tile_bytes)))
    draw_shard = functools.partial(
        _draw_shard, tiles=tiles, plans=plans, dtype=dtype, out_dtype=drawn.dtype, group=group
    )
    if sharding is None:
        return draw_shard(key)
    return jax.shard_map(
        draw_shard, mesh=sharding.mesh, in_specs=PartitionSpec(), out_specs=sharding.spec
    )(key)


# Compiled tile draws by content, as build_stacked's writes (`eqx_lean.clear_caches` empties it).
_TILE_DRAWS = CompiledCache()


def _draw_tiles(key: PRNGKeyArray, **static: Any) -> Array:
    """`_draw_tensor`, traced afresh on every call; compiled programs are reused by content.

    The initializer may read Python state (a global, an array it closes over, updated in place):
    a trace cache keyed on the initializer object would return the values of its first call.
    So a new function is traced each time and its program, constants and settings are the key.
    """
    draw = functools.partial(_draw_tensor, **static)
    if has_tracers(key):  # inside a trace: traced into it, freshly
        return draw(key)
    traced = jax.jit(draw).trace(key)
    content = (
        closed_jaxpr_key(traced.jaxpr),
        aval_key(jax.typeof(key)),
        repr(getattr(key, "sharding", None)),
        settings_key(),
        jax.default_backend(),
    )
    compiled = _TILE_DRAWS.get(content)
    if compiled is None:
        compiled = traced.lower().compile()
        _TILE_DRAWS.put(content, compiled)
    return compiled(key)


#
# Public API
#


def _check_shape(shape: Any) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError as e:
        raise TypeError(f"`shape` must be a tuple of integers; got {shape!r}.") from e
    if len(dims) == 0:
        raise ValueError(
            "`shape` must have at least one axis; for a scalar use the initializer itself."
        )
    if any(d < 0 for d in dims):
        raise ValueError(f"`shape` must have non-negative dimensions; got {dims}.")
    return dims


def _check_sharding(out_sharding: Any, shape: tuple[int, ...]) -> NamedSharding | None:
    if out_sharding is None:
        return None
    if isinstance(out_sharding, NamedSharding):
        mesh, spec = out_sharding.mesh, out_sharding.spec
    elif isinstance(out_sharding, PartitionSpec):
        mesh, spec = jax.sharding.get_abstract_mesh(), out_sharding
        if mesh.empty:
            raise ValueError(
                "`out_sharding` is a PartitionSpec but no mesh is set; pass a "
                "`jax.sharding.NamedSharding`, or call inside `jax.set_mesh(mesh)`."
            )
    else:
        raise TypeError(
            "`out_sharding` must be a `jax.sharding.NamedSharding`, a `PartitionSpec` (with a mesh "
            f"set) or None; got {type(out_sharding).__name__}."
        )
    # The package's one validator and error format; `out_sharding` is for the whole tensor.
    check_spec((), shape, spec, mesh, argument="out_sharding", per_layer=False)
    if isinstance(out_sharding, NamedSharding):
        return out_sharding
    return NamedSharding(mesh, spec)


def chunked(
    initializer: Callable[..., Array],
    max_chunk_bytes: int = _DEFAULT_MAX_CHUNK_BYTES,
    *,
    elementwise: bool = False,
) -> Callable[..., Array]:
    """Wraps an initializer so that it draws its tensor tile by tile, in bounded memory.

    A plain `jax.nn.initializers` initializer holds the whole tensor's random bits and
    intermediates at once: about three times the tensor in temporaries (and slicing its result
    does not help, XLA still makes the whole draw). The wrapped initializer allocates the output
    once and fills it in a `lax.fori_loop`, drawing a few fixed-size tiles per step, so its
    temporaries are bounded by `max_chunk_bytes` whatever the tensor's size. With `out_sharding`,
    every device fills only its own shard.

    ```python
    init = eqx_lean.init.chunked(jax.nn.initializers.lecun_normal())
    weight = init(key, (32000, 4096), jnp.bfloat16)
    ```

    The values differ from the plain initializer's (each tile has its own key) but follow the same
    distribution, with the same per-element law the plain initializer gives the *whole* tensor
    (variance-scaling initializers use the full shape's fans). They depend only on `key`, `shape`
    and `dtype`: not on `max_chunk_bytes` and not on `out_sharding` or the number of devices.
    Every call traces the initializer afresh, so it sees the Python state of its moment (a global,
    an array updated in place); compiled programs are reused by content, as `build_stacked`'s are.

    Tiles are a fixed grid of near-square blocks of at most 2**18 elements; tile `i` (row-major
    over the grid) is `initializer(jax.random.fold_in(key, i), tile_shape, dtype)` for
    element-independent initializers, and its last row and column are cut at the tensor's edge.

    **Arguments:**

    - `initializer`: a `(key, shape, dtype) -> array` initializer whose elements are drawn
        independently: `jax.nn.initializers.normal`, `uniform`, `truncated_normal`, `constant`,
        `zeros`, `ones`, any variance-scaling initializer (`variance_scaling`, `lecun_normal`,
        `glorot_uniform`, `he_normal`, ...), `jax.random.normal` or `jax.random.uniform`.
        `orthogonal` and `delta_orthogonal` couple all elements and are refused.
    - `max_chunk_bytes`: the most bytes of values one loop step draws per device (at least one
        tile is always drawn). XLA's temporaries for a step are a small multiple of it (random
        bits and intermediates: about 3x for `truncated_normal`). A memory knob only: larger
        values mean fewer, larger steps, with identical results.
    - `elementwise`: accept an initializer not in the list above, on your word that it draws every
        element independently from one distribution that does not depend on the shape it is
        asked for. It is then called on each tile's shape.

    **Returns:**

    An initializer `init(key, shape, dtype=None, out_sharding=None) -> array`, usable eagerly or
    inside `jax.jit`. `dtype=None` uses the wrapped initializer's own default; `out_sharding` is
    a `jax.sharding.NamedSharding` (or a `PartitionSpec` under `jax.set_mesh`) whose shards must
    divide `shape`.
    """
    tiles = tiles_of(initializer, elementwise)
    if (
        isinstance(max_chunk_bytes, bool)
        or not isinstance(max_chunk_bytes, int | np.integer)
        or max_chunk_bytes <= 0
    ):
        raise ValueError(f"`max_chunk_bytes` must be a positive integer; got {max_chunk_bytes!r}.")

    def init(
        key: PRNGKeyArray,
        shape: Sequence[int],
        dtype: Any = None,
        out_sharding: NamedSharding | PartitionSpec | None = None,
    ) -> Array:
        dims = _check_shape(shape)
        sharding = _check_sharding(out_sharding, dims)
        if math.prod(dims) == 0:
            ones = (1,) * len(dims)
            drawn = jax.eval_shape(lambda k: tiles.draw(k, ones, ones, dtype), key)
            return jnp.zeros(dims, drawn.dtype, out_sharding=sharding)
        return _draw_tiles(
            key,
            tiles=tiles,
            shape=dims,
            dtype=None if dtype is None else jnp.dtype(dtype),
            sharding=sharding,
            max_chunk_bytes=int(max_chunk_bytes),
        )

    return init
