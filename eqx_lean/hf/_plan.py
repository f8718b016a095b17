"""The LoRA step of a Hugging Face decoder, planned for a target's devices without them."""

import functools
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .. import _arguments as arguments, lora, memory
from .._io.quantized import quant_config
from .._memory.search import MAX_COMPILES
from .._memory.targets import Target, mesh_axes as checked_mesh_axes, resolve_target
from .._scan.remat import Remat, check_remat
from ._checkpoint import abstract_model
from ._config import DecoderConfig
from ._finetune import _abstract_lora_model, make_lora_step
from ._train import adamw, next_token_loss


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_config_of_rank(rank: int) -> lora.LoraConfig:
    """Rank `rank` adapters (alpha `2 * rank`) on all seven projections of every block."""
    return lora.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_PROJECTIONS)


def fsdp_shardings(tree: Any, mesh: Mesh, axis: str = "fsdp") -> Any:
    """Shardings that split each array leaf's largest dimension over one mesh axis.

    A leaf whose largest dimension the axis does not divide (norms, biases, small adapters of
    another shape) is replicated. Leaves that are not arrays map to `None`.

    **Arguments:**

    - `tree`: a pytree of arrays or `jax.ShapeDtypeStruct`s.
    - `mesh`: the mesh.
    - `axis`: the mesh axis to shard over.

    **Returns:**

    A pytree of `NamedSharding`s of the same structure.
    """
    size = mesh.shape[axis]

    def sharding(leaf: Any) -> Any:
        if not hasattr(leaf, "shape"):
            return None
        dims = sorted(range(len(leaf.shape)), key=lambda d: -leaf.shape[d])
        for d in dims:
            if leaf.shape[d] % size == 0:
                spec: list[str | None] = [None] * len(leaf.shape)
                spec[d] = axis
                return NamedSharding(mesh, PartitionSpec(*spec))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(sharding, tree)


def _placed(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def check_step_arguments(
    target: "memory.Target | str",
    batch_size: Any,
    seq_len: Any,
    mesh_axes: Any,
) -> tuple[Target, Mesh, jax.ShapeDtypeStruct]:
    """The checks [`eqx_lean.hf.plan_lora_step`][] and [`eqx_lean.hf.plan_train_step`][] make
    of their arguments before any work, and what they make of them: the target, the mesh
    (Auto axes) and the token ids' struct, their rows split over every mesh axis.

    `python -m eqx_lean.memory` calls it first, so that a bad value is a usage error there.

    **Raises:** `TypeError` or `ValueError` naming the argument.
    """
    where = resolve_target(target)
    batch_size = arguments.integer(batch_size, "`batch_size`", minimum=1)
    seq_len = arguments.integer(seq_len, "`seq_len`", minimum=1)
    if mesh_axes is None:
        axes = [("fsdp", len(where.devices))]
    else:
        if isinstance(mesh_axes, str | bytes) or not isinstance(mesh_axes, Sequence):
            raise TypeError(
                f"`mesh_axes` must be a sequence of (name, size) pairs; got {mesh_axes!r}."
            )
        axes = list(mesh_axes)
        if not axes:
            raise ValueError("`mesh_axes` must hold at least one (name, size) pair; got none.")
        for axis in axes:
            if not isinstance(axis, tuple | list) or len(axis) != 2:
                raise TypeError(f"`mesh_axes` entries must be (name, size) pairs; got {axis!r}.")
    names = [name for name, _ in axes]
    unknown = {str(n) for n in names} - {"data", "fsdp"}
    if unknown:
        raise ValueError(f"mesh_axes names must be 'data' and 'fsdp'; got {sorted(unknown)}.")
    shapes = [
        arguments.integer(size, f"the size of axis {name!r} in `mesh_axes`", minimum=1)
        for name, size in axes
    ]
    shapes, names = checked_mesh_axes(
        where, shapes, names, "the sizes in `mesh_axes`", "the names in `mesh_axes`"
    )
    # Auto axes: the decoder's products leave their output shardings to XLA's propagation.
    mesh = where.mesh(shapes, names, axis_types=(AxisType.Auto,) * len(names))
    # Every device takes its own rows: the fsdp axis is data-parallel too (ZeRO-3).
    rows = len(where.devices)
    if batch_size % rows:
        raise ValueError(
            f"batch_size {batch_size} must be a multiple of the number of devices ({rows}): "
            "the token ids are split over every mesh axis."
        )
    ids = jax.ShapeDtypeStruct(
        (batch_size, seq_len), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(names))
    )
    return where, mesh, ids


