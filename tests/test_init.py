import gc
import itertools
import math
import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import mesh_of
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqx_lean


inits = jax.nn.initializers
chunked = eqx_lean.init.chunked

# The constant of `jax.nn.initializers.variance_scaling`: the standard deviation of a standard
# normal truncated to (-2, 2).
TRUNCATED_STD = 0.87962566103423978


def assemble_from_tiles(draw_tile, key, shape, tile, dtype=np.float32):
    """The documented definition, as a Python loop: tile `i` of the row-major tile grid is drawn
    with `fold_in(key, i)` and cut at the tensor's edge."""
    grid = [math.ceil(n / t) for n, t in zip(shape, tile, strict=True)]
    out = np.full(shape, np.nan, dtype)
    for coords in itertools.product(*map(range, grid)):
        tile_id = int(np.ravel_multi_index(coords, grid))
        values = np.asarray(draw_tile(jax.random.fold_in(key, tile_id), tile))
        region = tuple(
            slice(c * t, min((c + 1) * t, n)) for c, t, n in zip(coords, tile, shape, strict=True)
        )
        out[region] = values[tuple(slice(0, r.stop - r.start) for r in region)]
    return out


def lecun_normal_tile(fan_in):
    def draw(key, tile):
        stddev = jnp.sqrt(jnp.array(1.0 / fan_in, jnp.float32)) / jnp.float32(TRUNCATED_STD)
        return jax.random.truncated_normal(key, -2, 2, tile, jnp.float32) * stddev

    return draw


#
# Values: the documented tile definition, and what they must not depend on
#


@pytest.mark.parametrize(
    "shape, tile",
    [
        ((1000, 700), (512, 512)),
        ((600_000,), (262_144,)),
        ((64, 100, 90), (64, 64, 64)),
        pytest.param((3, 300_000), (3, 87_381), marks=pytest.mark.slow),
    ],
)
def test_tile_grid_matches_python_loop(shape, tile, getkey):
    key = getkey()
    out = chunked(inits.normal(0.5))(key, shape)
    expected = assemble_from_tiles(lambda k, t: inits.normal(0.5)(k, t), key, shape, tile)
    assert out.shape == shape and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_variance_scaling_tiles_use_full_shape_fan(getkey):
    key = getkey()
    shape = (1000, 700)
    out = chunked(inits.lecun_normal())(key, shape)
    expected = assemble_from_tiles(lecun_normal_tile(fan_in=1000), key, shape, (512, 512))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("max_chunk_bytes", [1, 2**20 - 1, 3 * 2**20, 2**30])
def test_values_do_not_depend_on_max_chunk_bytes(max_chunk_bytes, getkey):
    key = getkey()
    shape = (1500, 1300)  # 3 x 3 tiles, cut on both axes
    default = chunked(inits.lecun_normal())(key, shape)
    other = chunked(inits.lecun_normal(), max_chunk_bytes)(key, shape)
    np.testing.assert_array_equal(np.asarray(default), np.asarray(other))


def test_values_depend_on_key(getkey):
    init = chunked(inits.normal())
    a, b = init(getkey(), (600, 600)), init(getkey(), (600, 600))
    assert not np.any(np.asarray(a) == np.asarray(b))


def test_same_under_jit_and_eval_shape(getkey):
    key = getkey()
    init = chunked(inits.he_normal(), 3 * 2**20)
    eager = init(key, (1100, 900))
    jitted = jax.jit(lambda k: init(k, (1100, 900)))(key)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
    struct = jax.eval_shape(lambda k: init(k, (1100, 900), jnp.bfloat16), key)
    assert struct.shape == (1100, 900) and struct.dtype == jnp.bfloat16


def test_raw_uint32_keys(getkey):
    raw = jax.random.PRNGKey(3)
    typed = jax.random.wrap_key_data(raw)
    init = chunked(inits.uniform())
    np.testing.assert_array_equal(
        np.asarray(init(raw, (700, 500))), np.asarray(init(typed, (700, 500)))
    )


