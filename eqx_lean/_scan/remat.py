"""Gradient checkpointing of stacked layers: the `remat=` option of `fold` and `scan`."""

import functools
import inspect
import math
import types
from collections.abc import Callable
from typing import Any, Literal, TypeAlias

import equinox as eqx
import jax
import numpy as np


# A `jax.checkpoint_policies` policy: which of a layer's residuals its backward keeps.
Policy: TypeAlias = Callable[..., bool]


class NestedRemat(eqx.Module):
    """Nested (√L) gradient checkpointing for [`eqx_lean.scan`][] and [`eqx_lean.fold`][].

    The `L` layers are split into groups of `group_size` consecutive layers. The forward pass
    keeps only the carry entering each group. The backward pass takes the groups from the last
    to the first: it runs a group forward again from its carry, keeping the carry entering each
    of its layers (and what `policy` saves of each layer), then differentiates the group layer
    by layer, recomputing each layer's activations. It therefore holds about
    `L / group_size + group_size` carries and the activations of one layer, at the price of
    about two extra forward passes (one to recompute a group's carries, one to recompute a
    layer's activations); with `policy=jax.checkpoint_policies.everything_saveable` it is one
    extra forward pass, holding a whole group's activations instead. Gradients are written in
    place into the stack's gradient, as with every `remat`. With `group_size ≈ √L` this is like
    Flax's `nn.remat_scan`: about `2√L` carries instead of the `L` of `remat=True`, for one
    more forward pass; it pays off where the carries (the activations passed between layers)
    weigh, as with long sequences or large batches.

    When `group_size` does not divide `L`, the last `L mod group_size` layers form one shorter
    group; groups are ranges of layer indices, so this costs nothing more. (On the public
    fallback taken on other JAX versions, a scan of scans, the stacked arrays are then split
    in two by slicing, which inside `jax.jit` costs a copy of the stacked parameters; the
    default `group_size` divides `L` whenever `L` has a divisor within a factor of two of
    `√L`.)

    **Arguments:**

    - `group_size`: layers per group; `None` picks the divisor of `L` closest to `√L` when one
        lies in `[√L / 2, 2√L]`, and `round(√L)` (with a shorter last group) otherwise.
    - `policy`: the checkpoint policy of each layer inside a group (an entry of
        `jax.checkpoint_policies`); `None` saves nothing, recomputing the whole layer.
    """

    group_size: int | None = eqx.field(static=True, default=None)
    policy: Policy | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if self.group_size is not None and (
            not isinstance(self.group_size, int | np.integer) or self.group_size < 1
        ):
            raise ValueError(
                f"`group_size` must be a positive integer or None; got {self.group_size!r}."
            )
        if self.policy is not None and not callable(self.policy):
            raise TypeError(
                "`policy` must be None or a checkpoint policy such as "
                f"`jax.checkpoint_policies.dots_saveable`; got {self.policy!r}."
            )
        if self.policy is not None:
            check_policy(self.policy, "`NestedRemat(policy=...)`")


Remat: TypeAlias = bool | Policy | NestedRemat | Literal["nested", "offload"] | None


LAYER_CARRY = "eqx_lean.layer_carry"
"""The name (`jax.ad_checkpoint.checkpoint_name`) `fold` and `scan` give the carry entering
each layer, every leaf of it: what a name-based policy passed as `remat=` selects to keep it,
such as `jax.checkpoint_policies.save_only_these_names(eqx_lean.LAYER_CARRY)`, and what
`remat="offload"` keeps in host memory."""