def _on_mesh(trees: Sequence[Any], mesh: Mesh) -> list[Any]:
    """Each tree's structs fully sharded over the `fsdp` axis, or replicated without one."""
    if "fsdp" in mesh.shape:
        return [_placed(t, fsdp_shardings(t, mesh)) for t in trees]
    replicated = NamedSharding(mesh, PartitionSpec())
    return [_placed(t, jax.tree.map(lambda _: replicated, t)) for t in trees]


def plan_lora_step(
    config: DecoderConfig,
    target: "memory.Target | str",
    *,
    batch_size: int,
    seq_len: int,
    lora_config: lora.LoraConfig | None = None,
    remat: Remat = True,
    mesh_axes: Sequence[tuple[str, int]] | None = None,
    dtype: Any = jnp.bfloat16,
    quantize: Any = None,
) -> "memory.Plan":
    """XLA's per-device memory plan of one LoRA AdamW step (`make_lora_step`) on a target.

    ```python
    config = eqx_lean.hf.DecoderConfig.from_json("config.json")
    print(eqx_lean.hf.plan_lora_step(config, "8xh100", batch_size=8, seq_len=1024))
    ```

    The frozen base is fully sharded: each weight's largest dimension is split over the `fsdp`
    mesh axis (see [`eqx_lean.hf.fsdp_shardings`][]), as are the float32 adapters and their
    AdamW moments where the axis divides them. The token ids' rows are split over every mesh
    axis: each device takes its own rows, the `fsdp` axis being data-parallel too (ZeRO-3).
    The adapters and the optimizer state are donated, as `make_lora_step` donates them.
    Nothing is allocated: the model is abstract and the step is only compiled.

    **Arguments:**

    - `config`: the decoder's configuration.
    - `target`: a [`eqx_lean.memory.Target`][] or a spec for [`eqx_lean.memory.target`][].
    - `batch_size`, `seq_len`: the token ids' shape, positive integers; `batch_size` must be a
        multiple of the number of devices.
    - `lora_config`: the adapters; default rank 16 (alpha 32) on all seven projections.
    - `remat`: as for [`eqx_lean.hf.make_lora_step`][]; with `"offload"` the plan's `host`
        is the host memory the offloaded carries take, per device.
    - `mesh_axes`: `(name, size)` pairs over all the target's devices (sizes positive, their
        product the number of devices), with names among `"data"` and `"fsdp"`, each once;
        default: `fsdp` over every device.
    - `dtype`: the frozen base's dtype.
    - `quantize`: `None`, `"nf4"`, `"int8"` or an [`eqx_lean.quant.QuantConfig`][]: plan the
        step on a base whose decoder linears are quantised (QLoRA), as
        `load_hf(..., quantize=...)` loads it.

    **Returns:**

    A [`eqx_lean.memory.Plan`][].
    """
    where, mesh, ids = check_step_arguments(target, batch_size, seq_len, mesh_axes)
    quant = quant_config(quantize)
    lora_config = lora_config or lora.LoraConfig(
        r=16, lora_alpha=32, target_modules=ALL_PROJECTIONS
    )
    model = eqx.filter_eval_shape(_abstract_lora_model, config, lora_config, dtype, quant)
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    optimizer = adamw(1e-4, weight_decay=0.0)
    opt_state = jax.eval_shape(optimizer.init, adapters)
    frozen, adapters, opt_state = _on_mesh((frozen, adapters, opt_state), mesh)
    step = make_lora_step(optimizer, remat=remat)
    return memory.plan(step, frozen, adapters, opt_state, ids, None, target=where, donate=(1, 2))


