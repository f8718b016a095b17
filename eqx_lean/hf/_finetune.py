"""LoRA fine-tuning: optax AdamW on the adapters only, the base frozen, with `remat` through the
stacked blocks.

The model is split with `eqx.partition(model, lora_filter(model))` into the adapters (float32
master weights) and the frozen base (any dtype). Only the adapters are differentiated and only
they have optimizer state; the base is an argument of the compiled step that is never donated,
never differentiated and never updated.
"""

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ..lora._lora import LoraConfig, add_lora, lora_filter
from ._config import MistralConfig
from ._data import batches
from ._model import Mistral, init
from ._train import _import_optax, adamw, next_token_loss


def make_lora_step(optimizer: Any, *, remat: bool = True) -> jax.stages.Wrapped:
    """A jitted `(frozen, adapters, opt_state, input_ids, key) -> (adapters, opt_state, loss)`.

    `adapters` and `frozen` are the two halves of `eqx.partition(model, lora_filter(model))`.
    The adapters and the optimizer state are donated (updated in place); the frozen base, the
    batch and the key are not. `key` drives LoRA dropout (`None` when there is none).
    """
    optax = _import_optax()

    def step(
        frozen: Mistral, adapters: Mistral, opt_state: Any, input_ids: Array, key: Any
    ) -> tuple[Mistral, Any, Array]:
        def loss_of(adapters: Mistral) -> Array:
            model = eqx.combine(adapters, frozen)
            return next_token_loss(model, input_ids, remat=remat, key=key)

        loss, grads = jax.value_and_grad(loss_of)(adapters)
        # optax mixes Python floats with int32 step counts (bias correction), which strict
        # dtype promotion rejects; the model itself stays strict-clean.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, loss

    # Every leaf of the partitioned model is an array (or None), so plain `jax.jit` applies,
    # donating exactly the adapters and the optimizer state.
    return jax.jit(step, donate_argnums=(1, 2))


@dataclasses.dataclass(frozen=True)
class FinetuneSettings:
    """The optimisation settings of [`finetune`][]."""

    steps: int = 100
    batch_size: int = 1
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    seed: int = 0
    remat: bool = True


def finetune(
    model: Mistral,
    rows: np.ndarray,
    lora_config: LoraConfig,
    settings: FinetuneSettings = FinetuneSettings(),
    *,
    progress: bool = False,
) -> tuple[Mistral, list[float], list[float]]:
    """Adds fresh LoRA adapters to `model` and trains them with AdamW on `rows`.

    **Arguments:**

    - `model`: the base [`Mistral`][] (any dtype; it stays frozen and is never copied).
    - `rows`: packed token ids `[rows, seq_len]` (see `data.load_rows`).
    - `lora_config`: the adapters to add.
    - `settings`: steps, batch size, learning rate, weight decay, seed, remat.
    - `progress`: show a tqdm progress bar with the loss.

    **Returns:**

    The model with trained adapters, the loss of every step, and the seconds of every step (the
    first includes compilation).
    """
    key = jax.random.key(settings.seed)
    init_key, dropout_key = jax.random.split(key)
    model = add_lora(model, lora_config, key=init_key)
    adapters, frozen = eqx.partition(model, lora_filter(model))
    optimizer = adamw(settings.learning_rate, weight_decay=settings.weight_decay)
    opt_state = optimizer.init(adapters)
    step = make_lora_step(optimizer, remat=settings.remat)
    data: Iterator[np.ndarray] = batches(rows, settings.batch_size, seed=settings.seed)
    steps: Any = range(settings.steps)
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
        adapters, opt_state, loss = step(
            frozen, adapters, opt_state, jnp.asarray(next(data)), key_i
        )
        losses.append(float(loss))  # waits for the step
        seconds.append(time.perf_counter() - start)
        if progress:
            steps.set_postfix(loss=f"{losses[-1]:.4f}")
    return eqx.combine(adapters, frozen), losses, seconds


def _abstract_lora_model(config: MistralConfig, lora_config: LoraConfig, dtype: Any) -> Mistral:
    base = init(config, key=jax.random.key(0), dtype=dtype)
    return add_lora(base, lora_config, key=jax.random.key(1))


def step_memory(
    config: MistralConfig,
    lora_config: LoraConfig,
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
    model = eqx.filter_eval_shape(_abstract_lora_model, config, lora_config, dtype)
    adapters, frozen = eqx.partition(model, lora_filter(model))
    optimizer = adamw(1e-4, weight_decay=0.0)
    opt_state = jax.eval_shape(optimizer.init, adapters)
    input_ids = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    step = make_lora_step(optimizer, remat=remat)
    compiled = step.lower(frozen, adapters, opt_state, input_ids, None).compile()
    analysis = compiled.memory_analysis()
    assert analysis is not None

    def nbytes(tree: Any) -> int:
        return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    return {
        "base": nbytes(frozen),
        "adapters": nbytes(adapters),
        "optimizer": nbytes(opt_state),
        "batch": nbytes(input_ids),
        "temp": analysis.temp_size_in_bytes,
        "output": analysis.output_size_in_bytes,
        "alias": analysis.alias_size_in_bytes,
    }
