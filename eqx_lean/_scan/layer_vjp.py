"""One layer's VJP inside the loops of `backward`: how the step's flat inputs split, what
its linearisation reads and saves, which residuals depend on the activations, and the small
list and row helpers the loops share."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array

from .. import _platform
from .._compat import shard_alike
from .._core.sharding import explicit_spec, explicit_type_sharding
from .remat import LayerPolicy, checkpointed


# `(consts, layer, carry, x) -> (carry, y)`, the closure-converted per-layer step.
Step = Callable[[list[Array], Any, Any, Any], tuple[Any, Any]]


def is_inexact(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def select(values: Sequence[Any], mask: Sequence[bool], keep: bool = True) -> list[Any]:
    return [v for v, m in zip(values, mask, strict=True) if m == keep]


def merge(mask: Sequence[bool], chosen: Sequence[Any], others: Sequence[Any]) -> list[Any]:
    """Inverse of `select`: `chosen` where `mask` is set, `others` elsewhere, in order."""
    chosen_iter, others_iter = iter(chosen), iter(others)
    return [next(chosen_iter) if m else next(others_iter) for m in mask]


def split_parts(flat: Sequence[Any], counts: Sequence[int]) -> list[list[Any]]:
    """Splits `flat` into consecutive parts of the given lengths, and the rest."""
    bounds = np.cumsum((0, *counts))
    return [list(flat[a:b]) for a, b in zip(bounds, [*bounds[1:], len(flat)], strict=True)]


def rows_at(leaves: Sequence[Array], i: Any) -> list[Array]:
    return [lax.dynamic_index_in_dim(a, i, keepdims=False) for a in leaves]


def write_rows(buffers: Sequence[Array], rows: Sequence[Array], i: Any) -> list[Array]:
    return [
        lax.dynamic_update_index_in_dim(b, _row_of(b, r.astype(b.dtype)), i, 0)
        for b, r in zip(buffers, rows, strict=True)
    ]


def _row_of(buffer: Array, row: Array) -> Array:
    """`row` sharded as one row of `buffer`, where `buffer`'s type names Explicit mesh axes (JAX
    updates a slice only with a value of the same sharding). A layer's gradient usually is
    already; on a mesh mixing Explicit and Auto axes it comes back from the layer's VJP without
    the stack's sharding."""
    spec = explicit_spec(buffer)
    if spec is None:
        return row
    sharding = cast(NamedSharding, explicit_type_sharding(buffer))
    return jax.sharding.reshard(row, sharding.update(spec=PartitionSpec(*spec[1:])))


def zeros_alike(x: Array) -> Array:
    """Zeros shaped, typed and sharded like `x`, to write a stacked gradient into.

    `jax.experimental.shard_alike` ties the two shardings even where `x`'s is known only to
    the compiler (inside `jax.jit`), so the gradient of a sharded stack comes back sharded
    as the stack is, each layer's gradient written into its own shards.
    """
    zeros = lax.full_like(x, 0)
    return zeros if jax.device_count() == 1 else shard_alike(x, zeros)[1]


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """How a layer's flat inputs `consts + layer + carry + x` split and which are differentiated.

    `live_*` mark the leaves whose cotangent is wanted (those with a tangent). The carry's
    inexact leaves are always differentiated: the cotangent flows back through them.
    """

    treedefs: tuple[Any, ...]  # of the consts (a list), the stack, the carry and xs
    live_consts: tuple[bool, ...]
    live_stack: tuple[bool, ...]
    inexact_carry: tuple[bool, ...]
    live_carry: tuple[bool, ...]
    live_xs: tuple[bool, ...]

    @property
    def diff(self) -> tuple[bool, ...]:
        return self.live_consts + self.live_stack + self.inexact_carry + self.live_xs

    @property
    def num_fixed(self) -> int:
        """The number of inputs that are not activations (constants and the layer's arrays)."""
        return len(self.live_consts) + len(self.live_stack)

    def split(self, flat: Sequence[Any]) -> list[list[Any]]:
        """Splits `consts + layer + carry + x` into its four parts."""
        return split_parts(flat, [t.num_leaves for t in self.treedefs[:3]])

    def unflatten(self, flat: Sequence[Any]) -> tuple[Any, ...]:
        consts, *parts = self.split(flat)
        return consts, *(t.unflatten(p) for t, p in zip(self.treedefs[1:], parts, strict=True))

    def split_cotangents(self, cts: Sequence[Array]) -> list[list[Array]]:
        """Splits the cotangents of the differentiated inputs into their four parts."""
        counts = [sum(m) for m in (self.live_consts, self.live_stack, self.inexact_carry)]
        return split_parts(cts, counts)