def plan_train_step(
    config: DecoderConfig,
    target: "memory.Target | str",
    *,
    batch_size: int,
    seq_len: int,
    remat: Any = True,
    mesh_axes: Sequence[tuple[str, int]] | None = None,
    dtype: Any = jnp.bfloat16,
) -> "memory.Plan":
    """XLA's per-device memory plan of one full-parameter AdamW step of the decoder on a
    target: every weight trained, as [`eqx_lean.hf.make_train_step`][] trains them.

    ```python
    config = eqx_lean.hf.DecoderConfig.from_json("config.json")
    print(eqx_lean.hf.plan_train_step(config, "8xh100", batch_size=8, seq_len=1024))
    ```

    The weights, their gradients and AdamW's two moments are all in `dtype` (pass
    `jnp.float32` for float32 master weights) and fully sharded over the `fsdp` mesh axis, as
    in [`eqx_lean.hf.plan_lora_step`][]; the token ids' rows are split over every mesh axis.
    The weights and the optimizer state are donated (updated in place), as a training loop
    does. The step is [`eqx_lean.memory.plan_train_step`][] of
    [`eqx_lean.hf.next_token_loss`][]. Nothing is allocated.

    **Arguments:**

    - `config`: the decoder's configuration.
    - `target`: a [`eqx_lean.memory.Target`][] or a spec for [`eqx_lean.memory.target`][].
    - `batch_size`, `seq_len`: the token ids' shape, positive integers; `batch_size` must be a
        multiple of the number of devices.
    - `remat`: as for [`eqx_lean.hf.next_token_loss`][]: `True` recomputes each layer's
        activations in the backward pass.
    - `mesh_axes`: as for [`eqx_lean.hf.plan_lora_step`][].
    - `dtype`: the weights' dtype (and so their gradients' and moments').

    **Returns:**

    A [`eqx_lean.memory.Plan`][].
    """
    where, mesh, ids = check_step_arguments(target, batch_size, seq_len, mesh_axes)
    (model,) = _on_mesh((abstract_model(config, dtype),), mesh)
    loss = functools.partial(next_token_loss, remat=remat)
    optimizer = adamw(1e-4, weight_decay=0.0)
    return memory.plan_train_step(loss, model, optimizer, ids, target=where)


def longest_context(
    config: DecoderConfig,
    target: "memory.Target | str",
    *,
    batch_size: int = 1,
    multiple: int = 2048,
    max_seq_len: int = 2**21,
    first: int | None = None,
    max_compiles: int | None = MAX_COMPILES,
    lora_config: lora.LoraConfig | None = None,
    remat: Remat = True,
    mesh_axes: Sequence[tuple[str, int]] | None = None,
    dtype: Any = jnp.bfloat16,
    quantize: Any = None,
) -> "memory.Longest":
    """The longest sequence whose LoRA step ([`eqx_lean.hf.plan_lora_step`][]) fits a target
    at a given batch: "how long a context fits this GPU?", in at most 8 compiles.

    ```python
    config = eqx_lean.hf.DecoderConfig.from_json("config.json")
    found = eqx_lean.hf.longest_context(
        config, "h100", quantize="nf4", remat="offload", max_seq_len=65_536
    )
    print(found.size, found.plan.host)  # tokens per sequence; host bytes the offload takes
    ```

    The search is [`eqx_lean.memory.longest`][]'s over the sequence length, in multiples of
    `multiple`: it fits the step's bytes as a line in the length from two compiles (`first`
    and twice it), then compiles where the line through the last two meets the device's
    memory, until a length fits and the next multiple does not. The step's bytes grow
    linearly in the length once attention is blockwise, the loss fused and the MLP chunked
    (the defaults), so that takes about 4 compiles.

    **Arguments:**

    - `config`, `target`, `lora_config`, `remat`, `mesh_axes`, `dtype`, `quantize`: as for
        [`eqx_lean.hf.plan_lora_step`][].
    - `batch_size`: sequences per step, a multiple of the number of devices.
    - `multiple`: lengths are multiples of it: the answer is exact to it (2,048 tokens by
        default: the 8B searches of `docs/benchmarks.md` close their bracket to it within 8
        compiles, where a step of 1,024 took more).
    - `max_seq_len`: the longest length considered.
    - `first`: the first length planned, a multiple of `multiple`; default `16 * multiple`.
    - `max_compiles`: as for [`eqx_lean.memory.longest`][] (default 8).

    **Returns:**

    A [`eqx_lean.memory.Longest`][]: `size` is the longest sequence that fits, `plan` its plan.
    """
    # Checked here, so that a bad argument is refused before any compile.
    multiple = arguments.integer(multiple, "`multiple`", minimum=1)
    max_seq_len = arguments.integer(max_seq_len, "`max_seq_len`", minimum=multiple)
    if first is None:
        first = min(16 * multiple, max_seq_len // multiple * multiple)
    check_remat(remat)
    check_step_arguments(target, batch_size, multiple, mesh_axes)

    def plan_at(seq_len: int) -> "memory.Plan":
        return plan_lora_step(
            config,
            target,
            batch_size=batch_size,
            seq_len=seq_len,
            lora_config=lora_config,
            remat=remat,
            mesh_axes=mesh_axes,
            dtype=dtype,
            quantize=quantize,
        )

    return memory.longest(
        plan_at, maximum=max_seq_len, multiple=multiple, first=first, max_compiles=max_compiles
    )
