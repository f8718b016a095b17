"""Forward helpers over stacked layers: `fold` and `scan`, with gradient checkpointing."""

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, PRNGKeyArray, PyTree

from .. import _platform
from .backward import differentiated_by_index
from .batching import batch_leaves_stack
from .checks import check_xs, checked_stack
from .fallback import nested_scan, scan_layers
from .gather import Gather, gather_shardings, gathered_step, tie_gradient_shardings
from .linear_call import has_custom_transpose
from .public_vjp import differentiated_by_custom_vjp
from .remat import (
    LAYER_CARRY,
    SAVE_ALL,
    Remat,
    check_remat,
    checkpointed,
    reads_names,
    resolve_remat,
)


Carry = TypeVar("Carry")
Y = TypeVar("Y")


def _struct_of(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def _carry_mismatch(expected: Any, found: Any, name: str) -> str | None:
    """Describes how `found` differs from the `expected` carry, or returns None if it does not."""
    expected_treedef = jax.tree.structure(expected)
    found_treedef = jax.tree.structure(found)
    if expected_treedef != found_treedef:
        return f"`{name}` has structure {expected_treedef} but the layer returned {found_treedef}"
    paths = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, a), b in zip(paths, jax.tree.leaves(found), strict=True):
        a, b = _struct_of(a), _struct_of(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            where = f"{name}{jax.tree_util.keystr(path)}"
            return (
                f"`{where}` is {a.dtype}{list(a.shape)} but the layer returned "
                f"{b.dtype}{list(b.shape)}"
            )
    return None


def _layer_step(
    static: Any, call: Callable[..., tuple[Any, Any]], carry_name: str, name_carry: bool
) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
    """The function of one layer: `(layer arrays, carry, x_i) -> (carry, y_i)`, checked; with
    `name_carry`, its carry named `LAYER_CARRY` for a name-based remat policy."""

    def step(dynamic: Any, carry: Any, x: Any) -> tuple[Any, Any]:
        if name_carry:
            # For name-based remat policies (`remat="offload"` keeps it in host memory). Only
            # then: under Explicit mesh axes the name broke the lean backward of a gathered
            # stack (`memory.fit`'s example on 8 H100s: "select cases must have the same
            # shardings"), which policies that read no name do not need.
            carry = jax.tree.map(lambda c: checkpoint_name(c, LAYER_CARRY), carry)
        out = call(eqx.combine(dynamic, static), carry, x)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "`call` must return a pair `(carry, y)` for each layer; got "
                f"{type(out).__name__}{'' if not isinstance(out, tuple) else f' of {len(out)}'}."
            )
        new_carry, y = out
        mismatch = _carry_mismatch(carry, new_carry, carry_name)
        if mismatch is not None:
            raise ValueError(
                f"`{carry_name}` is carried from layer to layer, so every layer must return it "
                f"with the same pytree structure, shapes and dtypes as it was given; {mismatch}."
            )
        # Matching the input's pytree (aux data included) keeps lax.scan's own check quiet.
        new_carry = jax.tree.unflatten(jax.tree.structure(carry), jax.tree.leaves(new_carry))
        return new_carry, y

    return step


def _scan_by_index(
    step: Callable[[Any, Any, Any], tuple[Any, Any]],
    dynamic: Any,
    carry: Any,
    xs: Any,
    num_layers: int,
    unroll: int | bool,
) -> tuple[Any, Any]:
    """The forward-only loop: slices layer `i` out of the stack by a loop index.

    Scanning over the stack as `xs` leaves it loop-invariant, and XLA hoists loop-invariant work
    on it out of the loop: on CPU, where slicing bfloat16 is done in float32, that is a float32
    copy of the whole stack (2x its size in temporaries). Tying the stack to the loop index
    with an optimisation barrier keeps every conversion inside the loop, one layer at a time.
    The barrier is lowered on CPU only (`_platform.barrier_on_cpu`), where it was measured.
    """

    def body(state: tuple[Any, Array], x: Any) -> tuple[tuple[Any, Array], Any]:
        carry, i = state
        layers, at = _platform.barrier_on_cpu((dynamic, i))
        layer = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, at, keepdims=False), layers)
        carry, y = step(layer, carry, x)
        return (carry, i + 1), y

    start = jnp.zeros((), jnp.int32)
    (carry, _), ys = lax.scan(body, (carry, start), xs, length=num_layers, unroll=unroll)
    return carry, ys


