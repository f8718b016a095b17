"""Plans of optax training steps on a target, and the largest batch that fits per remat mode."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from .. import _arguments as arguments
from .plans import Plan, _is_traced, _structs_on, plan
from .search import search
from .table import format_bytes, table
from .targets import Target, resolve_target


def _is_float(x: Any) -> bool:
    """A floating (or complex) array or `ShapeDtypeStruct`: trainable by default."""
    return _is_traced(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _placed(tree: Any, where: Target) -> Any:
    """Every traced leaf of `tree` as a `ShapeDtypeStruct` placed by `plan`'s rule.

    Unplaced leaves keep `sharding=None`; `plan` decides where they go.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    traced = [(p, x) for p, x in leaves if _is_traced(x)]
    structs = iter(_structs_on(traced, where, first_device_if_none=False))
    out = [next(structs) if _is_traced(x) else x for _, x in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


def _replicated(params: Any) -> Sharding | None:
    """Replicated over the mesh the parameters use (unplaced if they use none)."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
    return None


def _mirrored(opt_state: Any, params: Any, replicated: Sharding | None) -> Any:
    """The optimizer state's structs, sharded as the parameters they mirror.

    A subtree with the parameters' structure (AdamW's `mu`, `nu`) takes their shardings leaf by
    leaf; any other leaf takes the sharding of a parameter of its shape, or `replicated`
    (scalars such as step counts).
    """
    param_def = jax.tree.structure(params)
    param_leaves = jax.tree.leaves(params)
    by_shape = {}
    for leaf in param_leaves:
        by_shape.setdefault((leaf.shape, leaf.dtype), leaf.sharding)
        by_shape.setdefault((leaf.shape, None), leaf.sharding)

    def mirrors(node: Any) -> bool:
        return bool(param_leaves) and jax.tree.structure(node) == param_def

    def struct(x: Any, sharding: Sharding | None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    def place(node: Any) -> Any:
        if mirrors(node):
            return jax.tree.map(lambda x, p: struct(x, p.sharding), node, params)
        if not _is_traced(node):
            return node
        if node.shape == ():
            return struct(node, replicated)
        sharding = by_shape.get((node.shape, node.dtype), by_shape.get((node.shape, None)))
        return struct(node, sharding if sharding is not None else replicated)

    return jax.tree.map(place, opt_state, is_leaf=mirrors)


def _split(model: Any, trainable: Any) -> tuple[Any, Any]:
    spec = _is_float if trainable is None else trainable
    try:
        params, frozen = eqx.partition(model, spec)
    except ValueError as error:
        raise ValueError(
            "trainable must be an `eqx.partition` filter spec for `model` (a callable on its "
            f"leaves, or a pytree of bools matching it, such as `lora_filter(model)`): {error}"
        ) from error
    # Only arrays are differentiated; anything else the filter selected stays with the base.
    params, extra = eqx.partition(params, _is_traced)
    if not jax.tree.leaves(params):
        raise ValueError(
            "trainable selects no floating arrays of `model`: there is nothing to train."
        )
    return params, eqx.combine(frozen, extra)


def _check_batch(batch: Sequence[Any]) -> None:
    """Refuses a batch array of a zero or negative size: a batch of no rows or no tokens
    compiles, and its plan "fits", planning nothing (a struct of a negative size is accepted
    by JAX and fails deep in XLA)."""
    leaves = jax.tree_util.tree_flatten_with_path(tuple(batch))[0]
    for path, leaf in leaves:
        if _is_traced(leaf) and any(int(n) < 1 for n in leaf.shape):
            raise ValueError(
                f"batch argument {jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}: "
                "every size of a batch array must be at least 1 (a batch of no rows or no "
                "tokens plans nothing)."
            )


def train_step(loss_fn: Callable[..., Any], optimizer: Any) -> Callable[..., Any]:
    """The step [`eqx_lean.memory.plan_train_step`][] plans:
    `(params, opt_state, frozen, *batch) -> (params, opt_state, loss)`."""

    def step(params: Any, opt_state: Any, frozen: Any, *batch: Any) -> Any:
        def loss_of(p: Any) -> Any:
            return loss_fn(eqx.combine(p, frozen), *batch)

        loss, grads = jax.value_and_grad(loss_of)(params)
        # optax mixes Python floats with int32 step counts, which strict promotion rejects.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss

    return step


def train_arguments(
    model: Any, optimizer: Any, batch: Sequence[Any], where: Target, trainable: Any = None
) -> tuple[Any, ...]:
    """`(params, opt_state, frozen, *batch)` as structs on the target, as `train_step` takes."""
    params, frozen = _split(_placed(model, where), trainable)
    try:
        opt_state = jax.eval_shape(optimizer.init, params)
    except AttributeError as error:
        raise TypeError(
            f"optimizer must be an optax `GradientTransformation` (with `init` and `update`), "
            f"got {type(optimizer).__name__}."
        ) from error
    opt_state = _mirrored(opt_state, params, _replicated(params))
    return (params, opt_state, frozen, *_placed(tuple(batch), where))


def plan_train_step(
    loss_fn: Callable[..., Any],
    model: Any,
    optimizer: Any,
    *batch: Any,
    target: Target | str,
    trainable: Any = None,
    donate: bool = True,
) -> Plan:
    """XLA's per-device memory plan of one optax training step on a target, without running it.

    ```python
    h100s = eqx_lean.memory.target("8xh100")
    mesh = h100s.mesh((8,), ("fsdp",))

    def on_mesh(s):  # eval_shape gives shardings on an abstract mesh, or none: use `mesh`
        if not isinstance(s, jax.ShapeDtypeStruct):
            return s
        if s.sharding is None:  # such as LoRA adapters added under eval_shape: replicated
            return s.update(sharding=jax.NamedSharding(mesh, jax.P()))
        return s.update(sharding=s.sharding.update(mesh=mesh))

    model = jax.tree.map(on_mesh, eqx.filter_eval_shape(make_model))  # base sharded on `mesh`
    plan = eqx_lean.memory.plan_train_step(loss, model, optax.adamw(1e-4), tokens, target=h100s,
                                           trainable=eqx_lean.lora.lora_filter(model))
    ```

    The step is `jax.value_and_grad` of `loss_fn(model, *batch)` with respect to the trainable
    part of `model`, `optimizer.update` and `eqx.apply_updates`, returning the new trainable
    part, the new optimizer state and the loss. The optimizer state is
    `jax.eval_shape(optimizer.init, trainable part)`, each leaf sharded as the parameter it
    mirrors; scalars (step counts) are replicated over the parameters' mesh. The frozen part
    and the batch are arguments too, never donated.

    Leaves follow [`eqx_lean.memory.plan`][]'s rules: shardings must be on the target's
    devices (a leaf with none is replicated over the devices the others use). A mesh from
    `target.mesh` has `Explicit` axes by default, on which eqx_lean's own layers (`fold`, the
    LoRA and quantised products, `eqx_lean.hf`'s decoder and loss) run as they are; a loss of
    your own whose products would shard one axis twice needs `out_sharding=` there, as on the
    real devices, or a mesh made with `axis_types=(jax.sharding.AxisType.Auto,) * n`.

    **Arguments:**

    - `loss_fn`: `(model, *batch) -> scalar` loss.
    - `model`: the model: arrays or `jax.ShapeDtypeStruct`s (as `eqx.filter_eval_shape`
        gives), with shardings on the target.
    - `optimizer`: an optax `GradientTransformation`.
    - `*batch`: the rest of `loss_fn`'s arguments (arrays or structs).
    - `target`: a [`eqx_lean.memory.Target`][] or a spec for [`eqx_lean.memory.target`][].
    - `trainable`: an `eqx.partition` filter spec of the trained part, such as
        `eqx_lean.lora.lora_filter(model)`; `None` (the default) trains every floating array.
    - `donate`: donate the trainable part and the optimizer state (updated in place), as a
        training loop would.

    **Returns:**

    A [`eqx_lean.memory.Plan`][] of the step, per device.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable `(model, *batch) -> loss`, got {loss_fn!r}.")
    _check_batch(batch)
    where = resolve_target(target)
    step_arguments = train_arguments(model, optimizer, batch, where, trainable)
    step = train_step(loss_fn, optimizer)
    return plan(step, *step_arguments, target=where, donate=(0, 1) if donate else "none")


