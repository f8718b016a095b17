"""What `fold` and `scan` check before JAX sees their inputs, and that the fixes their messages
give work: `num_layers=`, leaves without the layer axis, a sharded layer axis, `remat=`.

Values are compared with a Python loop over `eqx_lean.unstack` (gradients by differentiating
that loop). The sharded checks run on the suite's 8 CPU devices.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import mesh_of
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqx_lean


NUM_LAYERS = 4
DIM = 8


class Scaled(eqx.Module):
    """A layer with a plain Python float field."""

    linear: eqx.nn.Linear
    alpha: float

    def __call__(self, x):
        return self.alpha * jnp.tanh(self.linear(x))


class StaticScaled(eqx.Module):
    linear: eqx.nn.Linear
    alpha: float = eqx.field(static=True)

    def __call__(self, x):
        return self.alpha * jnp.tanh(self.linear(x))


def stack_of(cls, num_layers=NUM_LAYERS):
    keys = jax.random.split(jax.random.key(0), num_layers)
    return eqx_lean.build_stacked(lambda k: cls(eqx.nn.Linear(DIM, DIM, key=k), 0.5), keys)


def loop(stacked, x):
    for layer in eqx_lean.unstack(stacked):
        x = layer(x)
    return x


def assert_close(found, expected):
    for a, b in zip(jax.tree.leaves(found), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


# --- num_layers --------------------------------------------------------------------------------


def test_num_layers_refuses_an_unstacked_layer():
    norm, x = eqx.nn.LayerNorm(DIM), jnp.arange(DIM, dtype=jnp.float32)
    # Without `num_layers` this runs 8 "layers" of scalar norms: nothing can tell it apart.
    assert eqx_lean.fold(norm, x).shape == x.shape
    message = r"`num_layers=4`.*`stacked\.weight` is float32\[8\].*one layer rather than a stack"
    with pytest.raises(ValueError, match=message):
        eqx_lean.fold(norm, x, num_layers=4)
    with pytest.raises(ValueError, match=message):
        eqx_lean.scan(norm, x, call=lambda layer, x, _: (layer(x), None), num_layers=4)


def test_num_layers_names_the_leaf_its_shape_and_the_count():
    stacked, x = stack_of(StaticScaled), jnp.ones(DIM)
    with pytest.raises(ValueError, match=r"`num_layers=3`.*`stacked\.linear\.weight` is "):
        eqx_lean.fold(stacked, x, num_layers=3)
    # A leaf checked after the first: the count is checked on every leaf.
    lopsided = {"w": jnp.zeros((3, DIM)), "b": jnp.zeros((4, DIM))}
    with pytest.raises(ValueError, match=r"`num_layers=3`.*`stacked\['b'\]` is float32\[4, 8\]"):
        eqx_lean.fold(lopsided, x, call=lambda layer, x: x + layer["b"], num_layers=3)


def test_num_layers_that_matches_changes_nothing():
    stacked, x = stack_of(StaticScaled), jnp.linspace(-1, 1, DIM)
    expected = loop(stacked, x)
    assert_close(eqx_lean.fold(stacked, x, num_layers=NUM_LAYERS), expected)
    numpy_int = np.int64(NUM_LAYERS)
    assert_close(eqx_lean.fold(stacked, x, num_layers=numpy_int), expected)  # pyright: ignore
    carry, ys = eqx_lean.scan(
        stacked, x, call=lambda layer, x, _: (layer(x), x.sum()), num_layers=NUM_LAYERS
    )
    assert_close(carry, expected)
    assert ys.shape == (NUM_LAYERS,)
    # With `key=`, the keys are split by the checked count.
    drop = eqx.nn.Dropout(0.5, inference=False)
    found = eqx_lean.fold(
        stacked,
        x,
        call=lambda layer, x, key: drop(layer(x), key=key),
        key=jax.random.key(1),
        num_layers=NUM_LAYERS,
    )
    keys = jax.random.split(jax.random.key(1), NUM_LAYERS)
    expected = x
    for layer, key in zip(eqx_lean.unstack(stacked), keys, strict=True):
        expected = drop(layer(expected), key=key)
    assert_close(found, expected)
    with pytest.raises(ValueError, match=r"`num_layers=5`"):
        eqx_lean.fold(stacked, x, key=jax.random.key(1), num_layers=5)


@pytest.mark.parametrize(
    "bad, error",
    [(True, TypeError), (4.0, TypeError), ("4", TypeError), (0, ValueError), (-1, ValueError)],
)
def test_num_layers_itself_is_checked(bad, error):
    stacked = stack_of(StaticScaled)
    with pytest.raises(
        error,
        match=r"`num_layers` \(the number of stacked layers\) must be None or an integer of at "
        r"least 1; got",
    ):
        eqx_lean.fold(stacked, jnp.ones(DIM), num_layers=bad)


def test_leading_axes_that_disagree_name_both_leaves():
    lopsided = {"w": jnp.zeros((4, DIM)), "b": jnp.zeros((5, DIM))}
    message = r"`stacked\['b'\]` is float32\[5, 8\] and `stacked\['w'\]` is float32\[4, 8\]"
    with pytest.raises(ValueError, match=message):
        eqx_lean.fold(lopsided, jnp.ones(DIM), call=lambda layer, x: x + layer["b"])


# --- a Python number field ---------------------------------------------------------------------


@pytest.mark.parametrize("transform", ["jax.grad", "jax.jit"])
def test_a_python_float_field_traced_by_jax_is_named(transform):
    stacked, x = stack_of(Scaled), jnp.ones(DIM)
    assert isinstance(stacked.alpha, float)

    def loss(stacked):
        return jnp.sum(eqx_lean.fold(stacked, x, num_layers=NUM_LAYERS))

    run = jax.grad(loss) if transform == "jax.grad" else jax.jit(loss)
    message = (
        r"`stacked\.alpha` is a 0-d array \(float32\[\], weakly typed\).*"
        r"`eqx\.field\(static=True\)`.*`eqx\.filter_grad` / `eqx\.filter_jit`"
    )
    with pytest.raises(ValueError, match=message):
        run(stacked)


def test_the_fixes_for_a_python_float_field_match_the_loop():
    x = jnp.linspace(-1, 1, DIM)

    def loss(stacked):
        return jnp.sum(eqx_lean.fold(stacked, x) ** 2)

    def loop_loss(stacked):
        return jnp.sum(loop(stacked, x) ** 2)

    # A static field: `jax.grad` and `jax.jit` as they are.
    static = stack_of(StaticScaled)
    assert_close(jax.grad(loss)(static), jax.grad(loop_loss)(static))
    assert_close(jax.jit(loss)(static), loop_loss(static))
    # The field as it was, under Equinox's filtered transformations.
    plain = stack_of(Scaled)
    found = eqx.filter_grad(loss)(plain)
    assert found.alpha is None
    assert_close(found, eqx.filter_grad(loop_loss)(plain))
    assert_close(eqx.filter_jit(loss)(plain), loop_loss(plain))


# --- remat -------------------------------------------------------------------------------------


def test_remat_that_is_not_a_policy_is_refused_up_front():
    stacked, x = stack_of(StaticScaled), jnp.ones(DIM)
    with pytest.raises(TypeError, match=r"`remat` must be a checkpoint policy.*built-in.*len"):
        eqx_lean.fold(stacked, x, remat=len)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"`remat` must be a checkpoint policy"):
        call = lambda layer, x, _: (layer(x), None)  # noqa: E731
        eqx_lean.scan(stacked, x, call=call, remat=jax.checkpoint)  # pyright: ignore
    factory = r"`jax\.checkpoint_policies\.save_only_these_names` makes a policy: call it"
    with pytest.raises(TypeError, match=factory):
        eqx_lean.fold(stacked, x, remat=jax.checkpoint_policies.save_only_these_names)
    with pytest.raises(TypeError, match=r"`NestedRemat\(policy=...\)` must be a checkpoint"):
        eqx_lean.NestedRemat(policy=len)  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize(
    "remat",
    [
        jax.checkpoint_policies.save_only_these_names("none"),
        jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.nothing_saveable
        ),
        lambda primitive, *avals, **params: primitive.name == "tanh",
        eqx_lean.NestedRemat(2, policy=lambda primitive, *_, **__: False),
    ],
    ids=["save_only_these_names", "save_from_both", "user-lambda", "nested-user-lambda"],
)
def test_policies_are_accepted_and_match_the_loop(remat):
    stacked, x = stack_of(StaticScaled), jnp.linspace(-1, 1, DIM)

    def loss(stacked, x):
        return jnp.sum(jnp.sin(eqx_lean.fold(stacked, x, remat=remat)))

    def loop_loss(stacked, x):
        return jnp.sum(jnp.sin(loop(stacked, x)))

    grad = eqx.filter_grad(loss)
    assert_close(grad(stacked, x), eqx.filter_grad(loop_loss)(stacked, x))


# --- a sharded layer axis, on 8 devices --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardedStack:
    """An MLP stack (its arrays and the rest), an input, and the loop's output and gradient."""

    params: eqx.nn.MLP
    static: eqx.nn.MLP
    x: jax.Array
    expected: jax.Array
    expected_grad: eqx.nn.MLP

    def place(self, mesh, first):
        """The stack with its layer axis over mesh axis `first` and the next over `"model"`."""

        def put(a):
            spec = P(first, "model") if a.ndim >= 2 else P(first)
            return jax.device_put(a, NamedSharding(mesh, spec))

        return eqx.combine(jax.tree.map(put, self.params), self.static)

    def assert_matches_the_loop(self, found, with_grad=True):
        assert_close(found, (self.expected, self.expected_grad) if with_grad else self.expected)