#
# Distribution: the target law, and the plain initializer's
#


def two_sample_ks(a, b):
    a, b = np.sort(a.ravel()), np.sort(b.ravel())
    grid = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, grid, side="right") / a.size
    cdf_b = np.searchsorted(b, grid, side="right") / b.size
    return np.max(np.abs(cdf_a - cdf_b))


def ks_critical(n, m, alpha=1e-3):
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


SHAPE = (2048, 1024)
N = math.prod(SHAPE)


@pytest.mark.parametrize(
    "initializer, std, bound",
    [
        # lecun_normal: truncated normal with std sqrt(1 / fan_in), cut at 2 untruncated stds.
        (inits.lecun_normal(), math.sqrt(1 / 2048), 2 * math.sqrt(1 / 2048) / TRUNCATED_STD),
        # he_normal: the same with variance 2 / fan_in.
        pytest.param(
            inits.he_normal(),
            math.sqrt(2 / 2048),
            2 * math.sqrt(2 / 2048) / TRUNCATED_STD,
            marks=pytest.mark.slow,
        ),
        # glorot_uniform: uniform with variance 1 / fan_avg, on [-sqrt(3 var), sqrt(3 var)).
        (inits.glorot_uniform(), math.sqrt(1 / 1536), math.sqrt(3 / 1536)),
        # truncated_normal(stddev): the *untruncated* std is stddev, cut at 2 stddev.
        (inits.truncated_normal(0.02), 0.02 * TRUNCATED_STD, 0.04),
        # normal(stddev): no bound.
        (inits.normal(0.1), 0.1, None),
    ],
)
def test_zero_mean_distributions(initializer, std, bound, getkey):
    key = getkey()
    x = np.asarray(chunked(initializer)(key, SHAPE), np.float64)
    plain = np.asarray(initializer(key, SHAPE), np.float64)
    # Five standard errors: of the mean, std / sqrt(N); of the std, at most std / sqrt(2 N).
    assert abs(x.mean()) < 5 * std / math.sqrt(N)
    assert abs(x.std() / std - 1) < 5 / math.sqrt(2 * N)
    assert abs(x.std() - plain.std()) < 5 * std * math.sqrt(2 / (2 * N))
    if bound is not None:
        assert np.abs(x).max() <= bound * (1 + 1e-6)
        assert np.abs(x).max() > 0.99 * bound
    assert two_sample_ks(x, plain) < ks_critical(N, N)


def test_uniform_distribution(getkey):
    key = getkey()
    x = np.asarray(chunked(inits.uniform(3.0))(key, SHAPE), np.float64)
    plain = np.asarray(inits.uniform(3.0)(key, SHAPE), np.float64)
    std = 3.0 / math.sqrt(12)
    assert abs(x.mean() - 1.5) < 5 * std / math.sqrt(N)
    assert abs(x.std() / std - 1) < 5 / math.sqrt(2 * N)
    assert x.min() >= 0.0 and x.max() < 3.0
    assert two_sample_ks(x, plain) < ks_critical(N, N)


def test_variance_scaling_with_custom_axes(getkey):
    # A (kh, kw, in, out) convolution kernel: fan_in = 3 * 3 * 64, fan_out = 3 * 3 * 512.
    shape = (3, 3, 64, 512)
    initializer = inits.variance_scaling(2.0, "fan_out", "normal", in_axis=2, out_axis=3)
    x = np.asarray(chunked(initializer)(getkey(), shape), np.float64)
    std = math.sqrt(2.0 / (9 * 512))
    assert abs(x.std() / std - 1) < 5 / math.sqrt(2 * x.size)