def _differentiated_as(
    primal: Callable[..., Any], differentiable: Callable[..., Any], args: tuple[Any, ...]
) -> Any:
    """Returns `primal(*args)`, whose derivatives are those of `differentiable(*args)`.

    The two must compute the same function. Only the inputs that are actually differentiated
    (those without a symbolic-zero tangent) become inputs of the JVP, so differentiating with
    respect to the carry alone never materialises a zero tangent the size of the stack.
    """
    arrays, others = eqx.partition(args, eqx.is_array)

    @jax.custom_jvp
    def run(arrays: Any) -> Any:
        return primal(*eqx.combine(arrays, others))

    def run_jvp(primals: tuple[Any], tangents: tuple[Any]) -> tuple[Any, Any]:
        leaves, treedef = jax.tree.flatten(primals[0])
        tangent_leaves = treedef.flatten_up_to(tangents[0])
        live = [not isinstance(t, SymbolicZero) for t in tangent_leaves]

        def of_live(*live_leaves: Array) -> Any:
            supply = iter(live_leaves)
            pairs = zip(leaves, live, strict=True)
            merged = [next(supply) if is_live else x for x, is_live in pairs]
            return differentiable(*eqx.combine(treedef.unflatten(merged), others))

        live_primals = [x for x, is_live in zip(leaves, live, strict=True) if is_live]
        live_tangents = [t for t, is_live in zip(tangent_leaves, live, strict=True) if is_live]
        return jax.jvp(of_live, live_primals, live_tangents)

    run.defjvp(run_jvp, symbolic_zeros=True)
    return run(arrays)


def _layer_slice(tree: Any) -> Any:
    return jax.tree.map(lambda a: lax.index_in_dim(a, 0, keepdims=False), tree)