def sharded_loss(stacked, x):
    return jnp.sum(jnp.sin(eqx_lean.fold(stacked, x)))


@pytest.fixture(scope="module")
def mlp() -> ShardedStack:
    keys = jax.random.split(jax.random.key(0), NUM_LAYERS)
    stacked = eqx_lean.build_stacked(lambda k: eqx.nn.MLP(DIM, DIM, 16, 1, key=k), keys)
    params, static = eqx.partition(stacked, eqx.is_array)
    x = jnp.linspace(-1, 1, DIM)

    def loop_loss(params):
        return jnp.sum(jnp.sin(loop(eqx.combine(params, static), x)))

    # Module-scoped: set up before the autouse `highest_precision` of the first test using it.
    with jax.default_matmul_precision("highest"):
        return ShardedStack(params, static, x, loop(stacked, x), jax.grad(loop_loss)(params))


def layers_and_model():
    """A 2 x 4 mesh of Explicit axes: the layer axis over `"layers"`, the next over `"model"`."""
    return mesh_of((2, 4), ("layers", "model"))


RUNS = {
    "fold": lambda stacked, x: eqx_lean.fold(stacked, x),
    "fold-jit": lambda stacked, x: eqx.filter_jit(eqx_lean.fold)(stacked, x),
    "fold-grad": lambda stacked, x: eqx.filter_grad(sharded_loss)(stacked, x),
    "scan": lambda stacked, x: eqx_lean.scan(stacked, x, call=lambda layer, x, _: (layer(x), None)),
    "fold-gather-false": lambda stacked, x: eqx_lean.fold(stacked, x, gather=False),
}