def test_bfloat16_and_initializer_default_dtype(getkey):
    key = getkey()
    x = chunked(inits.lecun_normal(dtype=jnp.bfloat16))(key, SHAPE)
    assert x.dtype == jnp.bfloat16
    y = chunked(inits.lecun_normal())(key, SHAPE, jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    std = math.sqrt(1 / 2048)
    assert abs(np.asarray(y, np.float64).std() / std - 1) < 0.01


@pytest.mark.slow
def test_complex_variance_scaling(getkey):
    x = np.asarray(chunked(inits.lecun_normal())(getkey(), (1024, 1024), jnp.complex64))
    assert x.dtype == np.complex64
    assert abs(np.sqrt(np.mean(np.abs(x) ** 2)) * 32 - 1) < 0.01


@pytest.mark.parametrize("shape", [(5,), (20, 30, 40, 50), (2, 1, 3, 1, 2)])
def test_any_rank(shape, getkey):
    x = chunked(inits.normal(1.0))(getkey(), shape)
    assert x.shape == shape
    assert np.all(np.isfinite(np.asarray(x)))
    # Tiles drawn from one key would repeat their values (20 x 30 x 40 x 50 has 12 tiles).
    assert np.unique(np.asarray(x)).size > 0.9 * x.size


def test_zero_size_shape(getkey):
    x = chunked(inits.lecun_normal())(getkey(), (0, 1024), jnp.bfloat16)
    assert x.shape == (0, 1024) and x.dtype == jnp.bfloat16


def test_constant_zeros_ones_and_elementwise(getkey):
    key = getkey()
    np.testing.assert_array_equal(np.asarray(chunked(inits.constant(-7.0))(key, (600, 600))), -7.0)
    np.testing.assert_array_equal(np.asarray(chunked(inits.zeros)(key, (600, 600))), 0.0)
    np.testing.assert_array_equal(np.asarray(chunked(inits.ones)(key, (600, 600))), 1.0)
    laplace = chunked(lambda k, s, d=jnp.float32: jax.random.laplace(k, s, d), elementwise=True)
    x = np.asarray(laplace(key, SHAPE), np.float64)
    assert abs(x.std() / math.sqrt(2) - 1) < 0.01
    x = np.asarray(chunked(jax.random.normal)(key, SHAPE))
    assert abs(x.std() - 1) < 0.01


#
# Memory
#


def temp_bytes(fn, *args):
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    assert stats is not None
    return stats.temp_size_in_bytes


@pytest.mark.xla_cpu  # XLA:CPU's rolled Threefry plan (the H100 plans the plain draw lean)
def test_temporaries_bounded_by_the_chunk(getkey):
    key = getkey()
    for shape in [(4096, 4096), (16384, 16384)]:
        temp = temp_bytes(lambda k, shape=shape: chunked(inits.lecun_normal())(k, shape), key)
        # One 1 MiB tile per step: random bits, intermediates and the write, about 6 MiB.
        assert temp <= 8 * 2**20, temp
    plain = temp_bytes(lambda k: inits.lecun_normal()(k, (4096, 4096)), key)
    assert plain >= 2 * 4096 * 4096 * 4
    bigger_chunks = temp_bytes(lambda k: chunked(inits.lecun_normal(), 2**22)(k, (4096, 4096)), key)
    assert 8 * 2**20 < bigger_chunks <= 32 * 2**20


#
# Compiled tile draws are reused by content, never by the initializer object
#


def test_a_constant_array_updated_in_place_gives_new_values(getkey):
    value = np.array(1.0, np.float32)
    init = chunked(inits.constant(value))
    key = getkey()
    assert np.all(np.asarray(init(key, (5, 7))) == 1.0)
    value[...] = 5.0
    assert np.all(np.asarray(init(key, (5, 7))) == 5.0)


SCALE = 1.0


def scaled_normal(key, shape, dtype=jnp.float32):
    return SCALE * jax.random.normal(key, shape, dtype)


def test_a_global_read_by_the_initializer_gives_new_values(getkey, monkeypatch):
    init = chunked(scaled_normal, elementwise=True)
    key = getkey()
    first = np.asarray(init(key, (5, 7)))
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 100.0)
    # (XLA may fold the scale into the draw's own last multiply: equal up to rounding.)
    np.testing.assert_allclose(np.asarray(init(key, (5, 7))), 100.0 * first, rtol=1e-6)
    under_jit = jax.jit(lambda k: init(k, (5, 7)))(key)
    np.testing.assert_allclose(np.asarray(under_jit), 100.0 * first, rtol=1e-6)


