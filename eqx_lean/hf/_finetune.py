"""LoRA fine-tuning: optax AdamW on the adapters only, the base frozen, with `remat` through the
stacked blocks.

The model is split with `eqx.partition(model, lora_filter(model))` into the adapters (float32
master weights) and the frozen base (any dtype). Only the adapters are differentiated and only
they have optimizer state; the base is an argument of the compiled step that is never donated,
never differentiated and never updated.
"""

# Annotations stay unevaluated: `eqx_lean.lora` imports the HF decoder, so it may still be
# initialising when this module is imported (`import eqx_lean.lora` first).
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec
from jaxtyping import Array

from .. import _arguments as arguments, lora  # the module, not its names: see the note above
from .._core import tree_bytes
from .._core.sharding import explicit_type_sharding, mesh_axis_size
from .._scan.remat import Remat
from ..quant._linear import quantize_linears
from ._config import DecoderConfig
from ._data import batches
from ._model import Decoder, init
from ._state import FinetuneState, load_state, save_state as save
from ._train import _import_optax, adamw, counted_targets, next_token_loss


def make_lora_step(
    optimizer: Any, *, remat: Remat = True, grad_accum: int = 1
) -> jax.stages.Wrapped:
    """A jitted LoRA training step: `(frozen, adapters, opt_state, input_ids, key, labels=None)
    -> (adapters, opt_state, loss)`.

    **Arguments:**

    - `optimizer`: an optax optimizer of the adapters (such as [`adamw`][eqx_lean.hf.adamw]).
    - `remat`: recompute each layer's activations in the backward pass instead of saving them:
        what `remat=` of [`eqx_lean.fold`][] takes: `True`, `"offload"` (each layer's input
        kept in the accelerator's host memory, the rest recomputed: the longest contexts) or
        a checkpoint policy, such as the name-based
        `jax.checkpoint_policies.save_only_these_names(eqx_lean.hf.LAYER_INPUT)` (keep each
        layer's input on the device).
    - `grad_accum`: gradient accumulation: `input_ids` of shape `[grad_accum * micro, seq]`
        are cut into `grad_accum` micro-batches of `micro` consecutive rows (and `labels`
        with them), run one after the other (a `lax.scan`, so activations are those of one
        micro-batch), and their summed losses and gradients added in float32, then divided
        by the whole batch's count of targets, as transformers' `Trainer` does with
        `num_items_in_batch`: the loss and the update are those of the whole batch, however
        the masked positions fall among the micro-batches, up to float32 rounding. With LoRA
        dropout, micro-batch `j` draws with `jax.random.fold_in(key, j)`.

    **Returns:**

    The jitted step. `adapters` and `frozen` are the two halves of
    `eqx.partition(model, lora_filter(model))`. The adapters and the optimizer state are
    donated (updated in place); the frozen base, the batch and the key are not. `key` drives
    LoRA dropout (`None` when there is none). `labels` is as for
    [`next_token_loss`][eqx_lean.hf.next_token_loss] (HF's meaning: unshifted, `-100` not
    trained on; `None`: every next token), shaped and sharded like `input_ids`. The returned
    loss is the float32 mean over the batch's counted targets.
    """
    optax = _import_optax()
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"`grad_accum` must be a positive integer; got {grad_accum!r}.")

    def step(
        frozen: Decoder,
        adapters: Decoder,
        opt_state: Any,
        input_ids: Array,
        key: Any,
        labels: Array | None = None,
    ) -> tuple[Decoder, Any, Array]:
        def loss_of(
            adapters: Decoder, ids: Array, labels: Array | None, key: Any, reduction: Any = "mean"
        ) -> Array:
            model = eqx.combine(adapters, frozen)
            loss = next_token_loss(
                model, ids, labels=labels, remat=remat, key=key, reduction=reduction
            )
            return loss.astype(jnp.float32)

        if grad_accum == 1:
            loss, grads = jax.value_and_grad(loss_of)(adapters, input_ids, labels, key)
        else:
            loss, grads = _accumulated(loss_of, adapters, input_ids, labels, key, grad_accum)
        # optax mixes Python floats with int32 step counts (bias correction), which strict
        # dtype promotion rejects; the model itself stays strict-clean.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, loss

    # Every leaf of the partitioned model is an array (or None), so plain `jax.jit` applies,
    # donating exactly the adapters and the optimizer state.
    return jax.jit(step, donate_argnums=(1, 2))


