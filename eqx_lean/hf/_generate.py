"""Text generation with a fixed-size KV cache: one prefill, then jitted in-place decode steps."""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._model import KVCache, Mistral


def sample(
    logits: Float[Array, "batch vocab"],
    key: PRNGKeyArray | None,
    temperature: float = 0.0,
    top_k: int | None = None,
) -> Int[Array, " batch"]:
    """Picks the next token: greedy when `temperature == 0`, else sampled from the
    temperature-scaled distribution restricted to the `top_k` most likely tokens (all if None).
    """
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        raise ValueError("`key` must be given when `temperature > 0` (sampling is random).")
    scaled = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth_largest = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        scaled = jnp.where(scaled < kth_largest, -jnp.inf, scaled)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def _step(
    params: Mistral,
    cache: KVCache,
    input_ids: Int[Array, "batch seq"],
    key: PRNGKeyArray | None,
    *,
    static: Mistral,
    temperature: float,
    top_k: int | None,
) -> tuple[Int[Array, " batch"], Float[Array, "batch vocab"], KVCache]:
    model = eqx.combine(params, static)
    logits, cache = model.step(input_ids, cache)
    last = logits[:, -1]
    return sample(last, key, temperature, top_k), last, cache


# The cache is donated, so each step updates it in place; the model and the user's token ids
# are never donated. Prefill and decode differ only in `seq`, so decoding compiles once.
decode_step = jax.jit(
    _step, static_argnames=("static", "temperature", "top_k"), donate_argnames=("cache",)
)


def default_cache_size(model: Mistral, total_length: int) -> int:
    """Slots needed for `total_length` positions: the window, if the model has a smaller one."""
    window = model.config.sliding_window
    return total_length if window is None else min(window, total_length)


def generate(
    model: Mistral,
    prompt_ids: Int[Array, "batch prompt"],
    max_new_tokens: int,
    *,
    key: PRNGKeyArray | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    cache_size: int | None = None,
    return_logits: bool = False,
) -> Any:
    """Continues `prompt_ids` by `max_new_tokens` tokens.

    **Arguments:**

    - `model`: the [`Mistral`][] model.
    - `prompt_ids`: prompts of equal length, shape `[batch, prompt]`.
    - `max_new_tokens`: how many tokens to add.
    - `key`: random key, needed when `temperature > 0`.
    - `temperature`: 0 for greedy decoding, else the softmax temperature.
    - `top_k`: sample only among the `top_k` most likely tokens.
    - `cache_size`: slots of the KV cache; default: the whole sequence, or the sliding window
        if that is shorter (older positions are overwritten, as the window never sees them).
    - `return_logits`: also return the logits each new token was chosen from.

    **Returns:**

    The token ids `[batch, prompt + max_new_tokens]`, and with `return_logits` the logits
    `[batch, max_new_tokens, vocab]`.
    """
    prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
    if prompt_ids.ndim != 2 or prompt_ids.shape[1] < 1:
        raise ValueError(f"`prompt_ids` must have shape [batch, prompt>0]; got {prompt_ids.shape}.")
    if max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be a positive integer; got {max_new_tokens}.")
    if temperature > 0 and key is None:
        raise ValueError("`key` must be given when `temperature > 0` (sampling is random).")
    batch, prompt_length = prompt_ids.shape
    size = cache_size or default_cache_size(model, prompt_length + max_new_tokens)
    cache = KVCache.empty(model.config, batch, size, model.dtype)
    params, static = eqx.partition(model, eqx.is_array)
    step = functools.partial(decode_step, static=static, temperature=temperature, top_k=top_k)

    keys = [None] * max_new_tokens if key is None else list(jax.random.split(key, max_new_tokens))
    next_ids, last, cache = step(params, cache, prompt_ids, keys[0])
    new_ids, all_logits = [next_ids], [last]
    for step_key in keys[1:]:
        next_ids, last, cache = step(params, cache, next_ids[:, None], step_key)
        new_ids.append(next_ids)
        all_logits.append(last)
    ids = jnp.concatenate([prompt_ids, jnp.stack(new_ids, axis=1)], axis=1)
    return (ids, jnp.stack(all_logits, axis=1)) if return_logits else ids
