"""Which of `fold`/`scan`'s inputs an enclosing `jax.vmap` batches, learnt while tracing.

The public custom VJP (`public_vjp`) cannot see a `vmap` around it: batched, its backward pass
gives one cotangent per example of a stack the batch does not reach, all of them at once
(issue 46 measured 1,032 MiB for a 128 MiB stack at batch 4), summed only afterwards. JAX's own
derivative of a scan over the stack sums layer by layer instead. So `fold` asks first.

The question is a `jax.custom_batching.custom_vmap` identity: every `vmap` that meets it calls
its rule with the batching of each input, while it traces. It is asked of values under
`jax.lax.stop_gradient`, so that a differentiation around `fold` never meets it (JAX
differentiates no `custom_vmap` in reverse mode); its result is unused, and whatever was staged
of it is dead code.

A `vmap` of a function `jax.jit` traced on its own first (`jax.vmap(jax.jit(f))`) batches the
traced program, after `fold` has chosen: there the rule is called too late, and the custom
VJP's memory is what it is.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
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


def batch_leaves_stack(differentiable: list[Array], others: list[Array]) -> bool:
    """Whether some `vmap` around this call batches some input but not every inexact leaf of
    `differentiable` (a stack or constants that the vmapped function closes over).

    **Arguments:**

    - `differentiable`: the stack's and the constants' leaves.
    - `others`: the carry's and `xs`' leaves.
    """
    inexact = [x for x in differentiable if is_inexact(x)]
    if not inexact:
        return False
    plain = [x for x in others if not jnp.issubdtype(jnp.result_type(x), jax.dtypes.extended)]
    for batched in _batching_of([*inexact, *plain]):
        if any(batched) and not all(batched[: len(inexact)]):
            return True
    return False
