"""Text generation with a fixed-size KV cache: one prefill, then jitted in-place decode steps."""

import functools
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
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
    """Slots needed for `total_length` positions: the window, if every layer has one smaller."""
    window = model.config.max_window
    return total_length if window is None else min(window, total_length)


def _is_count(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and bool(value >= 1)


def _cache_size(cache_size: Any, model: Mistral, prompt_length: int, max_new_tokens: int) -> int:
    """`cache_size`, checked: the cache is a ring buffer, so one smaller than the positions
    some layer still attends to would overwrite keys that layer reads (other logits, no error).
    """
    total = prompt_length + max_new_tokens
    needed = default_cache_size(model, total)
    if cache_size is None:
        return needed
    if not _is_count(cache_size):
        raise ValueError(f"`cache_size` must be None or a positive integer; got {cache_size!r}.")
    if cache_size < needed:
        windows = model.config.layer_windows
        length = f"the prompt's {prompt_length} tokens and max_new_tokens={max_new_tokens}"
        if all(w is None for w in windows):
            why = f"every layer attends to the whole sequence: {length}"
        elif None in windows:
            why = (
                f"its full-attention layers (`layer_types`) attend to the whole sequence: {length}"
            )
        elif needed < total:
            why = (
                f"every layer attends to its last {needed} positions (`sliding_window`), and a "
                "ring buffer smaller than the window overwrites positions still in it"
            )
        else:
            window = model.config.max_window
            why = f"the sliding window ({window}) covers the whole sequence: {length}"
        raise ValueError(
            f"`cache_size` must be at least {needed} for this model and length ({why}); got "
            f"{cache_size}. Leave it None for that size."
        )
    return int(cache_size)


def _cache_sharding(prompt_ids: Array) -> NamedSharding | None:
    """The cache's keys and values sharded as the prompt's batch is (`None`: an unsharded one)."""
    sharding = getattr(prompt_ids, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    batch_axes = sharding.spec[0] if len(sharding.spec) else None
    return sharding.update(spec=PartitionSpec(None, batch_axes))


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
    eos_token_id: int | Sequence[int] | None = None,
) -> Any:
    """Continues `prompt_ids` by `max_new_tokens` tokens.

    **Arguments:**

    - `model`: the [`Mistral`][] model (any family).
    - `prompt_ids`: prompts of equal length, shape `[batch, prompt]`.
    - `max_new_tokens`: how many tokens to add.
    - `key`: random key, needed when `temperature > 0`.
    - `temperature`: 0 for greedy decoding, else the softmax temperature.
    - `top_k`: sample only among the `top_k` most likely tokens.
    - `cache_size`: slots of the KV cache, a ring buffer; `None` (the default): the whole
        sequence (`prompt + max_new_tokens`), or the sliding window if every layer has one
        and it is shorter (older positions are overwritten, as the window never sees them). A
        larger size is allowed; a smaller one is refused, since it would overwrite keys a
        layer still attends to: a model with any full-attention layer (Qwen2's mixed
        `layer_types` included) needs the whole sequence, a sliding-window model its window.
    - `return_logits`: also return the logits each new token was chosen from.
    - `eos_token_id`: the ids that end a sequence; `None` means the checkpoint's
        (`model.config.stop_token_ids`: `generation_config.json`'s `eos_token_id`, else
        `config.json`'s, an id or a list); `()` never stops early.

    **Returns:**

    The token ids `[batch, prompt + new]`, and with `return_logits` the logits
    `[batch, new, vocab]`, where `new` is `max_new_tokens`, or fewer once every sequence has
    produced an end id. A sequence that ended before the others is padded with the first end
    id (as `transformers` pads with `eos_token_id[0]` when there is no pad token).
    """
    prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
    if prompt_ids.ndim != 2 or prompt_ids.shape[1] < 1:
        raise ValueError(f"`prompt_ids` must have shape [batch, prompt>0]; got {prompt_ids.shape}.")
    if not _is_count(max_new_tokens):
        raise ValueError(f"`max_new_tokens` must be a positive integer; got {max_new_tokens!r}.")
    if temperature > 0 and key is None:
        raise ValueError("`key` must be given when `temperature > 0` (sampling is random).")
    batch, prompt_length = prompt_ids.shape
    size = _cache_size(cache_size, model, prompt_length, max_new_tokens)
    cache = KVCache.empty(
        model.config, batch, size, model.dtype, out_sharding=_cache_sharding(prompt_ids)
    )
    params, static = eqx.partition(model, eqx.is_array)
    step = functools.partial(decode_step, static=static, temperature=temperature, top_k=top_k)

    if eos_token_id is None:
        stop = model.config.stop_token_ids
    else:
        stop = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    stop_array = jnp.asarray(stop, jnp.int32)
    done = jnp.zeros((batch,), bool)

    def finish(next_ids: Array) -> tuple[Array, bool]:
        """Pads the sequences that already ended; says whether all have now."""
        nonlocal done
        if not stop:
            return next_ids, False
        next_ids = jnp.where(done, stop[0], next_ids)
        done = done | jnp.isin(next_ids, stop_array)
        return next_ids, bool(np.all(np.asarray(done)))

    keys = [None] * max_new_tokens if key is None else list(jax.random.split(key, max_new_tokens))
    next_ids, last, cache = step(params, cache, prompt_ids, keys[0])
    next_ids, ended = finish(next_ids)
    new_ids, all_logits = [next_ids], [last]
    for step_key in keys[1:]:
        if ended:
            break
        next_ids, last, cache = step(params, cache, next_ids[:, None], step_key)
        next_ids, ended = finish(next_ids)
        new_ids.append(next_ids)
        all_logits.append(last)
    ids = jnp.concatenate([prompt_ids, jnp.stack(new_ids, axis=1)], axis=1)
    return (ids, jnp.stack(all_logits, axis=1)) if return_logits else ids