def _micro_batches(input_ids: Array, grad_accum: int) -> Array:
    """`input_ids` `[batch, seq]` as `[grad_accum, batch // grad_accum, seq]`, consecutive rows.

    With Explicit mesh axes JAX cannot reshape a sharded batch axis into two (its devices
    would have to split between the axes), so the ids (a few KiB of integers) are gathered
    first, then each micro-batch is sharded as the batch was where its rows divide evenly
    over those devices (replicated where not). With Auto axes XLA places them.
    """
    batch = input_ids.shape[0]
    shape = (grad_accum, batch // grad_accum, *input_ids.shape[1:])
    sharding = explicit_type_sharding(input_ids)
    if sharding is None:
        return input_ids.reshape(shape)
    spec = tuple(sharding.spec) + (None,) * (input_ids.ndim - len(sharding.spec))
    whole = jax.sharding.reshard(input_ids, sharding.update(spec=PartitionSpec()))
    micro = whole.reshape(shape)
    rows = spec[0] if (batch // grad_accum) % mesh_axis_size(sharding.mesh, spec[0]) == 0 else None
    return jax.sharding.reshard(micro, sharding.update(spec=PartitionSpec(None, rows, *spec[1:])))


def _accumulated(
    loss_of: Any,
    adapters: Decoder,
    input_ids: Array,
    labels: Array | None,
    key: Any,
    grad_accum: int,
) -> tuple[Array, Decoder]:
    """The loss and gradient of the whole batch from `grad_accum` equal micro-batches of
    `input_ids` (and `labels`): each micro-batch's summed loss and its gradient, added in
    float32 over a `lax.scan` (so only one micro-batch's activations are ever live), divided
    by the whole batch's count of targets (HF's `num_items_in_batch`), not averaged over
    micro-batches, whose counts differ where labels are masked."""
    batch = input_ids.shape[0]
    if batch % grad_accum:
        raise ValueError(
            f"`input_ids` has {batch} rows, which `grad_accum`={grad_accum} micro-batches "
            "cannot share equally: the batch must be a multiple of `grad_accum`."
        )
    count = counted_targets(input_ids, labels).astype(jnp.float32)
    micro = _micro_batches(input_ids, grad_accum)
    micro_labels = None if labels is None else _micro_batches(labels, grad_accum)

    def body(carry: Any, xs: Any) -> tuple[Any, None]:
        loss_sum, grad_sum = carry
        index, ids, lab = xs
        micro_key = None if key is None else jax.random.fold_in(key, index)
        loss, grads = jax.value_and_grad(lambda a: loss_of(a, ids, lab, micro_key, "sum"))(adapters)
        grad_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sum, grads)
        return (loss_sum + loss, grad_sum), None

    # float32 sums whatever the adapters' dtype: bfloat16 sums would round the small
    # micro-batch gradients away.
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), adapters)
    init = (jnp.zeros((), jnp.float32), zeros)
    xs = (jnp.arange(grad_accum), micro, micro_labels)
    (loss_sum, grad_sum), _ = lax.scan(body, init, xs)
    grads = jax.tree.map(lambda g, a: (g / count).astype(a.dtype), grad_sum, adapters)
    return loss_sum / count, grads


@dataclasses.dataclass(frozen=True)
class FinetuneSettings:
    """The optimisation settings of [`finetune`][eqx_lean.hf.finetune].

    `batch_size` is the rows of one update; with `grad_accum` > 1 they are run as `grad_accum`
    micro-batches of `batch_size // grad_accum` rows (see
    [`make_lora_step`][eqx_lean.hf.make_lora_step]).
    """

    steps: int = 100
    batch_size: int = 1
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    seed: int = 0
    remat: bool = True
    grad_accum: int = 1