def offload_policy() -> Policy:
    """`remat="offload"`: each layer's input carry ([`LAYER_CARRY`][eqx_lean.LAYER_CARRY])
    kept in pinned host memory, everything else recomputed."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=(LAYER_CARRY,),
        offload_src="device",
        offload_dst="pinned_host",
    )


# How `jax.checkpoint` calls a policy, once per operation of the layer: the primitive, the
# abstract values of its operands and its parameters (here, those of a `dot_general`).
_PROBES = (
    ("primitive", "aval"),
    ("primitive", "aval", "aval"),
)
_PROBE_PARAMS = {"dimension_numbers": None, "precision": None, "preferred_element_type": None}


@functools.cache
def _made_by_jax() -> tuple[type, ...]:
    """The classes of the policies `jax.checkpoint_policies` makes, where they are classes.

    Some are functions, some frozen dataclasses with `__call__`, by JAX version (on 0.10.2
    `save_and_offload_only_these_names` makes a function; in jax/_src/ad_checkpoint.py at
    jax-ml/jax@cec06d1, 0.11.1, it makes a dataclass too: `DotsSaveable` line 80,
    `SaveOnlyTheseNames` 132, `SaveAnyNamesButThese` 140, `SaveAndOffloadOnlyTheseNames` 152),
    so `callable()` cannot tell them from a function;
    under `jax_remat3` JAX recognises them by class (`CheckpointName.remat`, lines 1223-1247;
    jax/_src/lax/lax.py line 6055 for `DotsSaveable`). Found from the public factories'
    results, so no private name is imported."""
    policies = jax.checkpoint_policies
    made = [
        policies.dots_saveable,
        policies.dots_with_no_batch_dims_saveable,
        policies.save_only_these_names("name"),
        policies.save_any_names_but_these("name"),
        policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(),
            names_which_can_be_offloaded=("name",),
            offload_src="device",
            offload_dst="pinned_host",
        ),
        policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
    ]
    return tuple({type(p) for p in made if not isinstance(p, types.FunctionType)})


def _remat3() -> bool:
    """Whether JAX's `jax_remat3` is on (an option since JAX 0.10.2, off by default:
    jax/_src/config.py line 1268 at 0.10.2, docs/jax-compat.md)."""
    return bool(getattr(jax.config, "jax_remat3", False))


def check_policy(policy: Callable[..., Any], argument: str) -> None:
    """Refuses a callable that `jax.checkpoint` cannot call as a policy, by its signature.

    A policy `jax.checkpoint_policies` made is accepted whatever its form (a function on JAX
    0.10, a dataclass instance later: `_made_by_jax`). Under `jax_remat3`, JAX never calls a
    policy function: it reads its own policies by class, and treats any other callable but
    `everything_saveable` as `nothing_saveable` (jax/_src/ad_checkpoint.py lines 1223-1247 at
    jax-ml/jax@cec06d1), so such a callable is refused, naming the name-based equivalent.

    `jax.checkpoint` calls a policy as `policy(primitive, *avals, **params)` for each operation,
    with one operand or more and the operation's parameters as keywords; a callable that cannot
    take one or two operands and keywords (`len`, `jax.checkpoint`, a policy *factory* such as
    `jax.checkpoint_policies.save_only_these_names`) would fail inside the trace with an error
    that names no argument. Nothing is called. A callable whose signature cannot be read is
    accepted, and so is one whose signature fits: what it returns is checked by JAX.
    """
    if isinstance(policy, _made_by_jax()):
        return
    policies = jax.checkpoint_policies
    if _remat3() and policy not in (policies.everything_saveable, policies.nothing_saveable):
        raise TypeError(
            f"{argument}: JAX's `jax_remat3` is on, and under it JAX never calls a policy "
            f"function such as {policy!r}: it reads only the policies "
            "`jax.checkpoint_policies` makes. Name what to keep with "
            "`jax.ad_checkpoint.checkpoint_name(x, name)` and pass "
            "`jax.checkpoint_policies.save_only_these_names(name, ...)` (or "
            "`save_and_offload_only_these_names(...)` to keep it in host memory), or pass "
            "`jax.checkpoint_policies.dots_saveable`."
        )
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):
        return
    for probe in _PROBES:
        try:
            signature.bind(*probe, **_PROBE_PARAMS)
        except TypeError as e:
            problem = e
            break
    else:
        return
    name = getattr(policy, "__name__", None)
    hint = ""
    if name is not None and getattr(jax.checkpoint_policies, name, None) is policy:
        hint = (
            f" `jax.checkpoint_policies.{name}` makes a policy: call it, e.g. "
            f"`jax.checkpoint_policies.{name}(...)`, and pass what it returns."
        )
    raise TypeError(
        f"{argument} must be a checkpoint policy, a function that `jax.checkpoint` calls as "
        "`policy(primitive, *avals, **params) -> bool` for each operation of the layer, such "
        f"as `jax.checkpoint_policies.dots_saveable`; {policy!r} cannot be called that way "
        f"({problem}).{hint}"
    )


def check_remat(remat: Any) -> None:
    if remat is None or isinstance(remat, bool | NestedRemat):
        return
    if isinstance(remat, str) and remat in ("nested", "offload"):
        return
    if callable(remat):
        check_policy(remat, "`remat`")
        return
    raise ValueError(
        "`remat` must be None, True, a `jax.checkpoint_policies` policy, 'nested', 'offload' "
        f"or an `eqx_lean.NestedRemat(...)`; got {remat!r}."
    )


def default_group_size(num_layers: int) -> int:
    root = math.sqrt(num_layers)
    divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
    near = [d for d in divisors if root / 2 <= d <= 2 * root]
    if near:
        return min(near, key=lambda d: (abs(d - root), d))
    return max(1, round(root))


# What one layer's backward pass keeps from its forward: `SAVE_ALL` (no checkpoint, every
# residual that depends on the activations is saved) or a `jax.checkpoint_policies` policy.
SAVE_ALL = "save_all"
LayerPolicy: TypeAlias = Policy | str


def resolve_remat(remat: Remat, num_layers: int) -> tuple[LayerPolicy, int | None]:
    """What `remat=` asks of `num_layers` layers: each layer's policy (`SAVE_ALL`, or the
    `jax.checkpoint` policy of its step) and, for nested remat, the group size (else `None`)."""
    if remat == "nested":
        remat = NestedRemat()
    if isinstance(remat, NestedRemat):
        group_size = min(remat.group_size or default_group_size(num_layers), num_layers)
        return remat.policy or jax.checkpoint_policies.nothing_saveable, group_size
    if remat is None or remat is False:
        return SAVE_ALL, None
    if remat is True:
        return jax.checkpoint_policies.nothing_saveable, None
    if remat == "offload":
        return offload_policy(), None
    return remat, None


def reads_names(policy: LayerPolicy) -> bool:
    """Whether a layer policy may select values by name (`checkpoint_name`): any policy but
    saving everything or nothing, which read no name."""
    policies = jax.checkpoint_policies
    return policy != SAVE_ALL and policy not in (
        policies.nothing_saveable,
        policies.everything_saveable,
    )


def checkpointed(fn: Callable[..., Any], policy: Policy | None) -> Callable[..., Any]:
    """`jax.checkpoint(fn, policy=policy)`, for functions run in a loop body."""
    # Inside a loop body there is nothing for CSE to merge across iterations, so the
    # optimisation barrier that prevent_cse adds would only cost performance.
    return jax.checkpoint(fn, prevent_cse=False, policy=policy)
