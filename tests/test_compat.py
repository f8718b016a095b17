"""Private JAX in one place (`_compat.py`): version-gated, each use with a tested fallback.

Every fallback is forced here, and the library must then give exactly the values of the normal
path, eagerly and under `jit`, `vmap`, `grad` and `eqx.filter_eval_shape`.
"""

import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_lean
from eqx_lean import _compat
from eqx_lean.bench._models import Block, BlockConfig


TINY = BlockConfig(num_layers=3, dim=16, hidden=24, heads=2, kv_heads=1)
KEYS = jax.random.split(jax.random.key(3), 3)


def make_block(key):
    return Block(TINY, key=key)


def scaled_draw(scale):
    # Large enough (>= 2**16 counters) to take the unrolled hash when the override is on.
    return lambda key: {"w": jax.random.normal(key, (256, 300)) * scale, "b": jnp.zeros(3)}


def assert_bitwise(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if isinstance(x, jax.ShapeDtypeStruct):
            assert (x.shape, x.dtype) == (y.shape, y.dtype)
            continue
        assert x.dtype == y.dtype
        x_bytes = np.atleast_1d(np.asarray(x)).view(np.uint8)
        np.testing.assert_array_equal(x_bytes, np.atleast_1d(np.asarray(y)).view(np.uint8))


def every_use(tmp_path):
    """Build, load and scan eagerly and under each transformation; a dict of results."""
    results = {}
    results["build"] = eqx_lean.build_stacked(make_block, KEYS, jnp.bfloat16)
    results["build/jit"] = jax.jit(
        lambda keys: eqx_lean.build_stacked(make_block, keys, jnp.bfloat16)
    )(KEYS)
    results["build/eval_shape"] = eqx.filter_eval_shape(
        eqx_lean.build_stacked, make_block, KEYS, jnp.bfloat16
    )
    results["build/vmap"] = jax.vmap(lambda s: eqx_lean.build_stacked(scaled_draw(s), KEYS))(
        jnp.array([1.0, 2.0])
    )
    results["build/grad"] = jax.grad(
        lambda s: eqx_lean.build_stacked(scaled_draw(s), KEYS)["w"].sum()
    )(1.5)

    names = lambda path, _: "layers.{i}" + jax.tree_util.keystr(path)  # noqa: E731
    eqx_lean.save_stacked(tmp_path / "ckpt", results["build"], names)
    like = eqx.filter_eval_shape(eqx_lean.build_stacked, make_block, KEYS, jnp.bfloat16)
    results["load"] = eqx_lean.load_stacked(tmp_path / "ckpt", like, names)

    stacked = eqx_lean.build_stacked(lambda k: eqx.nn.Linear(16, 16, key=k), KEYS)
    x = jnp.linspace(-1, 1, 16)

    def run(stacked, x):
        return eqx_lean.fold(stacked, x, call=lambda layer, x: x + 0.1 * jnp.tanh(layer(x)))

    results["scan"] = run(stacked, x)
    results["scan/jit"] = jax.jit(run)(stacked, x)
    results["scan/vmap"] = jax.vmap(run, in_axes=(None, 0))(stacked, x[None])
    results["scan/grad"] = jax.grad(lambda s, x: run(s, x).sum())(stacked, x)
    results["scan/eval_shape"] = eqx.filter_eval_shape(run, stacked, x)
    return results


def test_private_apis_are_used_on_the_tested_jax():
    assert _compat.private_jax_allowed()
    assert _compat.can_override_lowering()
    assert _compat.has_custom_transpose()


def test_another_jax_series_takes_the_fallbacks(monkeypatch):
    monkeypatch.setattr(jax, "__version_info__", (0, 11, 0))
    assert not _compat.private_jax_allowed()
    assert not _compat.can_override_lowering()
    assert not _compat.has_custom_transpose()


def test_forced_fallbacks_give_the_same_values(tmp_path):
    normal = every_use(tmp_path / "normal")
    with _compat.without_private_jax():
        assert not _compat.can_override_lowering()
        eqx_lean.clear_caches()  # so nothing compiled with the private path is reused
        fallback = every_use(tmp_path / "fallback")
    assert sorted(normal) == sorted(fallback)
    for name in normal:
        assert_bitwise(fallback[name], normal[name])


def test_a_jax_without_the_lowering_hook_takes_the_fallback(monkeypatch, tmp_path):
    # As if `Traced.lower` had no `_private_parameters`, and `jax.interpreters.mlir` no longer
    # imported: JAX's own lowering, the same values.
    normal = eqx_lean.build_stacked(make_block, KEYS, jnp.bfloat16)
    import jax.interpreters

    monkeypatch.delattr(jax.interpreters, "mlir")
    monkeypatch.setitem(sys.modules, "jax.interpreters.mlir", None)
    _compat._lowering_api.cache_clear()
    try:
        assert _compat._lowering_api() is None
        assert not _compat.can_override_lowering()
        eqx_lean.clear_caches()
        assert_bitwise(eqx_lean.build_stacked(make_block, KEYS, jnp.bfloat16), normal)
    finally:
        _compat._lowering_api.cache_clear()
        eqx_lean.clear_caches()


def test_shard_alike_is_found_where_this_jax_keeps_it():
    from jax.experimental.shard_alike import shard_alike

    _compat._find_shard_alike.cache_clear()
    assert _compat._find_shard_alike() is shard_alike


def test_a_jax_without_shard_alike_runs_on_one_device_and_says_so_on_several(monkeypatch):
    # JAX 0.11.2 (seen on a lent GPU machine) has no `jax.experimental.shard_alike`; a single
    # device needs nothing tied, several cannot do without it.
    x, y = jnp.arange(3.0), jnp.zeros(3)
    monkeypatch.setattr(_compat, "_SHARD_ALIKE_HOMES", ("no_such_module_here", "jax.numpy"))
    _compat._find_shard_alike.cache_clear()
    try:
        assert _compat._find_shard_alike() is None
        tied_x, tied_y = _compat.shard_alike(x, y)
        assert tied_x is x and tied_y is y
        monkeypatch.setattr(jax, "device_count", lambda: 8)
        with pytest.raises(NotImplementedError, match="needs `shard_alike`.*use JAX 0.10"):
            _compat.shard_alike(x, y)
    finally:
        _compat._find_shard_alike.cache_clear()


@pytest.mark.parametrize("value", ["1", "0"])
def test_the_environment_variable_forces_the_fallbacks(value):
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        import eqx_lean
        from eqx_lean import _compat
        keys = jax.random.split(jax.random.key(0), 2)
        built = eqx_lean.build_stacked(lambda k: jax.random.normal(k, (256, 300)), keys)
        print(_compat.can_override_lowering(), float(built.sum()))
        """
    )
    env = {"EQX_LEAN_NO_PRIVATE_JAX": value, "JAX_PLATFORMS": "cpu", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == ("False" if value == "1" else "True")
    keys = jax.random.split(jax.random.key(0), 2)
    expected = float(jax.vmap(lambda k: jax.random.normal(k, (256, 300)))(keys).sum())
    assert float(out[1]) == pytest.approx(expected, rel=1e-6)


def assert_close(found, expected):
    for a, b in zip(jax.tree.leaves(found), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


# --- linear_call_with_transpose ---------------------------------------------------------------


def scale(r, x):
    return [x * r]


def scale_transposed(r, ct):
    return [ct * r]


def twice_scale_transposed(r, ct):
    # Deliberately not `scale`'s transpose: shows which of the two a derivative ran.
    return [2 * ct * r]


def loss_with(transpose):
    def loss(x):
        r = jnp.cos(x)  # a residual that depends on `x` (not differentiated through here)
        (y,) = _compat.linear_call_with_transpose(
            scale, transpose, [jax.lax.stop_gradient(r)], [x], [x]
        )
        return jnp.sum(jnp.sin(y))

    return loss


def reference(x):
    return jnp.sum(jnp.sin(x * jax.lax.stop_gradient(jnp.cos(x))))


X = jnp.array([0.3, -1.2, 2.0])
XS = jnp.stack([X, 0.5 * X])


def test_reverse_mode_runs_the_custom_transpose():
    assert _compat.has_custom_transpose()
    loss = loss_with(twice_scale_transposed)
    assert_close(jax.grad(loss)(X), 2 * jax.grad(reference)(X))
    assert_close(jax.jit(jax.grad(loss))(X), 2 * jax.grad(reference)(X))
    assert_close(jax.vmap(jax.grad(loss))(XS), 2 * jax.vmap(jax.grad(reference))(XS))
    batched = lambda f: lambda xs: jnp.sum(jax.vmap(f)(xs))  # noqa: E731
    assert_close(jax.grad(batched(loss))(XS), 2 * jax.grad(batched(reference))(XS))


def test_forward_mode_runs_the_function():
    loss = loss_with(twice_scale_transposed)
    assert_close(jax.jvp(loss, (X,), (XS[1],)), jax.jvp(reference, (X,), (XS[1],)))
    assert_close(jax.jacfwd(loss)(X), jax.jacfwd(reference)(X))


def test_fallback_derives_the_transpose_from_the_function():
    with _compat.without_private_jax():
        assert not _compat.has_custom_transpose()
        loss = loss_with(twice_scale_transposed)
        assert_close(jax.grad(loss)(X), jax.grad(reference)(X))
    assert _compat.has_custom_transpose()


def nonlinear_loss(x):
    # The residual is differentiated too: second-order forward mode differentiates `scale`.
    (y,) = _compat.linear_call_with_transpose(scale, scale_transposed, [jnp.cos(x)], [x], [x])
    return jnp.sum(jnp.sin(y))


def nonlinear_reference(x):
    return jnp.sum(jnp.sin(x * jnp.cos(x)))


@pytest.mark.parametrize(
    "transform",
    [
        jax.grad,
        jax.jacfwd,
        jax.hessian,
        lambda f: jax.jacfwd(jax.jacfwd(f)),
        lambda f: jax.jacrev(jax.jacrev(f)),
        lambda f: jax.jacrev(jax.jacfwd(f)),
    ],
    ids=["grad", "jacfwd", "hessian", "jacfwd-jacfwd", "jacrev-jacrev", "jacrev-jacfwd"],
)
def test_higher_order_derivatives_match_plain_jax(transform):
    assert_close(transform(nonlinear_loss)(X), transform(nonlinear_reference)(X))


def test_batching_keeps_unbatched_outputs_unbatched():
    # An output summed over the named axis is not batched: neither is its tangent, nor then
    # the primal output of a `custom_jvp` around it.
    def total(r, x):
        return [jax.lax.psum(x, "batch") * r]

    def total_transposed(r, ct):
        return [ct * r]  # each example's share of the (unbatched) sum's cotangent

    @jax.custom_jvp
    def summed(x):
        return jax.lax.psum(x, "batch")

    @summed.defjvp
    def summed_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        out = summed(x)
        (t_out,) = _compat.linear_call_with_transpose(total, total_transposed, [1.0], [t], [out])
        return out, t_out

    def loss(xs):
        out = jax.vmap(summed, axis_name="batch", out_axes=None)(xs)
        return jnp.sum(jnp.sin(out))

    def loss_reference(xs):
        return jnp.sum(jnp.sin(jnp.sum(xs, axis=0)))

    assert_close(jax.grad(loss)(XS), jax.grad(loss_reference)(XS))
    assert_close(jax.jacfwd(loss)(XS), jax.jacfwd(loss_reference)(XS))