def _run_info(
    settings: FinetuneSettings,
    lora_config: lora.LoraConfig,
    rows: np.ndarray,
    labels: np.ndarray | None = None,
) -> dict[str, Any]:
    """What a resumed run must share with the saved one to continue it exactly, in the form it
    takes after a JSON round trip (tuples as lists), so a loaded copy compares equal."""
    info: dict[str, Any] = dataclasses.asdict(settings)
    del info["steps"]  # a resumed run may go further than the first one planned
    info["lora"] = dataclasses.asdict(lora_config)
    # The data itself, not just its shape: other rows would give other batches.
    rows = np.ascontiguousarray(rows)
    info["rows"] = {"shape": list(rows.shape), "sha256": hashlib.sha256(rows.data).hexdigest()}
    if labels is not None:  # absent without labels: states saved before `labels` still resume
        labels = np.ascontiguousarray(labels)
        info["labels"] = {"sha256": hashlib.sha256(labels.data).hexdigest()}
    return json.loads(json.dumps(info, default=str))


def finetune(
    model: Decoder,
    rows: np.ndarray,
    lora_config: lora.LoraConfig,
    settings: FinetuneSettings = FinetuneSettings(),
    *,
    progress: bool = False,
    save_state: str | os.PathLike | None = None,
    save_every: int = 0,
    resume: str | os.PathLike | None = None,
    labels: np.ndarray | None = None,
) -> tuple[Decoder, list[float], list[float]]:
    """Adds fresh LoRA adapters to `model` and trains them with AdamW on `rows`.

    **Arguments:**

    - `model`: the base [`Decoder`][eqx_lean.hf.Decoder] (any dtype; it stays frozen and is
        never copied).
    - `rows`: packed token ids `[rows, seq_len]` (see [`load_rows`][eqx_lean.hf.load_rows]).
    - `lora_config`: the adapters to add.
    - `settings`: steps, batch size, learning rate, weight decay, seed, remat, gradient
        accumulation.
    - `progress`: show a tqdm progress bar with the loss.
    - `save_state`: a directory to save the run's [`FinetuneState`][eqx_lean.hf.FinetuneState]
        in (adapters, optimizer state, step, dropout key), after the last step and every
        `save_every` steps; each save replaces the directory atomically.
    - `save_every`: steps between saves (0: only at the end).
    - `resume`: a directory saved by an earlier run with the same settings and data (labels
        included): training continues from its step up to `settings.steps`, reading the
        batches and dropout keys the uninterrupted run would have, so the result is bitwise
        the same.
    - `labels`: integer targets shaped like `rows`, with HF's meaning (see
        [`next_token_loss`][eqx_lean.hf.next_token_loss]: unshifted, `-100` where the next
        token is not trained on, such as a prompt or padding), drawn into each batch with its
        rows; `None` trains on every next token. With gradient accumulation the loss is the
        mean over the whole batch's counted targets (see
        [`make_lora_step`][eqx_lean.hf.make_lora_step]).

    **Returns:**

    The model with trained adapters, the loss of every step run here, and the seconds of every
    step (the first includes compilation).
    """
    key = jax.random.key(settings.seed)
    init_key, dropout_key = jax.random.split(key)
    model = lora.add_lora(model, lora_config, key=init_key)
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    optimizer = adamw(settings.learning_rate, weight_decay=settings.weight_decay)
    opt_state = optimizer.init(adapters)
    if labels is not None:
        labels = np.asarray(labels)
        if labels.shape != rows.shape or not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(
                f"`labels` must be integers of `rows`' shape {rows.shape}; got "
                f"{labels.dtype}{list(labels.shape)}."
            )
    info = _run_info(settings, lora_config, rows, labels)
    state = FinetuneState(adapters, opt_state, 0, dropout_key, info)
    if resume is not None:
        state = load_state(resume, state)
        if state.info != info:
            raise ValueError(
                f"{os.fspath(resume)} was saved by a run with other settings or data, which "
                f"resuming would not continue exactly: saved {state.info}, now {info}."
            )
        if state.step > settings.steps:
            raise ValueError(
                f"{os.fspath(resume)} is at step {state.step}, past `steps`={settings.steps}."
            )
    adapters, opt_state, dropout_key = state.adapters, state.opt_state, state.key
    step = make_lora_step(optimizer, remat=settings.remat, grad_accum=settings.grad_accum)
    # Labels ride with their rows: the same shuffles draw both.
    both = rows if labels is None else np.stack([rows, labels], axis=1)
    data = batches(both, settings.batch_size, seed=settings.seed, start=state.step)
    steps: Any = range(state.step, settings.steps)
    if progress:
        try:
            from tqdm import tqdm
        except ImportError as e:
            raise ImportError(
                "The progress bar needs tqdm: from the root of the eqx_lean checkout, "
                '`pip install ".[hf]"`, or `pip install tqdm`.'
            ) from e

        steps = tqdm(steps, desc="finetune", unit="step")
    losses, seconds = [], []
    for i in steps:
        key_i = jax.random.fold_in(dropout_key, i) if lora_config.lora_dropout > 0 else None
        start = time.perf_counter()
        batch = next(data)
        if labels is None:
            ids, batch_labels = jnp.asarray(batch), None
        else:
            ids, batch_labels = jnp.asarray(batch[:, 0]), jnp.asarray(batch[:, 1])
        adapters, opt_state, loss = step(frozen, adapters, opt_state, ids, key_i, batch_labels)
        losses.append(float(loss))  # waits for the step
        seconds.append(time.perf_counter() - start)
        if progress:
            steps.set_postfix(loss=f"{losses[-1]:.4f}")
        done = i + 1
        if save_state is not None and (
            done == settings.steps or (save_every > 0 and done % save_every == 0)
        ):
            save(save_state, FinetuneState(adapters, opt_state, done, dropout_key, info))
    return eqx.combine(adapters, frozen), losses, seconds


