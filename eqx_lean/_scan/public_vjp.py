"""Reverse mode of `fold`/`scan` on public JAX alone: `backward`'s loops as a `jax.custom_vjp`.

Taken wherever the private primitive of `linear_call` is not (a JAX other than the tested
series, or `EQX_LEAN_NO_PRIVATE_JAX=1`). The forward pass is `backward.forward_saving` (layer
`i` read by index, what `remat=` keeps saved per layer), the backward pass `backward.backward`
(layer `i` read by index, its gradient written into row `i` of a buffer of the stack's dtype),
so gradients cost what they cost on the private path.

What a `custom_vjp` cannot do, and what `fold`/`scan` do instead:

- forward mode: JAX refuses to differentiate a `custom_vjp` function forwards (`jax.jvp`,
    `jax.jacfwd`; forward over reverse such as `jax.hessian` works: it differentiates the
    backward pass, plain JAX, forwards). The refusal is re-raised here naming `fold`/`scan`
    where JAX raises it while `fold` runs (outside `jax.jit`); inside `jax.jit`, JAX raises its
    own when lowering.
- `vmap` over a stack the batch does not reach: the backward pass would give one gradient of
    the whole stack per example, summed only afterwards. `fold`/`scan` take JAX's derivative
    of a scan over the stack there instead (`batching.batch_leaves_stack`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array

from .backward import ReversePlan, backward, flat_arguments, forward_saving
from .layer_vjp import Step, is_inexact, merge, select
from .remat import LayerPolicy


@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
    """Python data carried to the backward pass in the residuals' pytree structure, so that
    each trace of the forward pass hands its own plan to the backward pass traced with it."""

    plan: ReversePlan | None
    live: tuple[bool, ...]
    out_inexact: tuple[bool, ...]


jax.tree_util.register_pytree_node(
    _Static, lambda s: ((), s), lambda s, _: s
)  # no leaves: all static


# JAX's refusal (`raise_custom_vjp_error_on_jvp` in jax/_src/interpreters/ad.py, 0.10.2), matched
# by its text: no public type tells it apart. Should the text change, JAX's own error passes.
_FORWARD_MODE = "can't apply forward-mode autodiff (jvp) to a custom_vjp function"


def _refusing_forward_mode(run: Callable[[], Any], name: str) -> Any:
    try:
        return run()
    except TypeError as e:
        if _FORWARD_MODE not in str(e):
            raise
        raise TypeError(
            f"`eqx_lean.{name}` cannot be differentiated in forward mode (`jax.jvp`, "
            "`jax.jacfwd`) on this JAX: its lean backward pass here is a `jax.custom_vjp`, which "
            "JAX differentiates in reverse mode only (`jax.grad`, `jax.vjp`, `jax.jacrev`, "
            "`jax.hessian`). Forward mode needs the private-JAX path, taken on JAX "
            "0.10 without `EQX_LEAN_NO_PRIVATE_JAX=1`."
        ) from e


def differentiated_by_custom_vjp(
    step: Step,
    primal: Callable[..., tuple[Any, Any]],
    args: tuple[list[Array], Any, Any, Any],
    num_layers: int,
    policy: LayerPolicy,
    group_size: int | None,
    unroll: int | bool,
    name: str,
) -> tuple[Any, Any]:
    """Returns `primal(*args)`, differentiated in reverse mode by `backward`'s loops through a
    public `jax.custom_vjp`.

    **Arguments:**

    - `step`, `primal`, `args`, `num_layers`, `policy`, `group_size`, `unroll`: as for
        `backward.differentiated_by_index`.
    - `name`: `"fold"` or `"scan"`, for the refusal of forward mode.

    **Returns:**

    `(carry, ys)`, as `primal`.
    """
    leaves, treedef, treedefs = flat_arguments(args)

    @jax.custom_vjp
    def run(leaves: list[Array]) -> tuple[Any, Any]:
        return primal(*treedef.unflatten(leaves))

    def run_fwd(leaves: list[Any]) -> tuple[Any, Any]:
        values = [p.value for p in leaves]
        # Only the leaves with a tangent get a cotangent, so a frozen base costs nothing.
        live = [is_inexact(p.value) and p.perturbed for p in leaves]
        if not any(live):  # only integer leaves had (float0) tangents
            out = primal(*treedef.unflatten(values))
            out_inexact = tuple(is_inexact(o) for o in jax.tree.leaves(out))
            return out, (values, [], _Static(None, tuple(live), out_inexact))
        out, residuals, plan = forward_saving(
            step, treedefs, values, live, policy, num_layers, group_size, unroll
        )
        out_inexact = tuple(is_inexact(o) for o in jax.tree.leaves(out))
        return out, (values, residuals, _Static(plan, tuple(live), out_inexact))

    def run_bwd(saved: Any, cts: Any) -> tuple[list[Any]]:
        values, residuals, static = saved
        ct_leaves = jax.tree.leaves(cts, is_leaf=lambda x: isinstance(x, SymbolicZero))
        inexact_cts = [
            ct.instantiate() if isinstance(ct, SymbolicZero) else ct
            for ct in select(ct_leaves, static.out_inexact)
        ]
        if static.plan is None:
            live_cts = []
        else:
            live_cts = backward(static.plan, values, residuals, inexact_cts)
        return (merge(static.live, live_cts, [None] * (len(values) - len(live_cts))),)

    run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
    return _refusing_forward_mode(lambda: run(leaves), name)
