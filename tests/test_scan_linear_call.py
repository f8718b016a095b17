"""The primitive through which `fold` and `scan` run their own backward
(`eqx_lean._scan.linear_call`): reverse mode runs the custom transpose, forward mode the
function, and with private JAX forced off JAX derives the transpose; higher-order derivatives
and batching agree with plain JAX.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_lean.internal import (
    has_custom_transpose,
    linear_call_with_transpose,
    without_private_jax,
)


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
        (y,) = linear_call_with_transpose(scale, transpose, [jax.lax.stop_gradient(r)], [x], [x])
        return jnp.sum(jnp.sin(y))

    return loss


def reference(x):
    return jnp.sum(jnp.sin(x * jax.lax.stop_gradient(jnp.cos(x))))


X = jnp.array([0.3, -1.2, 2.0])
XS = jnp.stack([X, 0.5 * X])


@pytest.mark.private_jax
def test_reverse_mode_runs_the_custom_transpose():
    assert has_custom_transpose()
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


@pytest.mark.private_jax
def test_fallback_derives_the_transpose_from_the_function():
    with without_private_jax():
        assert not has_custom_transpose()
        loss = loss_with(twice_scale_transposed)
        assert_close(jax.grad(loss)(X), jax.grad(reference)(X))
    assert has_custom_transpose()


def nonlinear_loss(x):
    # The residual is differentiated too: second-order forward mode differentiates `scale`.
    (y,) = linear_call_with_transpose(scale, scale_transposed, [jnp.cos(x)], [x], [x])
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
        (t_out,) = linear_call_with_transpose(total, total_transposed, [1.0], [t], [out])
        return out, t_out

    def loss(xs):
        out = jax.vmap(summed, axis_name="batch", out_axes=None)(xs)
        return jnp.sum(jnp.sin(out))

    def loss_reference(xs):
        return jnp.sum(jnp.sin(jnp.sum(xs, axis=0)))

    assert_close(jax.grad(loss)(XS), jax.grad(loss_reference)(XS))
    assert_close(jax.jacfwd(loss)(XS), jax.jacfwd(loss_reference)(XS))