@dataclasses.dataclass
class Linearization:
    """What one layer's VJP is made of, found while tracing the forward loop's body.

    `sources[k]` says where leaf `k` of the VJP function comes from in the backward pass:
    `("input", j)`, input `j` of the layer (a constant, a slice of the stack, the carry, `x`),
    read again; `("saved", j)`, residual `j`, saved per layer on the layer axis; or
    `("recompute", 0)`, a residual computed from constants and the layer's arrays alone.
    """

    vjp_tree: Any = None
    sources: tuple[tuple[str, int], ...] = ()
    out_tree: Any = None
    out_inexact: tuple[bool, ...] = ()
    # Whether the carry entering each layer is saved: not when the VJP does not read it (with
    # no checkpoint, it may need only values computed from it), then `carry_like` stands in.
    carry_saved: bool = True
    carry_like: tuple[jax.ShapeDtypeStruct, ...] = ()

    def carry_in(self, carries: list[Array], at: Any) -> list[Array]:
        if self.carry_saved:
            return rows_at(carries, at)
        # Read by nothing but a recomputation that does not depend on it, which XLA drops.
        return [jnp.zeros(c.shape, c.dtype) for c in self.carry_like]


@dataclasses.dataclass(frozen=True)
class LayerLoops:
    """What every loop over layers reads: the per-layer step and how its inputs split, the
    policy, the constants, the stack's and `xs`'s leaves, and `jax.lax.scan`'s `unroll`."""

    step: Step
    step_inputs: StepInputs
    policy: LayerPolicy
    consts: list[Array]
    stack: list[Array]
    xs: list[Array]
    unroll: int | bool

    def layer_vjp(
        self, inputs: list[Any], lin: Linearization | None = None
    ) -> tuple[list[Array], Callable[..., Any], list[Array]]:
        """`jax.vjp` of one layer with respect to its differentiated inputs: returns the
        inexact outputs, the VJP function, and the other outputs (integers, keys)."""
        lin = Linearization() if lin is None else lin
        diff = self.step_inputs.diff

        def layer(*diff_values: Array) -> tuple[list[Array], list[Array]]:
            values = merge(diff, diff_values, select(inputs, diff, keep=False))
            leaves, lin.out_tree = jax.tree.flatten(self.step(*self.step_inputs.unflatten(values)))
            lin.out_inexact = tuple(is_inexact(o) for o in leaves)
            return select(leaves, lin.out_inexact), select(leaves, lin.out_inexact, False)

        if callable(self.policy):  # not SAVE_ALL
            layer = checkpointed(layer, self.policy)
        return jax.vjp(layer, *select(inputs, diff), has_aux=True)

    def layer_inputs(self, i: Any, carry_leaves: list[Array]) -> list[Array]:
        # As in `_scan_by_index`: tied to the loop index by an optimisation barrier (on CPU,
        # where it was measured), nothing done to the stack (there, a float32 conversion) is
        # hoisted out of the loop.
        stack, xs, at = _platform.barrier_on_cpu((self.stack, self.xs, i))
        return [*self.consts, *rows_at(stack, at), *carry_leaves, *rows_at(xs, at)]


# Equations that call a sub-jaxpr once, its inputs and outputs one to one with theirs: their
# dependencies are read inside. Any other (a loop, a conditional) marks all its results.
_CALLS = {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call"}


def depends_on(
    fun: Callable[..., list[Any]], inputs: Sequence[Any], marked: Sequence[bool]
) -> list[bool]:
    """Which outputs of `fun(*inputs)` may depend on the `marked` inputs, read off its jaxpr.

    Erring towards "depends" is safe: such a residual is saved rather than recomputed.
    """
    closed = jax.make_jaxpr(fun)(*inputs)
    return _marked_outputs(closed.jaxpr, marked)


def _marked_outputs(jaxpr: Any, marked: Sequence[bool]) -> list[bool]:
    def is_marked(v: Any) -> bool:
        return isinstance(v, jax.extend.core.Var) and v in dependent

    dependent = set(select(jaxpr.invars, marked))
    for eqn in jaxpr.eqns:
        operands = [is_marked(v) for v in eqn.invars]
        if not any(operands):
            continue
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's, or a Jaxpr
        if (
            eqn.primitive.name in _CALLS
            and isinstance(inner, jax.extend.core.Jaxpr)
            and len(inner.invars) == len(eqn.invars)
            and len(inner.outvars) == len(eqn.outvars)
        ):
            results = _marked_outputs(inner, operands)
            dependent.update(select(eqn.outvars, results))
        else:
            dependent.update(eqn.outvars)
    return [is_marked(v) for v in jaxpr.outvars]