def test_an_equal_fresh_initializer_compiles_nothing_and_is_not_kept(getkey, compiles):
    key = getkey()
    first = chunked(inits.normal(0.02))(key, (64, 48))
    before = compiles.count
    second = chunked(inits.normal(0.02))(key, (64, 48))
    assert compiles.count == before
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    initializer = inits.normal(0.02)
    alive = weakref.ref(initializer)
    chunked(initializer)(key, (64, 48))
    del initializer
    gc.collect()
    assert alive() is None


def test_clear_caches_forgets_the_compiled_fills(getkey, compiles):
    key = getkey()
    chunked(inits.normal(0.02))(key, (64, 40))
    eqx_lean.clear_caches()
    before = compiles.count
    chunked(inits.normal(0.02))(key, (64, 40))
    assert compiles.count > before


#
# Errors
#


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "1MiB"])
def test_bad_max_chunk_bytes(value):
    with pytest.raises(ValueError, match="`max_chunk_bytes` must be a positive integer"):
        chunked(inits.normal(), value)


def test_not_callable():
    with pytest.raises(TypeError, match="`initializer` must be a callable"):
        chunked(0.02)  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("initializer", [inits.orthogonal(), inits.delta_orthogonal()])
def test_coupled_initializers_refused(initializer):
    with pytest.raises(ValueError, match="`initializer` .* cannot be chunked"):
        chunked(initializer)


def test_unknown_initializer_needs_elementwise():
    with pytest.raises(TypeError, match="pass `elementwise=True`"):
        chunked(lambda k, s, d=jnp.float32: jax.random.laplace(k, s, d))


def test_bad_shapes(getkey):
    init = chunked(inits.normal())
    with pytest.raises(ValueError, match="`shape` must have at least one axis"):
        init(getkey(), ())
    with pytest.raises(ValueError, match="`shape` must have non-negative dimensions"):
        init(getkey(), (3, -1))
    with pytest.raises(TypeError, match="`shape` must be a tuple of integers"):
        init(getkey(), (3.5, 2))
    with pytest.raises(ValueError, match="`shape` must have at least 2 axes"):
        chunked(inits.lecun_normal())(getkey(), (1000,))
    with pytest.raises(ValueError, match="`initializer` must have a variance-scaling mode"):
        chunked(inits.variance_scaling(1.0, "fan_max", "normal"))(getkey(), (4, 4))  # pyright: ignore[reportArgumentType]


def test_bad_out_sharding(getkey):
    init = chunked(inits.normal())
    key = getkey()
    with pytest.raises(TypeError, match="`out_sharding` must be a `jax.sharding.NamedSharding`"):
        init(getkey(), (8, 8), out_sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    with pytest.raises(ValueError, match="`out_sharding` is a PartitionSpec but no mesh is set"):
        init(getkey(), (8, 8), out_sharding=jax.sharding.PartitionSpec("d"))
    mesh = jax.make_mesh((1,), ("d",))
    with jax.set_mesh(mesh):
        # The package's one error format: argument, shape, spec and what is wrong.
        with pytest.raises(
            ValueError,
            match=r"`out_sharding`: shape \(8, 8\) with spec P\('x',\) names mesh axis 'x'",
        ):
            init(getkey(), (8, 8), out_sharding=jax.P("x"))
        sharded = init(key, (8, 8), out_sharding=jax.P("d"))
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(init(key, (8, 8))))
    with pytest.raises(ValueError, match="names more dimensions than the leaf has"):
        init(getkey(), (8,), out_sharding=jax.sharding.NamedSharding(mesh, jax.P("d", None)))