@pytest.mark.parametrize("how", list(RUNS))
@pytest.mark.cpu_mesh
def test_a_sharded_layer_axis_is_refused_before_jax_sees_it(mlp, how):
    explicit = layers_and_model()
    with jax.set_mesh(explicit):
        by_stage = mlp.place(explicit, "layers")
        with pytest.raises(ValueError) as info:
            RUNS[how](by_stage, mlp.x)
    assert info.type is ValueError, info.value
    message = str(info.value)
    for part in [
        "`stacked.layers[0].weight` (float32[4, 16, 8], sharded P('layers', 'model', None))",
        "has its layer axis (dimension 0) sharded over mesh axis 'layers'",
        "`jax.device_put(leaf, NamedSharding(mesh, P(None, 'model', None)))`",
        "`jax.sharding.reshard(leaf, P(None, 'model', None))`",
    ]:
        assert part in message, message


def layer_axis_replicated(stacked, mesh, how):
    """The fixes the message gives: each leaf with its layer axis replicated, the rest of its
    sharding kept, by `jax.device_put` or (in `jax.jit`, under `jax.set_mesh`) `reshard`."""

    def fix(a):
        spec = P(None, *jax.typeof(a).sharding.spec[1:])
        if how == "device_put":
            return jax.device_put(a, NamedSharding(mesh, spec))
        return jax.sharding.reshard(a, spec)

    return jax.tree.map(lambda a: fix(a) if eqx.is_array(a) else a, stacked)


@pytest.mark.parametrize("fix", ["device_put", "reshard-in-jit", "device_put-in-jit"])
@pytest.mark.cpu_mesh
def test_the_fix_the_message_gives_runs_and_matches_the_loop(mlp, fix):
    explicit = layers_and_model()
    how = fix.removesuffix("-in-jit")

    def fixed_run(stacked, x):
        fixed = layer_axis_replicated(stacked, explicit, how)
        return eqx_lean.fold(fixed, x), eqx.filter_grad(sharded_loss)(fixed, x)

    with jax.set_mesh(explicit):
        by_stage = mlp.place(explicit, "layers")
        found = (eqx.filter_jit(fixed_run) if fix.endswith("-in-jit") else fixed_run)(
            by_stage, mlp.x
        )
    mlp.assert_matches_the_loop(found)


@pytest.mark.parametrize("where", ["auto", "one-device-axis"])
@pytest.mark.cpu_mesh
def test_on_auto_axes_and_over_one_device_a_sharded_layer_axis_still_runs(mlp, where):
    if where == "auto":
        # Over Auto axes (not in the type), JAX slices the layer axis itself.
        auto = mesh_of((2, 4), ("layers", "model"), AxisType.Auto)
        on_auto = mlp.place(auto, "layers")
        found = (eqx_lean.fold(on_auto, mlp.x), eqx.filter_grad(sharded_loss)(on_auto, mlp.x))
        mlp.assert_matches_the_loop(found)
    else:
        # An Explicit axis of one device splits nothing.
        one = mesh_of((1, 8), ("layers", "model"))
        with jax.set_mesh(one):
            found = eqx_lean.fold(mlp.place(one, "layers"), mlp.x)
        mlp.assert_matches_the_loop(found, with_grad=False)


@pytest.mark.cpu_mesh
def test_a_tuple_of_mesh_axes_is_named(mlp):
    explicit = layers_and_model()
    cube = mesh_of((2, 2, 2), ("layers", "model", "data"))
    over_two = NamedSharding(cube, P(("layers", "model")))
    two = eqx.combine(jax.tree.map(lambda a: jax.device_put(a, over_two), mlp.params), mlp.static)
    with jax.set_mesh(explicit):
        with pytest.raises(ValueError) as info:
            eqx_lean.fold(two, mlp.x)
    assert info.type is ValueError, info.value
    message = str(info.value)
    assert "over mesh axes ('layers', 'model')" in message, message
    assert "NamedSharding(mesh, P(None, None, None))" in message, message
