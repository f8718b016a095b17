"""Next-token loss and optax training steps for the HF decoder."""

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._core.sharding import resharded_like
from ..nn import linear_cross_entropy
from ._model import Decoder, check_attention


IGNORE_INDEX = -100
"""The label of a position not trained on (HF's and torch's `ignore_index`)."""


def next_token_loss(
    model: Decoder,
    input_ids: Int[Array, "batch seq"],
    *,
    labels: Int[Array, "batch seq"] | None = None,
    remat: Any = True,
    key: PRNGKeyArray | None = None,
    fused: bool = True,
    chunk_bytes: int | None = None,
    reduction: Literal["mean", "sum"] = "mean",
    attention: str = "blockwise",
    segment_ids: Int[Array, "batch seq"] | None = None,
    positions: Int[Array, "batch seq"] | None = None,
    mlp_chunk_bytes: int | None = None,
) -> Float[Array, ""]:
    """Mean cross-entropy of predicting token `t+1` from tokens `<= t`, with HF's `labels`.

    By default the loss is [`eqx_lean.nn.linear_cross_entropy`][] on the model's final hidden
    states: the `[batch, seq, vocab]` logits are never held whole, neither in the forward pass
    nor in the gradient. A head that is not a plain linear layer (LoRA on `lm_head`, a
    quantised head) is applied as the model does, materialising the logits.

    **Arguments:**

    - `model`: the decoder.
    - `input_ids`: integer token ids `[batch, seq]`.
    - `labels`: as HF's `labels=` (`ForCausalLMLoss`): the *unshifted* targets `[batch, seq]`,
        usually `input_ids` with the positions not to train on (a prompt, padding) set to
        `-100`; position `t` of the logits predicts `labels[:, t + 1]`. The loss is the mean
        over the counted targets (those not `-100`), NaN when none is counted, as in
        transformers. `None` means `input_ids` (every next token counted).
    - `remat`: as for the model's call; `True` recomputes each block in the backward pass.
    - `key`: the model's training randomness (LoRA dropout); `None` for none.
    - `fused`: `False` computes the loss the textbook way (float32 logits, `log_softmax`): the
        reference the fused loss is tested against.
    - `chunk_bytes`: as for `linear_cross_entropy` (`None`: its default, by platform).
    - `reduction`: `"mean"` (above) or `"sum"`, the sum over the counted targets (0 where none
        is): what gradient accumulation adds up over micro-batches before dividing by the
        whole batch's count (HF's `num_items_in_batch`).
    - `attention`: `"blockwise"` ([`eqx_lean.nn.attention`][], no `[heads, seq, seq]` scores
        held) or `"eager"` (every score held, HF's eager attention: the reference).
    - `segment_ids`, `positions`: packed rows, as for the model's call (with the `labels` of
        [`pack_documents`][eqx_lean.hf.pack_documents], which mask each document's first
        token); `None` for one sequence per row.
    - `mlp_chunk_bytes`: as for the model's call: the MLP's activations are those of chunks of
        positions within this many bytes (`None`: the platform's, as for the model's call).

    **Returns:**

    The loss, a float32 scalar.

    **Example:**

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from eqx_lean.hf import DecoderConfig, init, next_token_loss

    model = init(DecoderConfig.tiny(), key=jax.random.key(0))
    ids = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    labels = ids.at[0, :3].set(-100).at[1, :5].set(-100)  # the prompts: not trained on
    loss = eqx.filter_jit(next_token_loss)(model, ids, labels=labels)
    textbook = eqx.filter_jit(next_token_loss)(model, ids, labels=labels, fused=False)
    assert jnp.allclose(loss, textbook, rtol=1e-5)
    ```
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f'`reduction` must be "mean" or "sum"; got {reduction!r}.')
    attention = check_attention(attention)
    if labels is None:
        labels = input_ids
    if labels.shape != input_ids.shape or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(
            f"`labels` must be integers of `input_ids`' shape {input_ids.shape}; got "
            f"{labels.dtype}{list(labels.shape)}."
        )
    # HF's shift: the targets move one position left, the last position predicts nothing.
    ignored = jnp.full((labels.shape[0], 1), IGNORE_INDEX, labels.dtype)
    targets = jnp.concatenate([labels[:, 1:], resharded_like(ignored, labels)], axis=1)
    head = model.lm_head
    if fused and (head is None or isinstance(head, eqx.nn.Linear)):
        hidden = model.hidden_states(
            input_ids,
            remat=remat,
            key=key,
            attention=attention,
            segment_ids=segment_ids,
            positions=positions,
            mlp_chunk_bytes=mlp_chunk_bytes,
        )
        weight = model.embed_tokens.weight if head is None else head.weight
        bias = None if head is None else head.bias
        return linear_cross_entropy(
            hidden,
            weight,
            targets,
            bias=bias,
            ignore_index=IGNORE_INDEX,
            logit_soft_cap=model.config.final_logit_softcapping,
            chunk_bytes=chunk_bytes,
            reduction=reduction,
        )
    logits = model(
        input_ids,
        remat=remat,
        key=key,
        attention=attention,
        segment_ids=segment_ids,
        positions=positions,
        mlp_chunk_bytes=mlp_chunk_bytes,
    ).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    # The target's log-probability as a masked sum over the vocabulary (one nonzero term: the
    # value `take_along_axis` would pick, exactly). Unlike a gather, it needs no output
    # sharding where the vocabulary is sharded over Explicit mesh axes.
    vocab = jnp.arange(log_probs.shape[-1], dtype=targets.dtype).reshape(1, 1, -1)
    picked = jnp.sum(jnp.where(vocab == targets[..., None], log_probs, 0.0), axis=-1)
    counted = targets != IGNORE_INDEX
    total = -jnp.sum(jnp.where(counted, picked, 0.0))
    if reduction == "sum":
        return total
    return total / jnp.sum(counted, dtype=jnp.int32).astype(jnp.float32)


def counted_targets(input_ids: Array, labels: Array | None) -> Array:
    """The targets `next_token_loss` counts in a batch, an int32 scalar: HF's
    `num_items_in_batch` (the labels after each row's first position that are not `-100`;
    every position after the first where `labels` is `None`)."""
    if labels is None:
        return jnp.asarray(input_ids.shape[0] * (input_ids.shape[1] - 1), jnp.int32)
    return jnp.sum(labels[:, 1:] != IGNORE_INDEX, dtype=jnp.int32)


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
    """A jitted `(model, opt_state, input_ids, labels=None) -> (model, opt_state, loss)`:
    every weight trained.

    **Arguments:**

    - `optimizer`: an optax optimizer of the whole model (such as [`adamw`][eqx_lean.hf.adamw]).
    - `remat`: recompute each layer's activations in the backward pass instead of saving them.

    **Returns:**

    The jitted step. `labels` is as for [`next_token_loss`][eqx_lean.hf.next_token_loss]
    (HF's meaning: unshifted, `-100` not trained on; `None`: every next token), sharded like
    `input_ids`; the loss is the mean over the counted targets.
    """
    optax = _import_optax()

    @eqx.filter_jit(donate="all-except-first")
    def train_step(
        model: Decoder, opt_state: Any, input_ids: Array, labels: Array | None = None
    ) -> Any:
        loss, grads = eqx.filter_value_and_grad(
            lambda m: next_token_loss(m, input_ids, labels=labels, remat=remat)
        )(model)
        # optax mixes Python floats with int32 step counts (bias correction), which strict
        # dtype promotion rejects; the model itself stays strict-clean.
        with jax.numpy_dtype_promotion("standard"):
            params = eqx.filter(model, eqx.is_array)
            updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(model, updates), opt_state, loss

    return train_step