#
# Eight devices
#

# The draw that every layout over the suite's 8 devices must give, value for value.
EIGHT_DEVICE_SHAPE = (1000, 1400)


def eight_device_key() -> jax.Array:
    return jax.random.key(7)


def eight_device_sharding(name: str) -> NamedSharding:
    """One of the layouts over the suite's 8 devices that `out_sharding` is tested with."""
    line, grid = ("d",), ("a", "b")
    if name == "rows":
        return NamedSharding(mesh_of((8,), line), P("d", None))
    if name == "columns":
        return NamedSharding(mesh_of((8,), line), P(None, "d"))
    if name == "rows_auto":
        return NamedSharding(mesh_of((8,), line, AxisType.Auto), P("d"))
    if name == "grid":
        return NamedSharding(mesh_of((2, 4), grid), P("a", "b"))
    if name == "two_axes_on_rows":
        return NamedSharding(mesh_of((2, 4), grid), P(("b", "a"), None))
    assert name == "partly_replicated", name
    return NamedSharding(mesh_of((2, 4), grid), P(None, "b"))


@pytest.fixture(scope="module")
def unsharded():
    """The values every layout must give: drawn on one device."""
    return np.asarray(chunked(inits.lecun_normal())(eight_device_key(), EIGHT_DEVICE_SHAPE))


@pytest.mark.parametrize(
    "name", ["rows", "columns", "rows_auto", "grid", "two_axes_on_rows", "partly_replicated"]
)
@pytest.mark.cpu_mesh
def test_same_values_on_eight_devices(unsharded, name):
    sharding = eight_device_sharding(name)
    init = chunked(inits.lecun_normal())
    x = init(eight_device_key(), EIGHT_DEVICE_SHAPE, out_sharding=sharding)
    assert x.sharding == sharding, x.sharding
    np.testing.assert_array_equal(np.asarray(x), unsharded)


@pytest.mark.cpu_mesh
def test_same_values_on_eight_devices_with_three_tiles_per_step(unsharded):
    small_chunks = chunked(inits.lecun_normal(), 3 * 2**20)
    sharding = eight_device_sharding("grid")
    y = small_chunks(eight_device_key(), EIGHT_DEVICE_SHAPE, out_sharding=sharding)
    np.testing.assert_array_equal(np.asarray(y), unsharded)


@pytest.mark.cpu_mesh
def test_same_values_on_eight_devices_from_a_spec_under_jit(unsharded):
    init = chunked(inits.lecun_normal())
    with jax.set_mesh(mesh_of((8,), ("d",))):
        draw = jax.jit(lambda k: init(k, EIGHT_DEVICE_SHAPE, out_sharding=P(None, "d")))
        jitted = draw(eight_device_key())
        assert jitted.sharding.spec == P(None, "d"), jitted.sharding
    np.testing.assert_array_equal(np.asarray(jitted), unsharded)


@pytest.mark.cpu_mesh
def test_each_of_eight_devices_fills_only_its_shard():
    init = chunked(inits.lecun_normal())
    sharding = eight_device_sharding("rows")
    big = (8192, 16384)
    draw = jax.jit(lambda k: init(k, big, out_sharding=sharding))
    analysis = draw.lower(eight_device_key()).compile().memory_analysis()
    assert analysis is not None  # XLA:CPU always reports it
    # Each device fills only its shard, with one tile's temporaries.
    assert analysis.output_size_in_bytes == 8192 * 16384 * 4 // 8
    assert analysis.temp_size_in_bytes <= 8 * 2**20, analysis.temp_size_in_bytes


@pytest.mark.cpu_mesh
def test_rows_that_do_not_divide_over_eight_devices_are_refused():
    init = chunked(inits.lecun_normal())
    with pytest.raises(ValueError) as info:
        init(eight_device_key(), (1001, 1400), out_sharding=eight_device_sharding("rows"))
    assert "dimension of size 1001 is not divisible by the 8 devices" in str(info.value)
