"""Next-token loss and optax training steps for the HF decoder."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._model import Mistral


def next_token_loss(
    model: Mistral,
    input_ids: Int[Array, "batch seq"],
    *,
    remat: bool = True,
    key: PRNGKeyArray | None = None,
) -> Float[Array, ""]:
    """Mean cross-entropy of predicting token `t+1` from tokens `<= t` (as HF's `labels`).

    `key` is the model's training randomness (LoRA dropout); `None` for none.
    """
    logits = model(input_ids, remat=remat, key=key)[:, :-1].astype(jnp.float32)
    targets = input_ids[:, 1:]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    # The target's log-probability as a masked sum over the vocabulary (one nonzero term: the
    # value `take_along_axis` would pick, exactly). Unlike a gather, it needs no output
    # sharding where the vocabulary is sharded over Explicit mesh axes.
    vocab = jnp.arange(log_probs.shape[-1], dtype=targets.dtype).reshape(1, 1, -1)
    picked = jnp.sum(jnp.where(vocab == targets[..., None], log_probs, 0.0), axis=-1)
    return -jnp.mean(picked)


def _import_optax() -> Any:
    try:
        import optax
    except ImportError as e:
        raise ImportError(
            "Training needs optax: from the root of the eqx_lean checkout, "
            '`pip install ".[train]"` (or `pip install ".[hf]"` for the whole HF layer), or '
            "`pip install optax`."
        ) from e
    return optax


def adamw(learning_rate: float = 1e-3, weight_decay: float = 0.01) -> Any:
    """optax AdamW with torch's defaults (betas 0.9/0.999, eps 1e-8)."""
    optax = _import_optax()
    return optax.adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)


def make_train_step(optimizer: Any, *, remat: bool = True) -> Any:
    """A jitted `(model, opt_state, input_ids) -> (model, opt_state, loss)`."""
    optax = _import_optax()

    @eqx.filter_jit(donate="all-except-first")
    def train_step(model: Mistral, opt_state: Any, input_ids: Array) -> Any:
        loss, grads = eqx.filter_value_and_grad(
            lambda m: next_token_loss(m, input_ids, remat=remat)
        )(model)
        # optax mixes Python floats with int32 step counts (bias correction), which strict
        # dtype promotion rejects; the model itself stays strict-clean.
        with jax.numpy_dtype_promotion("standard"):
            params = eqx.filter(model, eqx.is_array)
            updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(model, updates), opt_state, loss

    return train_step
