"""The LoRA step of a Hugging Face decoder, planned for a target's devices without them."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .. import lora, memory
from .._io.quantized import quant_config
from .._memory.targets import resolve_target
from ._config import MistralConfig
from ._finetune import _abstract_lora_model, make_lora_step
from ._train import adamw


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


def plan_lora_step(
    config: MistralConfig,
    target: "memory.Target | str",
    *,
    batch_size: int,
    seq_len: int,
    lora_config: lora.LoraConfig | None = None,
    remat: bool = True,
    mesh_axes: Sequence[tuple[str, int]] | None = None,
    dtype: Any = jnp.bfloat16,
    quantize: Any = None,
) -> "memory.Plan":
    """XLA's per-device memory plan of one LoRA AdamW step (`make_lora_step`) on a target.

    ```python
    config = eqx_lean.hf.MistralConfig.from_json("config.json")
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
    - `batch_size`, `seq_len`: the token ids' shape; `batch_size` must be a multiple of the
        number of devices.
    - `lora_config`: the adapters; default rank 16 (alpha 32) on all seven projections.
    - `remat`: as for [`eqx_lean.hf.make_lora_step`][].
    - `mesh_axes`: `(name, size)` pairs over all the target's devices, with names among
        `"data"` and `"fsdp"`; default: `fsdp` over every device.
    - `dtype`: the frozen base's dtype.
    - `quantize`: `None`, `"nf4"`, `"int8"` or an [`eqx_lean.quant.QuantConfig`][]: plan the
        step on a base whose decoder linears are quantised (QLoRA), as
        `load_hf(..., quantize=...)` loads it.

    **Returns:**

    A [`eqx_lean.memory.Plan`][].
    """
    where = resolve_target(target)
    lora_config = lora_config or lora.LoraConfig(
        r=16, lora_alpha=32, target_modules=ALL_PROJECTIONS
    )
    axes = list(mesh_axes) if mesh_axes is not None else [("fsdp", len(where.devices))]
    names = tuple(name for name, _ in axes)
    unknown = set(names) - {"data", "fsdp"}
    if unknown:
        raise ValueError(f"mesh_axes names must be 'data' and 'fsdp'; got {sorted(unknown)}.")
    # Auto axes: the decoder's products leave their output shardings to XLA's propagation.
    mesh = where.mesh(
        tuple(size for _, size in axes), names, axis_types=(AxisType.Auto,) * len(axes)
    )
    # Every device takes its own rows: the fsdp axis is data-parallel too (ZeRO-3).
    rows = len(where.devices)
    if batch_size % rows:
        raise ValueError(
            f"batch_size {batch_size} must be a multiple of the number of devices ({rows}): "
            "the token ids are split over every mesh axis."
        )
    quant = quant_config(quantize)
    model = eqx.filter_eval_shape(_abstract_lora_model, config, lora_config, dtype, quant)
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    optimizer = adamw(1e-4, weight_decay=0.0)
    opt_state = jax.eval_shape(optimizer.init, adapters)
    if "fsdp" in mesh.shape:
        frozen = _placed(frozen, fsdp_shardings(frozen, mesh))
        adapters = _placed(adapters, fsdp_shardings(adapters, mesh))
        opt_state = _placed(opt_state, fsdp_shardings(opt_state, mesh))
    else:
        replicated = NamedSharding(mesh, PartitionSpec())
        frozen, adapters, opt_state = (
            _placed(t, jax.tree.map(lambda _: replicated, t)) for t in (frozen, adapters, opt_state)
        )
    ids = jax.ShapeDtypeStruct(
        (batch_size, seq_len),
        jnp.int32,
        sharding=NamedSharding(mesh, PartitionSpec(names)),
    )
    step = make_lora_step(optimizer, remat=remat)
    return memory.plan(step, frozen, adapters, opt_state, ids, None, target=where, donate=(1, 2))