@dataclasses.dataclass(frozen=True)
class FitResult:
    """The largest batch one remat mode fits, from [`eqx_lean.memory.fit`][].

    **Attributes:**

    - `remat`: the remat mode.
    - `batch_size`: the largest batch that fits (0 if none does).
    - `plan`: the [`eqx_lean.memory.Plan`][] at `batch_size` (at the smallest batch tried if
        none fits).
    - `compiles`: the programs compiled to find it.
    - `tried`: `(batch, bytes needed, fits)` of each compile, in order (the bytes as
        [`Plan.needed`][eqx_lean.memory.Plan.needed]).
    """

    remat: Any
    batch_size: int
    plan: Plan
    compiles: int
    tried: tuple[tuple[int, int, bool], ...]


def _remat_name(remat: Any) -> str:
    if remat is None or remat is True or isinstance(remat, str):
        return repr(remat) if isinstance(remat, str) else str(remat)
    return getattr(remat, "__name__", type(remat).__name__)


def _recompute_rank(remat: Any) -> int:
    """Less recomputation first: none, a policy (saves some), every layer, nested."""
    if remat is None or remat is False:
        return 0
    if remat is True:
        return 2
    if remat == "nested":
        return 3
    return 1


@dataclasses.dataclass(frozen=True)
class Fit:
    """The largest batch per remat mode of a training step on a target; `print` it.

    **Attributes:**

    - `target`: the spec of the target.
    - `device_memory`: the bytes one device can use.
    - `results`: a [`eqx_lean.memory.FitResult`][] per remat mode, in the order asked.
    - `best`: the result of the remat mode with the least recomputation (none, a policy,
        `True`, `"nested"`) among those reaching the largest batch; `None` if none fits at all.
    """

    target: str
    device_memory: int
    results: tuple[FitResult, ...]
    best: FitResult | None

    def __getitem__(self, remat: Any) -> FitResult:
        for result in self.results:
            if result.remat is remat or result.remat == remat:
                return result
        raise KeyError(f"No remat mode {remat!r} was fitted; modes: {self.remats}.")

    @property
    def remats(self) -> tuple[Any, ...]:
        return tuple(r.remat for r in self.results)

    def table(self) -> str:
        """The frontier as an aligned text table."""
        rows = [
            (
                _remat_name(r.remat) + (" *" if r is self.best else ""),
                str(r.batch_size),
                format_bytes(r.plan.needed) if r.batch_size else "-",
                str(r.compiles),
            )
            for r in self.results
        ]
        head = (
            f"largest batch per remat mode on {self.target} "
            f"({format_bytes(self.device_memory)} per device; * best)"
        )
        return head + "\n" + table(("remat", "batch", "needed", "compiles"), rows)

    def __str__(self) -> str:
        return self.table()