def _empty_scan(step: Callable[..., tuple[Any, Any]], dynamic: Any, carry: Any, xs: Any) -> Any:
    """What `lax.scan` and a Python loop give for zero layers: the carry, and empty `ys`."""

    def one_layer(leaf: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(jnp.shape(leaf)[1:], jnp.result_type(leaf))

    layer, x = jax.tree.map(one_layer, (dynamic, xs))
    _, ys = jax.eval_shape(step, layer, carry, x)
    return carry, jax.tree.map(lambda y: jnp.zeros((0, *y.shape), y.dtype), ys)


def _hoist_closure(
    step: Callable[[Any, Any, Any], tuple[Any, Any]], dynamic: Any, carry: Any, xs: Any
) -> tuple[Callable[[list[Array], Any, Any, Any], tuple[Any, Any]], list[Array]]:
    """Makes the arrays `step` closes over explicit, so that they can be differentiated.

    Like `jax.closure_convert`, which however caches its result on the function: for a fresh
    function per call, as here, that cache would keep every closed-over array alive.
    """
    # Shapes only: slicing the stack itself would copy one layer of it when run eagerly.
    layer, x = jax.eval_shape(_layer_slice, (dynamic, xs))
    closed, out_shape = jax.make_jaxpr(step, return_shape=True)(layer, carry, x)
    out_tree = jax.tree.structure(out_shape)

    def with_consts(consts: list[Array], layer: Any, carry: Any, x: Any) -> tuple[Any, Any]:
        with_closure = jax.extend.core.ClosedJaxpr(closed.jaxpr, consts)
        flat_out = jax.extend.core.jaxpr_as_fun(with_closure)(*jax.tree.leaves((layer, carry, x)))
        return jax.tree.unflatten(out_tree, flat_out)

    return with_consts, list(closed.consts)


def _scan(
    stacked: Any,
    carry: Any,
    xs: Any,
    call: Callable[..., tuple[Any, Any]],
    remat: Remat,
    unroll: int | bool,
    carry_name: str,
    gather: Gather,
    num_layers: int | None,
) -> tuple[Any, Any]:
    check_remat(remat)
    dynamic, static, num_layers = checked_stack(stacked, num_layers)
    check_xs(xs, num_layers)
    shardings = gather_shardings(dynamic, gather)
    policy, group_size = resolve_remat(remat, max(num_layers, 1))
    step = gathered_step(_layer_step(static, call, carry_name, reads_names(policy)), shardings)
    if num_layers == 0:
        return _empty_scan(step, dynamic, carry, xs)
    dynamic = tie_gradient_shardings(dynamic, shardings)
    step_with, consts = _hoist_closure(step, dynamic, carry, xs)

    def differentiable(consts: list[Array], dynamic: Any, carry: Any, xs: Any) -> Any:
        step = functools.partial(step_with, consts)
        if policy == SAVE_ALL:
            return scan_layers(step, dynamic, carry, xs, unroll)
        assert callable(policy)
        if group_size is not None:
            return nested_scan(step, dynamic, carry, xs, num_layers, policy, group_size, unroll)
        return scan_layers(checkpointed(step, policy), dynamic, carry, xs, unroll)

    def primal(consts: list[Array], dynamic: Any, carry: Any, xs: Any) -> Any:
        step = functools.partial(step_with, consts)
        return _scan_by_index(step, dynamic, carry, xs, num_layers, unroll)

    args = (consts, dynamic, carry, xs)
    if has_custom_transpose():
        return differentiated_by_index(
            step_with, primal, differentiable, args, num_layers, policy, group_size, unroll
        )
    if batch_leaves_stack([*consts, *jax.tree.leaves(dynamic)], jax.tree.leaves((carry, xs))):
        # Under `vmap`, over a stack the batch does not reach: JAX's own derivative of the scan
        # over the stack, which sums the examples' gradients layer by layer.
        return _differentiated_as(primal, differentiable, args)
    name = "scan" if carry_name == "carry" else "fold"
    return differentiated_by_custom_vjp(
        step_with, primal, args, num_layers, policy, group_size, unroll, name
    )


def scan(
    stacked: PyTree,
    carry: Carry,
    xs: PyTree[Array] = None,
    *,
    call: Callable[[Any, Carry, Any], tuple[Carry, Y]],
    num_layers: int | None = None,
    remat: Remat = None,
    unroll: int | bool = 1,
    gather: Gather = True,
) -> tuple[Carry, Y]:
    """Runs the layers of a stacked module one after another, threading a carry through them.

    This is `jax.lax.scan` over the layer axis, with the stacked module's static fields handled
    for you: `call(layer_i, carry, xs[i]) -> (carry, ys[i])` for `i = 0, ..., L-1`. Per-layer
    inputs and outputs, such as a KV cache, per-layer masks or auxiliary losses, flow through
    `xs` and `ys`, which carry a leading layer axis.

    ```python
    def attend(layer, x, cache):
        x, cache = layer(x, cache)
        return x, cache

    x, new_cache = eqx_lean.scan(blocks, x, cache, call=attend, num_layers=32)
    ```

    **Say how many layers.** The layer axis is the leading axis of every array leaf, whatever
    the module is: a module that is not stacked at all has leading axes too, so
    `eqx_lean.fold(eqx.nn.LayerNorm(8), x)` runs 8 "layers" of scalar norms, one per element of
    its rank-1 weight and bias, and returns a wrong answer without complaint. Pass
    `num_layers=L`: every array leaf's leading axis is then checked against it, and a leaf
    without the layer axis is an error that names it.

    **Stateful layers.** Stack the layers and their `eqx.nn.State` together (for example
    `eqx_lean.build_stacked(eqx.nn.make_with_state(Block), keys)` or
    `eqx.filter_vmap(eqx.nn.make_with_state(Block))(keys)`), pass the stacked state as `xs` and
    get the updated stacked state back as `ys`:
    `x, state = eqx_lean.scan(blocks, x, state, call=lambda layer, x, s: layer(x, s))`.

    **Memory.** The forward and the backward pass both read layer `i` out of the stack by its
    index, so whatever XLA does to a layer's weights (on CPU, computing in float32 on bfloat16
    weights) happens to one layer at a time, never to the whole stack. The backward pass is
    written by hand: it walks the layers from the last to the first, calls the VJP of `call`
    on layer `i`, and writes that layer's gradient into row `i` of a buffer with the stack's
    own dtype and sharding (a bfloat16 leaf gets a bfloat16 gradient). A leaf that is not
    differentiated gets no buffer at all, so a frozen base costs nothing: take gradients with
    respect to the trainable part only,

    ```python
    trainable, frozen = eqx.partition(blocks, is_adapter)  # e.g. LoRA adapters only
    grads = jax.grad(lambda t: loss(eqx.combine(t, frozen), x))(trainable)
    ```

    What the forward pass keeps for the backward is set by `remat` (below). The values are
    those of a Python loop over [`eqx_lean.unstack`][] whatever the choices.

    **Forward mode and JAX versions.** On the JAX series eqx_lean was tested with (0.10), the
    backward pass is attached through a private JAX primitive, and forward-mode derivatives
    (`jax.jvp`, `jax.jacfwd`) differentiate the forward loop directly. On any other JAX (or
    with `EQX_LEAN_NO_PRIVATE_JAX=1`) it is a public `jax.custom_vjp`, with the same memory:
    there JAX differentiates `fold` and `scan` in reverse mode only (`jax.grad`, `jax.vjp`,
    `jax.jacrev`, and forward over reverse such as `jax.hessian`), and `jax.jvp` or
    `jax.jacfwd` of them raise a `TypeError` that says so (inside `jax.jit`, JAX's own
    "can't apply forward-mode autodiff (jvp) to a custom_vjp function", when lowering).

    Give the layers the batch axis themselves for this backward pass. Under
    `jax.vmap(lambda x: eqx_lean.fold(blocks, x))(batch)` inside a gradient, the stack is not
    batched while the activations are, and the hand-written loops would build one gradient of
    the whole stack per example: there the gradient is JAX's own derivative of a `lax.scan`
    over the stack (the same values; the memory `fold` needed before 0.2.0). On a JAX other
    than 0.10 this is decided while `vmap` traces `fold`, so a `vmap` of a function jitted
    on its own first (`jax.vmap(jax.jit(f))`) keeps the hand-written backward pass: put the
    `jax.jit` outside.

    **Random keys.** Pass one key per layer in `xs`, e.g.
    `xs=(cache, jax.random.split(key, L))`, or use [`eqx_lean.fold`][]'s `key=`.

    **Sharded stacks (ZeRO-3).** A stack sharded within each layer, such as one built with
    `eqx_lean.build_stacked(..., sharding=eqx_lean.fsdp(mesh))`, runs with the layer's code
    unchanged: inside the loop, each layer's parameters are gathered just before the layer
    runs, to the sharding its computation needs (by default replicated over the mesh), so
    each device holds the stack's shard plus about one gathered layer. This works on meshes
    with Explicit axes (`jax.make_mesh`'s default; the layer is resharded with
    `jax.sharding.reshard`) and with Auto axes (`jax.lax.with_sharding_constraint`), and the
    carry keeps its own sharding, such as a batch sharded over the same mesh axis (data
    parallel). Differentiated, each layer's gradient comes back in the stack's own sharding (a
    reduce-scatter), and the gathered parameters are never saved for the backward pass,
    whatever `remat` is: the backward pass gathers each layer again. Differentiating eagerly
    (outside `jax.jit`) on Explicit axes needs the mesh as context, `with jax.set_mesh(mesh):`,
    as JAX requires of any eager gradient there. With Auto axes, placing the gradient needs a
    custom VJP, so forward-mode differentiation (`jax.jvp`, `jax.jacfwd`) with respect to the
    stack's own parameters needs `gather=False`.

    **Arguments:**

    - `stacked`: a module whose array leaves share a leading layer axis of length `L`, such as
        the output of [`eqx_lean.build_stacked`][]. Every array leaf carries the layer axis; a
        Python number field becomes a 0-d array where `jax.grad` or `jax.jit` trace the module
        (an error: mark it `eqx.field(static=True)`, or use `eqx.filter_grad` /
        `eqx.filter_jit`). Leaves may be sharded within each layer (see `gather`); the layer
        axis itself must be replicated. A layer axis sharded over Explicit mesh axes (as
        `jax.make_mesh` makes them) is an error that says how to reshard it; over Auto axes it
        runs, but XLA gathers the whole stack onto every device.
    - `carry`: the initial carry, a pytree of arrays.
    - `xs`: per-layer inputs: `None`, or a pytree of arrays each with leading axis `L`; layer
        `i` receives the slice `i` of every leaf.
    - `call`: `call(layer, carry, x_i) -> (carry, y_i)`, where `layer` is one layer (the
        stacked module with every array indexed at `i`). The new carry must have the same
        structure, shapes and dtypes as the old one.
    - `num_layers`: the number of layers `L` the stack must have: every array leaf's leading
        axis is checked against it (see **Say how many layers** above). `None` (the default)
        takes `L` from the leaves, which must agree.
    - `remat`: gradient checkpointing, what the forward pass keeps for the backward pass, on
        the layer axis. `None` keeps, for every layer, the carry entering it and every residual
        of its linearisation that depends on the activations (the carry and `x_i`): no
        recomputation, the most memory. Values computed from the layer's weights and constants
        alone (a bfloat16 weight cast to float32, a transpose) are recomputed in the backward
        pass instead, so that no copy of the stack is kept. `True` keeps only the carries and
        recomputes one layer at a time (about one more forward pass). A
        `jax.checkpoint_policies` policy (a function `(primitive, *avals, **params) -> bool`,
        as `jax.checkpoint` calls it) keeps the carries and what the policy saves of each
        layer; a name-based policy (`jax.checkpoint_policies.save_only_these_names`,
        `save_and_offload_only_these_names`, ...) selects the values the layer names with
        `jax.ad_checkpoint.checkpoint_name`, and the carry entering each layer, which is
        named [`eqx_lean.LAYER_CARRY`][] (every leaf). `"offload"` keeps only that carry,
        in the device's pinned host memory (`save_and_offload_only_these_names`), and
        recomputes the rest as `True` does: the carries leave the device for the host (a
        GPU's or TPU's plan reports them as host bytes, `Plan.host`); on a CPU, where host
        and device memory are one, it compiles to the program of `True` (measured).
        `"nested"` or an [`eqx_lean.NestedRemat`][] keeps the carries entering about `√L`
        groups of layers and recomputes one group at a time, holding about `2√L` carries
        (see there for when that beats `True`). The values are the same whatever the choice.
    - `unroll`: how many layers each iteration of the underlying loop runs, as for
        `jax.lax.scan` (`True` unrolls all of them). With nested remat it applies to the inner
        scan over the layers of a group.
    - `gather`: the sharding each layer's parameters are gathered to inside the loop, just
        before `call` receives the layer. `True` (the default): replicated over the mesh each
        leaf lies on (ZeRO-3); leaves on no mesh are left alone, so an unsharded stack runs
        exactly as without it. `False`: kept as they are, for tensor-parallel layers written
        for sharded weights (with Explicit axes such a layer must say how a product over a
        sharded dimension is sharded, e.g. `jnp.einsum(..., out_sharding=...)`). Otherwise a
        sharding policy with exactly the meaning of `build_stacked`'s `sharding=`, per layer
        (no layer axis): one `Sharding`, or `PartitionSpec` on the stack's mesh; a pytree
        prefix of the layer; or a rule `(path, leaf) -> sharding`, given each array leaf's key
        path and per-layer `ShapeDtypeStruct`. For example, on a stack of matrices sharded
        `P("data", "model")` within each layer, `gather=P(None, "model")` gathers over `"data"`
        and keeps the tensor-parallel `"model"` shards. A leaf given `None` beside named
        shardings is replicated; if every leaf gets `None`, nothing is gathered.

    **Returns:**

    `(carry, ys)`: the carry after the last layer, and the per-layer outputs `y_i` stacked on a
    new leading axis of length `L`.
    """
    return _scan(stacked, carry, xs, call, remat, unroll, "carry", gather, num_layers)


def _check_call_kwargs(kwargs: Mapping[str, Any] | None, key: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(
            "`kwargs` must be a dict of keyword arguments for every layer, e.g. "
            f"`kwargs=dict(mask=mask)`; got {type(kwargs).__name__}."
        )
    if key is not None and "key" in kwargs:
        raise ValueError(
            "Pass the random key either as `fold(..., key=key)` (split into one key per layer) "
            "or inside `kwargs`, not both."
        )
    return dict(kwargs)


def _call_layer(layer: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return layer(*args, **kwargs)


def fold(
    stacked: PyTree,
    x: Carry,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    call: Callable[..., Carry] | None = None,
    num_layers: int | None = None,
    remat: Remat = None,
    unroll: int | bool = 1,
    key: PRNGKeyArray | None = None,
    gather: Gather = True,
) -> Carry:
    """Applies the layers of a stacked module one after another: `x = layer_i(x, *args)`.

    ```python
    y = eqx_lean.fold(blocks, x)  # x = block(x) for each block
    y = eqx_lean.fold(blocks, x, (mask,), dict(pos=pos), key=key)  # block(x, mask, pos=pos, key=k)
    y = eqx_lean.fold(blocks, x, num_layers=32)  # and check that `blocks` holds 32 layers
    ```

    The layer axis is the leading axis of every array leaf, whatever the module is: an
    unstacked layer has leading axes too, and `fold(eqx.nn.LayerNorm(8), x)` runs 8 "layers" of
    scalar norms (its rank-1 weight and bias read as 8 layers) without complaint. Pass
    `num_layers` to have it checked.

    The layer's own arguments go in `args` and `kwargs`, so they never collide with `fold`'s
    options. To return something per layer (a KV cache, an auxiliary loss) or to pass stateful
    layers their `eqx.nn.State`, use [`eqx_lean.scan`][]. A stack sharded within each
    layer (for example by `build_stacked(..., sharding=eqx_lean.fsdp(mesh))`) runs unchanged,
    each layer gathered just before it runs (see `gather`).

    **Arguments:**

    - `stacked`: a module whose array leaves share a leading layer axis of length `L`, as for
        [`eqx_lean.scan`][] (replicated, not sharded over mesh axes).
    - `x`: the input of the first layer; every layer must return the same structure, shapes and
        dtypes.
    - `args`: positional arguments after `x`, the same for every layer (arrays are closed over,
        not sliced).
    - `kwargs`: keyword arguments, the same for every layer.
    - `call`: how to apply a layer: `call(layer, x, *args, **kwargs) -> x`. Defaults to
        `layer(x, *args, **kwargs)`.
    - `num_layers`: the number of layers `L` the stack must have, checked against the leading
        axis of every array leaf; `None` (the default) takes `L` from the leaves.
    - `remat`: gradient checkpointing, as for [`eqx_lean.scan`][] (a name-based policy selects
        what the layer names with `jax.ad_checkpoint.checkpoint_name`, such as its input `x`).
    - `unroll`: as for [`eqx_lean.scan`][].
    - `key`: if given, split into `L` keys with `jax.random.split`, layer `i` receiving the
        `i`-th as the keyword argument `key=`.
    - `gather`: for a stack sharded within each layer, the sharding each layer's parameters
        are gathered to just before it runs: `True` (replicated: ZeRO-3, the default),
        `False` (kept as they are) or a sharding policy, as for [`eqx_lean.scan`][], whose
        **Sharded stacks** paragraph says more.

    **Returns:**

    The output of the last layer.
    """
    if not isinstance(args, tuple | list):
        raise TypeError(
            "`args` must be a tuple of positional arguments for every layer, e.g. "
            f"`args=(mask,)`; got {type(args).__name__}."
        )
    args = tuple(args)
    layer_kwargs = _check_call_kwargs(kwargs, key)
    apply = call if call is not None else _call_layer
    keys = None
    if key is not None:
        keys = jax.random.split(key, checked_stack(stacked, num_layers)[2])

    def step(layer: Any, carry: Any, layer_key: Any) -> tuple[Any, None]:
        key_kwarg = {} if layer_key is None else {"key": layer_key}
        return apply(layer, carry, *args, **key_kwarg, **layer_kwargs), None

    out, _ = _scan(stacked, x, keys, step, remat, unroll, "x", gather, num_layers)
    return out