def _abstract_lora_model(
    config: DecoderConfig, lora_config: lora.LoraConfig, dtype: Any, quantize: Any = None
) -> Decoder:
    base = init(config, key=jax.random.key(0), dtype=dtype)
    if quantize is not None:
        base = quantize_linears(base, quantize)
    return lora.add_lora(base, lora_config, key=jax.random.key(1))


def step_memory(
    config: DecoderConfig,
    lora_config: lora.LoraConfig,
    *,
    batch_size: int,
    seq_len: int,
    dtype: Any = jnp.bfloat16,
    remat: bool = True,
) -> dict[str, int]:
    """XLA's memory plan for one LoRA AdamW step of a model of `config`, compiled for abstract
    inputs (nothing is allocated), with the arguments broken down, in bytes.

    **Returns:**

    A dict: `base` (the frozen weights), `adapters` (float32), `optimizer` (AdamW's two moments
    and step count), `batch` (token ids), `temp` (XLA's temporaries: the carries saved for the
    backward pass, one layer's recomputed activations, float32 or sliced copies of weights,
    gradients), `output` and `alias` (output bytes written into donated inputs).
    """
    # A batch of no rows or no tokens compiles and plans nothing.
    batch_size = arguments.integer(batch_size, "`batch_size`", minimum=1)
    seq_len = arguments.integer(seq_len, "`seq_len`", minimum=1)
    model = eqx.filter_eval_shape(_abstract_lora_model, config, lora_config, dtype)
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    optimizer = adamw(1e-4, weight_decay=0.0)
    opt_state = jax.eval_shape(optimizer.init, adapters)
    input_ids = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    step = make_lora_step(optimizer, remat=remat)
    compiled = step.lower(frozen, adapters, opt_state, input_ids, None).compile()
    analysis = compiled.memory_analysis()
    assert analysis is not None
    return {
        "base": tree_bytes(frozen),
        "adapters": tree_bytes(adapters),
        "optimizer": tree_bytes(opt_state),
        "batch": tree_bytes(input_ids),
        "temp": analysis.temp_size_in_bytes,
        "output": analysis.output_size_in_bytes,
        "alias": analysis.alias_size_in_bytes,
    }