def _fit_one(
    plan_at: Callable[[int], Plan], multiple: int, max_batch: int, remat: Any
) -> FitResult:
    """The largest multiple of `multiple` up to `max_batch` whose plan fits, and whose next
    multiple does not: the search of [`eqx_lean.memory.longest`][] from `multiple`, without a
    compile budget."""
    found = search(plan_at, multiple, max_batch, multiple, None)
    return FitResult(remat, found.size, found.plan, found.compiles, found.tried)


def fit(
    make_loss: Callable[[Any], Callable[..., Any]],
    model: Any,
    optimizer: Any,
    make_batch: Callable[[int], Sequence[Any]],
    *,
    target: Target | str,
    batch_multiple: int = 1,
    remats: Sequence[Any] = (None, True, "nested"),
    max_batch: int = 4096,
    trainable: Any = None,
) -> Fit:
    """The largest batch of a training step that fits a target's memory, per remat mode.

    ```python
    def make_loss(remat):
        return lambda model, x, y: loss(eqx_lean.fold(model.blocks, x, remat=remat), y)

    found = eqx_lean.memory.fit(make_loss, model, optax.adamw(1e-3),
                                lambda b: (x_struct(b), y_struct(b)), target="8xh100",
                                batch_multiple=8)
    print(found)  # the frontier; found.best.batch_size, found[True].plan
    ```

    Each step is planned by [`eqx_lean.memory.plan_train_step`][] (donating the trained part
    and the optimizer state). Per remat mode, two compiles (at `batch_multiple` and twice it)
    fit the per-device peak as an affine function of the batch; each later compile is at the
    boundary of the line through the last two (a secant), inside the bracket of batches known
    to fit and not to, until a batch fits and the next multiple does not. That is 4 compiles
    where the peak is affine in the batch (as for a fixed program shape it nearly is), more
    where XLA's fusions change with the batch; a bracket that two compiles did not halve is
    bisected. Each result's `compiles` and `tried` say what was compiled.

    **Arguments:**

    - `make_loss`: `remat -> loss_fn`, the loss `(model, *batch) -> scalar` running the model's
        layers (through [`eqx_lean.fold`][] or [`eqx_lean.scan`][]) with that remat mode.
    - `model`: the model (arrays or structs with shardings on the target).
    - `optimizer`: an optax `GradientTransformation`.
    - `make_batch`: `batch_size -> tuple` of the loss's batch arguments (structs, sharded on
        the target as a run would shard them).
    - `target`: a [`eqx_lean.memory.Target`][] or a spec for [`eqx_lean.memory.target`][].
    - `batch_multiple`: batches are multiples of it (such as the data axis size).
    - `remats`: the remat modes to try.
    - `max_batch`: the largest batch to consider.
    - `trainable`: as for [`eqx_lean.memory.plan_train_step`][].

    **Returns:**

    A [`eqx_lean.memory.Fit`][]; `print` it for the frontier.
    """
    # Bools are not sizes (`True` was a multiple of 1).
    batch_multiple = arguments.integer(batch_multiple, "`batch_multiple`", minimum=1)
    max_batch = arguments.integer(max_batch, "`max_batch`", minimum=batch_multiple)
    remats = tuple(remats)
    if not remats:
        raise ValueError("remats must name at least one remat mode.")
    where = resolve_target(target)
    results = []
    for remat in remats:
        loss_fn = make_loss(remat)

        def plan_at(batch: int, loss_fn: Any = loss_fn) -> Plan:
            args = make_batch(batch)
            if not isinstance(args, tuple | list):
                raise TypeError(
                    f"make_batch must return a tuple of the loss's batch arguments, got "
                    f"{type(args).__name__} for batch {batch}."
                )
            return plan_train_step(
                loss_fn, model, optimizer, *args, target=where, trainable=trainable
            )

        results.append(_fit_one(plan_at, batch_multiple, max_batch, remat))
    largest = max(r.batch_size for r in results)
    best = None
    if largest > 0:
        reaching = [r for r in results if r.batch_size == largest]
        best = min(reaching, key=lambda r: _recompute_rank(r.remat))
    return Fit(where.spec, where.device_memory, tuple(results), best)
