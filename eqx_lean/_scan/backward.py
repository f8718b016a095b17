"""Reverse mode of `fold`/`scan`: layer `i` read by index, its gradient written in place.

The forward pass saves what the backward needs per layer (the carry entering it, and whatever
the remat policy keeps of the layer's own linearisation), stacked on the layer axis. The
backward pass walks the layers `L-1, ..., 0`, reads each layer out of the stack by index, calls
the VJP of the per-layer step on it, and writes the layer's gradient into row `i` of a buffer
of the stack's own dtype. Only the differentiated leaves (those with a tangent) get a buffer,
so a frozen base costs nothing.

JAX's own transpose of an index-reading loop would instead accumulate the stack's cotangent as
a loop-carried, stack-sized sum; that of a scan over the stack as `xs` (the earlier path, still
taken under `vmap` over a stack the batch does not reach) converts the whole stack to float32
ahead of the loop on CPU and stacks the per-layer cotangents. Hence a hand-written backward
pass (`forward_saving`, `backward`), attached in one of two ways:

- `differentiated_by_index` (here), where private JAX is allowed: as the transpose of the
    tangent of a `custom_jvp`, through `linear_call.linear_call_with_transpose`, so reverse
    mode runs the loops below and forward mode (`jvp`, `jacfwd`) the JVP of the forward-only
    index-reading loop;
- `public_vjp.differentiated_by_custom_vjp` elsewhere: as a `jax.custom_vjp` (reverse mode
    only).
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array

from .. import _platform
from .layer_vjp import (
    LayerLoops,
    Linearization,
    Step,
    StepInputs,
    depends_on,
    is_inexact,
    merge,
    rows_at,
    select,
    split_parts,
    write_rows,
    zeros_alike,
)
from .linear_call import linear_call_with_transpose
from .remat import LayerPolicy


def _forward_saving(
    loops: LayerLoops, carry: Any, start: Any, length: int
) -> tuple[Any, list[Array], list[Array], list[Array], Linearization]:
    """Runs layers `start, ..., start + length - 1`, saving what their backward pass needs.

    Returns the last carry, the `y` leaves, the carry leaves entering each layer (none if
    `lin.carry_saved` is false), the saved residuals (each of these three stacked on a leading
    axis of `length`) and the layers' linearisation `lin`.
    """
    lin = Linearization()
    activations = [j >= loops.step_inputs.num_fixed for j in range(len(loops.step_inputs.diff))]

    def body(state: tuple[Any, Any, list[Array]], _: None) -> tuple[Any, Any]:
        # The constants travel in the loop state, so that the VJP's residuals can be matched
        # against the very values it was given.
        i, carry, consts = state
        carry_leaves = jax.tree.leaves(carry)
        inputs = dataclasses.replace(loops, consts=consts).layer_inputs(i, carry_leaves)
        inexact, vjp_fn, others = loops.layer_vjp(inputs, lin)
        vjp_leaves, lin.vjp_tree = jax.tree.flatten(vjp_fn)
        # A residual that is an input (a slice of the stack, the carry, a constant) is read
        # again in the backward pass, and one computed from constants and the layer's arrays
        # alone (a cast, a transpose) is computed again there: saving either on the layer axis
        # would copy the stack. Only residuals that depend on the activations are saved.
        on_activations = depends_on(
            lambda *inputs: jax.tree.leaves(loops.layer_vjp(list(inputs))[1]), inputs, activations
        )
        position = {id(v): j for j, v in enumerate(inputs)}
        sources, saved = [], []
        for leaf, dependent in zip(vjp_leaves, on_activations, strict=True):
            if id(leaf) in position:
                sources.append(("input", position[id(leaf)]))
            elif dependent:
                sources.append(("saved", len(saved)))
                saved.append(jnp.asarray(leaf))
            else:
                sources.append(("recompute", 0))
        lin.sources = tuple(sources)
        carry_inputs = range(
            loops.step_inputs.num_fixed, loops.step_inputs.num_fixed + len(carry_leaves)
        )
        lin.carry_like = tuple(jax.ShapeDtypeStruct(jnp.shape(c), c.dtype) for c in carry_leaves)
        lin.carry_saved = any(kind == "input" and j in carry_inputs for kind, j in sources) or any(
            jnp.issubdtype(c.dtype, jax.dtypes.extended) for c in carry_leaves
        )
        new_carry, y = jax.tree.unflatten(lin.out_tree, merge(lin.out_inexact, inexact, others))
        carries = carry_leaves if lin.carry_saved else []
        return (i + 1, new_carry, consts), (carries, jax.tree.leaves(y), saved)

    (_, carry, _), (carries, ys, saved) = lax.scan(
        body, (start, carry, loops.consts), None, length=length, unroll=loops.unroll
    )
    return carry, ys, carries, saved, lin


@dataclasses.dataclass
class _Cotangents:
    """The backward loop's state: the carry's cotangent, and the gradients gathered so far."""

    carry: list[Array]  # of the carry's inexact leaves
    consts: list[Array]  # of the live constants, summed over layers
    stack: list[Array]  # of the live stacked leaves, row `i` written by layer `i`
    xs: list[Array]  # of the live `xs` leaves, row `i` written by layer `i`


jax.tree_util.register_dataclass(_Cotangents)


def _backward_segment(
    loops: LayerLoops,
    lin: Linearization,
    carries: list[Array],
    saved: list[Array],
    ct_ys: list[Array],
    cts: _Cotangents,
    start: Any,
    length: int,
) -> _Cotangents:
    """Backward pass of layers `start + length - 1, ..., start`, from `_forward_saving`'s
    `carries`, `saved` and `lin`; `ct_ys` holds the cotangents of the inexact `y` leaves."""
    recompute = any(kind == "recompute" for kind, _ in lin.sources)

    def body(state: tuple[Any, _Cotangents], _: None) -> tuple[Any, None]:
        k, cts = state
        # Whatever is read by index sits behind the barrier, so that no conversion of a whole
        # stacked residual is hoisted out of the loop either.
        carries_now, saved_now, ct_ys_now, i = _platform.barrier_on_cpu(
            (carries, saved, ct_ys, start + (length - 1) - k)
        )
        inputs = loops.layer_inputs(i, lin.carry_in(carries_now, i - start))
        saved_now = rows_at(saved_now, i - start)
        # XLA drops whatever part of this recomputation the backward pass does not read.
        again = jax.tree.leaves(loops.layer_vjp(inputs)[1]) if recompute else []
        vjp_leaves = [
            inputs[j] if kind == "input" else saved_now[j] if kind == "saved" else again[n]
            for n, (kind, j) in enumerate(lin.sources)
        ]
        vjp_fn = jax.tree.unflatten(lin.vjp_tree, vjp_leaves)
        ct_inputs = vjp_fn([*cts.carry, *rows_at(ct_ys_now, i)])
        ct_consts, ct_layer, ct_carry, ct_x = loops.step_inputs.split_cotangents(ct_inputs)
        cts = _Cotangents(
            carry=ct_carry,
            consts=[a + b.astype(a.dtype) for a, b in zip(cts.consts, ct_consts, strict=True)],
            stack=write_rows(cts.stack, ct_layer, i),
            xs=write_rows(cts.xs, ct_x, i),
        )
        return (k + 1, cts), None

    (_, cts), _ = lax.scan(body, (jnp.int32(0), cts), None, length=length, unroll=loops.unroll)
    return cts


def _forward_group_carries(
    loops: LayerLoops, carry: Any, num_layers: int, group_size: int
) -> tuple[Any, Any, list[Array]]:
    """The forward pass of nested remat: returns the last carry, the `ys`, and the carry
    leaves entering each group of `group_size` layers (row `g` for group `g`, plus a spare)."""
    num_groups = math.ceil(num_layers / group_size)
    y_tree: list[Any] = []

    def body(state: tuple[Any, Any, list[Array]], _: None) -> tuple[Any, list[Array]]:
        i, carry, group_carries = state
        carry_leaves = jax.tree.leaves(carry)
        # The carry entering a group goes to its row, any other to the spare last row.
        row = jnp.where(i % group_size == 0, i // group_size, num_groups)
        group_carries = write_rows(group_carries, carry_leaves, row)
        new_carry, y = loops.step(*loops.step_inputs.unflatten(loops.layer_inputs(i, carry_leaves)))
        y_tree[:] = [jax.tree.structure(y)]
        return (i + 1, new_carry, group_carries), jax.tree.leaves(y)

    rows = [
        jnp.broadcast_to(lax.full_like(c, 0), (num_groups + 1, *jnp.shape(c)))
        for c in jax.tree.leaves(carry)
    ]
    (_, carry, group_carries), ys = lax.scan(
        body, (jnp.int32(0), carry, rows), None, length=num_layers, unroll=loops.unroll
    )
    return carry, y_tree[0].unflatten(ys), group_carries


def _nested_backward(
    loops: LayerLoops,
    group_carries: list[Array],
    ct_ys: list[Array],
    cts: _Cotangents,
    num_layers: int,
    group_size: int,
) -> _Cotangents:
    """Backward pass of nested remat, one group at a time from the last: each group's forward
    is run again from the carry that entered it, saving its layers' carries (and what the
    policy keeps), then differentiated layer by layer."""
    num_full, rest = divmod(num_layers, group_size)

    def group(cts: _Cotangents, start: Any, length: int, carry_in: list[Array]) -> _Cotangents:
        carry = loops.step_inputs.treedefs[2].unflatten(carry_in)
        _, _, carries, saved, lin = _forward_saving(loops, carry, start, length)
        return _backward_segment(loops, lin, carries, saved, ct_ys, cts, start, length)

    if rest:  # the shorter last group, with static bounds
        start = jnp.int32(num_full * group_size)
        cts = group(cts, start, rest, rows_at(group_carries, num_full))
    if num_full:

        def outer(state: tuple[Any, _Cotangents], _: None) -> tuple[Any, None]:
            k, cts = state
            g = num_full - 1 - k
            return (k + 1, group(cts, g * group_size, group_size, rows_at(group_carries, g))), None

        (_, cts), _ = lax.scan(outer, (jnp.int32(0), cts), None, length=num_full)
    return cts


@dataclasses.dataclass(frozen=True, eq=False)
class ReversePlan:
    """What the backward pass of one differentiated call reads besides arrays, found while
    tracing its forward pass (compared and hashed by identity: it is static data that the
    public custom VJP carries inside its residuals' pytree structure)."""

    step: Step
    step_inputs: StepInputs
    policy: LayerPolicy
    unroll: int | bool
    num_layers: int
    group_size: int | None
    lin: Linearization  # found per group in the backward pass, for nested remat
    num_carries: int  # the leading residuals that are the carries entering each layer


def forward_saving(
    step: Step,
    treedefs: tuple[Any, ...],
    leaves: list[Array],
    live: list[bool],
    policy: LayerPolicy,
    num_layers: int,
    group_size: int | None,
    unroll: int | bool,
) -> tuple[tuple[Any, Any], list[Array], ReversePlan]:
    """The forward pass that saves what `backward` needs.

    **Arguments:**

    - `step`: the closure-converted per-layer step, `(consts, layer, carry, x) -> (carry, y)`.
    - `treedefs`: of the constants (a list), the stack, the carry and `xs`.
    - `leaves`: the leaves of `(consts, stack, carry, xs)`.
    - `live`: per leaf, whether its cotangent is wanted (an inexact leaf with a tangent).
    - `policy`, `group_size`, `unroll`, `num_layers`: as for `differentiated_by_index`.

    **Returns:**

    `((carry, ys), residuals, plan)`: the outputs, the arrays saved for the backward pass, and
    the rest of what it needs.
    """
    consts, stack, carry_leaves, xs = split_parts(leaves, [t.num_leaves for t in treedefs[:3]])
    live_parts = split_parts(live, [t.num_leaves for t in treedefs[:3]])
    step_inputs = StepInputs(
        treedefs,
        live_consts=tuple(live_parts[0]),
        live_stack=tuple(live_parts[1]),
        inexact_carry=tuple(is_inexact(c) for c in carry_leaves),
        live_carry=tuple(live_parts[2]),
        live_xs=tuple(live_parts[3]),
    )
    loops = LayerLoops(step, step_inputs, policy, consts, stack, xs, unroll)
    carry = treedefs[2].unflatten(carry_leaves)
    if group_size is None:
        carry_out, ys, carries, saved, lin = _forward_saving(loops, carry, jnp.int32(0), num_layers)
        ys = lin.out_tree.children()[1].unflatten(ys)
        residuals, num_carries = [*carries, *saved], len(carries)
    else:
        carry_out, ys, residuals = _forward_group_carries(loops, carry, num_layers, group_size)
        lin, num_carries = Linearization(), 0
    plan = ReversePlan(step, step_inputs, policy, unroll, num_layers, group_size, lin, num_carries)
    return (carry_out, ys), residuals, plan


def backward(
    plan: ReversePlan, primals: list[Array], residuals: list[Array], cts_out: list[Array]
) -> list[Array]:
    """The backward pass: from the cotangents of the inexact outputs (the carry's, then the
    `ys`'), the cotangents of the live inputs, in the order of `primals`.

    **Arguments:**

    - `plan`, `residuals`: as `forward_saving` returned them.
    - `primals`: the leaves `forward_saving` was given.
    - `cts_out`: one cotangent per inexact output leaf of `(carry, ys)`.
    """
    step_inputs = plan.step_inputs
    consts, stack, _, xs = step_inputs.split(primals)
    num_ct_carry = sum(step_inputs.inexact_carry)
    cts = _Cotangents(
        carry=list(cts_out[:num_ct_carry]),
        consts=[jnp.zeros_like(c) for c in select(consts, step_inputs.live_consts)],
        stack=[zeros_alike(s) for s in select(stack, step_inputs.live_stack)],
        xs=[zeros_alike(x) for x in select(xs, step_inputs.live_xs)],
    )
    loops = LayerLoops(plan.step, step_inputs, plan.policy, consts, stack, xs, plan.unroll)
    ct_ys = list(cts_out[num_ct_carry:])
    if plan.group_size is None:
        carries, saved = split_parts(residuals, [plan.num_carries])
        cts = _backward_segment(loops, plan.lin, carries, saved, ct_ys, cts, 0, plan.num_layers)
    else:
        cts = _nested_backward(loops, residuals, ct_ys, cts, plan.num_layers, plan.group_size)
    live_carry = select(step_inputs.live_carry, step_inputs.inexact_carry)
    return [*cts.consts, *cts.stack, *select(cts.carry, live_carry), *cts.xs]


def differentiated_by_index(
    step: Step,
    primal: Callable[..., tuple[Any, Any]],
    differentiable: Callable[..., tuple[Any, Any]],
    args: tuple[list[Array], Any, Any, Any],
    num_layers: int,
    policy: LayerPolicy,
    group_size: int | None,
    unroll: int | bool,
) -> tuple[Any, Any]:
    """Returns `primal(*args)`, differentiated in reverse mode by the index-reading loops here,
    through the private primitive of `linear_call` (its custom transpose).

    **Arguments:**

    - `step`: the closure-converted per-layer step, `(consts, layer, carry, x) -> (carry, y)`.
    - `primal`: the forward-only loop, `(consts, stack, carry, xs) -> (carry, ys)`; forward
        mode differentiates it as plain JAX.
    - `differentiable`: the same function as a `lax.scan` over the stack, whose derivatives JAX
        derives itself: used under `vmap` when some differentiated input is not batched (a
        stack the vmapped function closes over), where the loops here would build one
        gradient of the whole stack per example.
    - `args`: `(consts, stack, carry, xs)`, the stack holding only the stacked arrays.
    - `num_layers`: `L`.
    - `policy`: per layer, `SAVE_ALL` (no checkpoint) or a `jax.checkpoint_policies` policy
        (`nothing_saveable` for `remat=True`); within a group for nested remat.
    - `group_size`: `None`, or nested remat's group size.
    - `unroll`: as for `jax.lax.scan`, for the loops over layers.

    **Returns:**

    `(carry, ys)`, as `primal`.
    """
    leaves, treedef, treedefs = flat_arguments(args)

    @jax.custom_jvp
    def run(leaves: list[Array]) -> tuple[Any, Any]:
        return primal(*treedef.unflatten(leaves))

    def run_jvp(primals: tuple[list[Array]], tangents: tuple[list[Any]]) -> tuple[Any, Any]:
        (leaves,), (tangent_leaves,) = primals, tangents
        # A leaf with a symbolic-zero tangent (a frozen leaf) gets no cotangent at all.
        live = [
            is_inexact(x) and not isinstance(t, SymbolicZero)
            for x, t in zip(leaves, tangent_leaves, strict=True)
        ]
        (carry_out, ys), residuals, plan = forward_saving(
            step, treedefs, leaves, live, policy, num_layers, group_size, unroll
        )
        out_leaves, out_tree = jax.tree.flatten((carry_out, ys))
        out_inexact = [is_inexact(o) for o in out_leaves]
        num_primals = len(leaves)

        def tangent_of(forward: Callable[..., tuple[Any, Any]]) -> Callable[..., list[Array]]:
            """Forward mode: `(primals, residuals, tangents) -> output tangents` of `forward`."""

            def tangent(*flat: Array) -> list[Array]:
                primals, _, lin_tangents = split_parts(flat, [num_primals, len(residuals)])

                def of_live(*live_values: Array) -> list[Array]:
                    values = merge(live, live_values, select(primals, live, keep=False))
                    out = jax.tree.leaves(forward(*treedef.unflatten(values)))
                    return select(out, out_inexact)

                return jax.jvp(of_live, select(primals, live), lin_tangents)[1]

            return tangent

        # The JVP of the forward-only loop, transposed by `transpose` below; and the same through
        # the scan over the stack, which JAX transposes itself (used under `vmap`, see above).
        tangent, tangent_by_jax = tangent_of(primal), tangent_of(differentiable)

        def transpose(*flat: Array) -> list[Array]:
            """Reverse mode: the backward loop, from the cotangents of the inexact outputs."""
            primals, res, cts_out = split_parts(flat, [num_primals, len(residuals)])
            return backward(plan, primals, res, cts_out)

        lin_tangents = select(tangent_leaves, live)
        if lin_tangents:
            tangents_out = linear_call_with_transpose(
                tangent,
                transpose,
                [*leaves, *residuals],
                lin_tangents,
                select(out_leaves, out_inexact),
                unbatched_fallback=tangent_by_jax,
            )
        else:  # only integer leaves had (float0) tangents
            tangents_out = [jnp.zeros_like(o) for o in select(out_leaves, out_inexact)]
        float0_zeros = [
            np.zeros(jnp.shape(o), jax.dtypes.float0)
            for o in select(out_leaves, out_inexact, keep=False)
        ]
        return (carry_out, ys), out_tree.unflatten(merge(out_inexact, tangents_out, float0_zeros))

    run.defjvp(run_jvp, symbolic_zeros=True)
    return run(leaves)


def flat_arguments(args: tuple[list[Array], Any, Any, Any]) -> tuple[list[Array], Any, Any]:
    """The leaves of `(consts, stack, carry, xs)`, their treedef, and each part's treedef.

    Python scalars in the carry become arrays here rather than inside each loop.
    """
    consts, stack, carry, xs = args
    args = (list(consts), stack, jax.tree.map(jnp.asarray, carry), xs)
    leaves, treedef = jax.tree.flatten(args)
    return leaves, treedef, tuple(jax.tree.structure(a) for a in args)
