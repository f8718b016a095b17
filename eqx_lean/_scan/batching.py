"""Which of `fold`/`scan`'s inputs an enclosing `jax.vmap` batches (and which are differentiated),
learnt while tracing.

The public custom VJP (`public_vjp`) cannot see a `vmap` around it: batched, its backward pass
gives one cotangent per example of a stack the batch does not reach, all of them at once
(issue 46 measured 1,032 MiB for a 128 MiB stack at batch 4), summed only afterwards. JAX's own
derivative of a scan over the stack sums layer by layer instead. So `fold` asks first.

The question is a `jax.custom_batching.custom_vmap` identity: every `vmap` that meets it calls
its rule with the batching of each input, while it traces. It is asked of values under
`jax.lax.stop_gradient`, so that a differentiation around `fold` never meets it (JAX
differentiates no `custom_vmap` in reverse mode); its result is unused, and whatever was staged
of it is dead code. Where some `vmap` batches something, a second question, a `jax.custom_jvp`
identity whose rule sees a symbolic zero for each leaf without a tangent, says which leaves are
differentiated: a frozen leaf gets no cotangent, so its being unbatched costs nothing.

A `vmap` of a function `jax.jit` traced on its own first (`jax.vmap(jax.jit(f))`) batches the
traced program, after `fold` has chosen: there the rule is called too late, and the custom
VJP's memory is what it is.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array

from .layer_vjp import is_inexact


def _batching_of(leaves: list[Array]) -> list[list[bool]]:
    """The batching of `leaves` under each `vmap` around this call (the innermost first)."""
    seen: list[list[bool]] = []

    @jax.custom_batching.custom_vmap
    def identity(leaves: list[Array]) -> list[Array]:
        return leaves

    @identity.def_vmap
    def rule(axis_size: int, in_batched: list[list[bool]], leaves: list[Array]) -> Any:
        del axis_size
        (batched,) = in_batched  # one per argument
        seen.append(list(batched))
        return leaves, batched

    identity([lax.stop_gradient(x) for x in leaves])
    return seen


def _differentiated(leaves: list[Array]) -> list[bool]:
    """Which of `leaves` some differentiation around this call gives a tangent: a
    `jax.custom_jvp` identity whose rule sees a symbolic zero for every other leaf. Its result
    is unused, and its rule gives the tangents back as they are (symbolic zeros included), so
    it adds nothing to the derivative."""
    live = [False] * len(leaves)

    @jax.custom_jvp
    def identity(leaves: list[Array]) -> list[Array]:
        return leaves

    def rule(primals: tuple[list[Array]], tangents: tuple[list[Any]]) -> Any:
        for j, t in enumerate(tangents[0]):
            live[j] = live[j] or not isinstance(t, SymbolicZero)
        return primals[0], tangents[0]

    identity.defjvp(rule, symbolic_zeros=True)
    identity(leaves)
    return live


def batch_leaves_stack(differentiable: list[Array], others: list[Array]) -> bool:
    """Whether some `vmap` around this call batches some input but not every differentiated
    leaf of `differentiable` (a stack or constants that the vmapped function closes over).

    The private primitive decides the same from its batching rule, where the differentiated
    inputs are its linear ones (`linear_call`'s `unbatched_fallback`).

    **Arguments:**

    - `differentiable`: the stack's and the constants' leaves.
    - `others`: the carry's and `xs`' leaves.
    """
    inexact = [x for x in differentiable if is_inexact(x)]
    if not inexact:
        return False
    plain = [x for x in others if not jnp.issubdtype(jnp.result_type(x), jax.dtypes.extended)]
    found = _batching_of([*inexact, *plain])
    if not found:  # no `vmap` around: nothing more to ask
        return False
    live = _differentiated(inexact)
    for batched in found:
        unbatched = [not b and d for b, d in zip(batched[: len(inexact)], live, strict=True)]
        if any(batched) and any(unbatched):
            return True
    return False
