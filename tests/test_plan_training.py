"""`eqx_lean.memory.plan_train_step` and `eqx_lean.memory.fit` on compile-only targets."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_lean
from eqx_lean import memory


optax = pytest.importorskip("optax")

WIDTH, LAYERS = 64, 4


class Net(eqx.Module):
    blocks: eqx.nn.Linear
    scale: float = eqx.field(static=True)

    def __init__(self, key):
        keys = jax.random.split(key, LAYERS)
        self.blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(WIDTH, WIDTH, key=k))(keys)
        self.scale = 0.5


def make_loss(remat):
    def layer(linear, h):
        return jax.nn.relu(jax.vmap(linear)(h))

    def loss(model, x):
        y = eqx_lean.fold(model.blocks, x, call=layer, remat=remat, num_layers=LAYERS)
        return model.scale * jnp.mean(y**2)

    return loss


def _abstract(mesh=None):
    model = eqx.filter_eval_shape(Net, jax.random.key(0))
    if mesh is None:
        return model
    # fsdp: each layer's last dim over the devices (the layer axis stays whole).
    spec = NamedSharding(mesh, P(None, None, "fsdp"))
    bias = NamedSharding(mesh, P(None, "fsdp"))
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=spec if s.ndim == 3 else bias),
        model,
    )


def _batch(size, mesh=None):
    sharding = None if mesh is None else NamedSharding(mesh, P("fsdp"))
    return jax.ShapeDtypeStruct((size, WIDTH), jnp.float32, sharding=sharding)


def _is_struct(x):
    return isinstance(x, jax.ShapeDtypeStruct)


def _shard_bytes(s):
    shape = s.shape if s.sharding is None else s.sharding.shard_shape(s.shape)
    return math.prod(shape) * np.dtype(s.dtype).itemsize


def _hand_written(optimizer, loss_fn, model, x, where):
    """The same step written out, its arguments placed by hand, planned with `plan`."""
    params = eqx.filter(model, _is_struct)
    frozen = eqx.filter(model, _is_struct, inverse=True)
    state = jax.eval_shape(optimizer.init, params)
    mesh_sharding = jax.tree.leaves(params)[0].sharding
    scalar = (
        jax.sharding.SingleDeviceSharding(where.devices[0])
        if mesh_sharding is None
        else NamedSharding(mesh_sharding.mesh, P())
    )
    count, (mu, nu) = state[0].count, (state[0].mu, state[0].nu)
    count = jax.ShapeDtypeStruct(count.shape, count.dtype, sharding=scalar)
    mu = jax.tree.map(
        lambda m, p: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=p.sharding), mu, params
    )
    nu = jax.tree.map(
        lambda m, p: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=p.sharding), nu, params
    )
    state = (state[0]._replace(count=count, mu=mu, nu=nu), *state[1:])

    def step(params, state, frozen, x):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, frozen), x))(params)
        with jax.numpy_dtype_promotion("standard"):
            updates, state = optimizer.update(grads, state, params)
        return eqx.apply_updates(params, updates), state, loss

    return plan_args(step, (params, state, frozen, x), where), (params, state, x)


def plan_args(step, args, where):
    return lambda donate: memory.plan(step, *args, target=where, donate=donate)


def _figures(p):
    return (p.argument, p.output, p.alias, p.temp, p.peak, p.fits, p.num_devices)


@pytest.mark.parametrize("spec", ["cpu", "8xh100"])
def test_plan_train_step(spec):
    where = memory.target(spec)
    mesh = None if spec == "cpu" else where.mesh((8,), ("fsdp",))
    model, x = _abstract(mesh), _batch(32, mesh)
    optimizer = optax.adamw(1e-3)
    loss_fn = make_loss(True)
    donated = memory.plan_train_step(loss_fn, model, optimizer, x, target=where)
    kept = memory.plan_train_step(loss_fn, model, optimizer, x, target=spec, donate=False)
    assert donated.num_devices == (1 if spec == "cpu" else 8)

    # Arguments: parameters, AdamW's two moments (sharded as the parameters) and its step
    # count, and the batch, each as its shard on one device.
    params = [s for s in jax.tree.leaves(model) if isinstance(s, jax.ShapeDtypeStruct)]
    state = jax.eval_shape(optimizer.init, eqx.filter(model, _is_struct))
    state_leaves = jax.tree.leaves(state)
    scalars = [s for s in state_leaves if s.shape == ()]
    assert len(state_leaves) == 2 * len(params) + len(scalars)
    expected = 3 * sum(map(_shard_bytes, params)) + sum(np.dtype(s.dtype).itemsize for s in scalars)
    expected += _shard_bytes(x)
    assert donated.argument == kept.argument == expected
    assert donated.alias > 0
    assert kept.alias == 0
    assert donated.peak < kept.peak

    by_hand, _ = _hand_written(optimizer, loss_fn, model, x, where)
    assert _figures(by_hand((0, 1))) == _figures(donated)
    assert _figures(by_hand("none")) == _figures(kept)


def test_plan_train_step_errors():
    model = _abstract()
    with pytest.raises(TypeError, match="loss_fn"):
        memory.plan_train_step(
            None,  # pyright: ignore[reportArgumentType]
            model,
            optax.sgd(1.0),
            _batch(4),
            target="cpu",
        )
    with pytest.raises(TypeError, match="optimizer"):
        memory.plan_train_step(make_loss(None), model, object(), _batch(4), target="cpu")
    with pytest.raises(ValueError, match="trainable"):
        memory.plan_train_step(
            make_loss(None),
            model,
            optax.sgd(1.0),
            _batch(4),
            target="cpu",
            trainable=lambda _: False,
        )


def test_fit_h100():
    # A sliver of one H100, so that the boundary is a batch of some hundreds of rows.
    where = memory.target("h100", memory_fraction=4 * 2**20 / 84978434048)
    model, optimizer, multiple = _abstract(), optax.adamw(1e-3), 4
    found = memory.fit(
        make_loss,
        model,
        optimizer,
        lambda b: (_batch(b),),
        target=where,
        batch_multiple=multiple,
        max_batch=4096,
    )
    print(found)
    assert found.remats == (None, True, "nested")
    for result in found.results:
        # 4 compiles where the peak is affine in the batch (2 to fit the line, 2 to check its
        # boundary). XLA's GPU peaks are not affine on this 4 MiB budget (about 2 KB per row
        # from batch 4 to 8, 3 KB near the boundary; fusions and tiling change with the batch,
        # and the peak is not even monotone within a few rows), so the secants take a few
        # more: 9, 9 and 7 measured, bounded here at 10.
        first, second = result.tried[:2]
        slope = (second[1] - first[1]) / (second[0] - first[0])
        affine = all(
            abs(first[1] + slope * (b - first[0]) - peak) < 1024 for b, peak, _ in result.tried
        )
        assert result.compiles <= (4 if affine else 10), result.tried
        assert result.batch_size % multiple == 0
        assert 0 < result.batch_size < 4096
        assert result.plan.fits
        for batch, fits in ((result.batch_size, True), (result.batch_size + multiple, False)):
            by_hand, _ = _hand_written(
                optimizer, make_loss(result.remat), model, _batch(batch), where
            )
            assert by_hand((0, 1)).fits is fits, (result.remat, batch)
    largest = max(r.batch_size for r in found.results)
    assert found.best is not None and found.best.batch_size == largest
    # Rematerialising saves activations, so it reaches at least the batch without it.
    assert found[True].batch_size >= found[None].batch_size
    assert "remat" in str(found) and "*" in found.table()


def test_fit_none_fits():
    where = memory.target("h100", memory_fraction=1e-9)
    found = memory.fit(
        make_loss,
        _abstract(),
        optax.sgd(1.0),
        lambda b: (_batch(b),),
        target=where,
        remats=(None,),
    )
    assert found.best is None
    assert found[None].batch_size == 0 and found[None].compiles == 1
    with pytest.raises(ValueError, match="batch_multiple"):
        memory.fit(
            make_loss,
            _abstract(),
            optax.sgd(1.0),
            lambda b: (_batch(b),),
            target=where,
            batch_multiple=0,
        )


@pytest.mark.parametrize(
    ("fixed", "per_row", "memory", "expected", "compiles"),
    [
        (1000, 10, 5000, 400, 4),  # affine: the line's boundary fits, its next multiple not
        (1000, 10, 10**9, 1024, 3),  # everything fits: max_batch is checked at once
        (1000, 10, 1050, 0, 1),  # not even one multiple
        (1000, 10, 1100, 8, 2),  # one multiple but not two
    ],
)
def test_fit_search_on_an_affine_peak(fixed, per_row, memory, expected, compiles):
    # `fit_one` (the search alone, without XLA) on a peak known exactly.
    from types import SimpleNamespace

    from eqx_lean.internal import fit_one

    def plan_at(batch):
        peak = fixed + per_row * batch
        return SimpleNamespace(peak=peak, needed=peak, fits=peak <= memory, device_memory=memory)

    result = fit_one(plan_at, 8, 1024, None)  # pyright: ignore[reportArgumentType]
    assert (result.batch_size, result.compiles) == (expected, compiles), result.tried
    # Whatever the order of the tries, the answer is the boundary by brute force.
    brute = max((b for b in range(8, 1025, 8) if fixed + per_row * b <= memory), default=0)
    assert result.batch_size == brute


def test_fit_search_on_a_convex_peak():
    from types import SimpleNamespace

    from eqx_lean.internal import fit_one

    memory = 4 * 2**20

    def peak_of(batch):  # activations that grow faster than the batch, as in the H100 test
        return 300_000 + 2000 * batch + batch**2 // 4

    def plan_at(batch):
        peak = peak_of(batch)
        return SimpleNamespace(peak=peak, needed=peak, fits=peak <= memory, device_memory=memory)

    result = fit_one(plan_at, 4, 4096, True)  # pyright: ignore[reportArgumentType]
    brute = max(b for b in range(4, 4097, 4) if peak_of(b) <= memory)
    assert result.batch_size == brute
    assert result.compiles <= 6, result.tried  # 6 measured: m, 2m, then 4 secants
