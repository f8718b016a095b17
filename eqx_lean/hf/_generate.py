"""Text generation with a fixed-size KV cache: one prefill, then in-place decode steps in one
compiled loop whose program depends on a bucket of the sequence length, not on the length."""

import functools
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .. import _arguments as arguments
from ._model import Decoder, KVCache


_INT32_MAX = int(np.iinfo(np.int32).max)


def _sample(
    logits: Float[Array, "batch vocab"],
    key: PRNGKeyArray | None,
    temperature: Any,
    top_k: int | None,
    greedy: bool,
) -> Int[Array, " batch"]:
    """`sample` without its checks; `temperature` may be traced (it is only divided by)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    assert key is not None
    scaled = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth_largest = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        scaled = jnp.where(scaled < kth_largest, -jnp.inf, scaled)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def sample(
    logits: Float[Array, "batch vocab"],
    key: PRNGKeyArray | None,
    temperature: float = 0.0,
    top_k: int | None = None,
) -> Int[Array, " batch"]:
    """Picks the next token: greedy when `temperature == 0`, else sampled from the
    temperature-scaled distribution restricted to the `top_k` most likely tokens (all if None).

    **Arguments:**

    - `logits`: the last position's logits, `[batch, vocab]`.
    - `key`: a random key, needed when `temperature > 0`.
    - `temperature`: a finite number, at least 0.
    - `top_k`: `None`, or an integer from 1 to the vocabulary size.

    **Returns:**

    The chosen ids, `[batch]`, as `int32`.
    """
    vocab = int(np.shape(logits)[-1])
    temperature, top_k = _sampling(temperature, top_k, key, vocab)
    return _sample(logits, key, temperature, top_k, greedy=temperature == 0.0)


def _sampling(temperature: Any, top_k: Any, key: Any, vocab: int) -> tuple[float, int | None]:
    temperature = arguments.number(temperature, "`temperature`", minimum=0)
    top_k = arguments.optional_integer(top_k, "`top_k`", minimum=1, maximum=vocab)
    _check_key(key)
    if temperature > 0 and key is None:
        raise ValueError("`key` must be given when `temperature > 0` (sampling is random).")
    return temperature, top_k


def _check_key(key: Any) -> None:
    if key is None:
        return
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key) and shape == ()
    raw = dtype == np.uint32 and shape == (2,)
    if not (typed or raw):
        raise TypeError(
            "`key` must be None or one random key, such as `jax.random.key(0)`; got "
            f"{type(key).__name__} of shape {shape} and dtype {dtype}."
        )


def _step(
    params: Decoder,
    cache: KVCache,
    input_ids: Int[Array, "batch seq"],
    key: PRNGKeyArray | None,
    *,
    static: Decoder,
    temperature: float,
    top_k: int | None,
) -> tuple[Int[Array, " batch"], Float[Array, "batch vocab"], KVCache]:
    model = eqx.combine(params, static)
    logits, cache = model.step(input_ids, cache)
    last = logits[:, -1]
    return _sample(last, key, temperature, top_k, greedy=temperature == 0.0), last, cache


# The cache is donated, so each step updates it in place; the model and the user's token ids
# are never donated. Prefill and decode differ only in `seq`.
_decode_step = jax.jit(
    _step, static_argnames=("static", "temperature", "top_k"), donate_argnames=("cache",)
)


def decode_step(
    params: Decoder,
    cache: KVCache,
    input_ids: Int[ArrayLike, "batch seq"],
    key: PRNGKeyArray | None = None,
    *,
    static: Decoder,
    temperature: float = 0.0,
    top_k: int | None = None,
) -> tuple[Int[Array, " batch"], Float[Array, "batch vocab"], KVCache]:
    """Runs `input_ids` through the model after the positions `cache` holds (a prefill, or
    one decode step with `seq=1`) and picks the next token: the building block of a decode
    loop of one's own ([`generate`][] runs its own, compiled whole).

    The step is compiled once per shape of `input_ids`, cache size, `static`, `temperature`
    and `top_k`. `cache` is donated: it is updated in place and must not be used after the
    call; use the cache returned.

    The ids are checked first. Concrete ids (outside `jax.jit`) are read on the host, which
    waits for them to be computed; an id outside `[0, vocab)` raises a `ValueError` naming
    its row and position. Under `jit`, where the ids are traced, the check is compiled into
    the program with `equinox.error_if` and raises when the program runs.

    **Arguments:**

    - `params`: the model's arrays, `eqx.partition(model, eqx.is_array)[0]`.
    - `cache`: a [`KVCache`][] from [`KVCache.empty`][] or the previous step (donated).
    - `input_ids`: integer token ids, `[batch, seq]`, each in `[0, vocab)`.
    - `key`: a random key, needed when `temperature > 0`.
    - `static`: the rest of the model, `eqx.partition(model, eqx.is_array)[1]`.
    - `temperature`: 0 (the default) for the most likely token, else the softmax
        temperature (a finite number above 0).
    - `top_k`: sample only among the `top_k` most likely tokens (1 to the vocabulary size);
        `None`: among all.

    **Returns:**

    `(next_ids, logits, cache)`: the chosen ids `[batch]` (int32), the last position's logits
    `[batch, vocab]` in the model's dtype, and the updated cache.

    **Example:**

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from eqx_lean.hf import KVCache, DecoderConfig, decode_step, init

    model = init(DecoderConfig.tiny(), key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    cache = KVCache.empty(model.config, 1, 16, model.dtype)
    next_ids, logits, cache = decode_step(params, cache, jnp.array([[1, 2, 3]]), static=static)
    for _ in range(4):
        next_ids, logits, cache = decode_step(params, cache, next_ids[:, None], static=static)
    print(next_ids.shape, logits.shape)  # (1,) (1, 256)
    ```
    """
    if not isinstance(static, Decoder) or any(eqx.is_array(x) for x in jax.tree.leaves(static)):
        raise TypeError(
            "`static` must be the model's non-array part, `eqx.partition(model, "
            f"eqx.is_array)[1]`; got {type(static).__name__}."
        )
    if not isinstance(cache, KVCache):
        raise TypeError(f"`cache` must be a KVCache; got {type(cache).__name__}.")
    vocab = static.config.vocab_size
    temperature, top_k = _sampling(temperature, top_k, key, vocab)
    input_ids = _checked_ids(input_ids, "`input_ids`", vocab)
    return _decode_step(
        params, cache, input_ids, key, static=static, temperature=temperature, top_k=top_k
    )


def _checked_ids(ids: Any, what: str, vocab: int) -> Array:
    """`ids` as an int32 array `[batch, seq>0]`, every id in `[0, vocab)`: concrete ids are
    read on the host (the first bad one is named), traced ones checked by the program."""
    dtype = getattr(ids, "dtype", None)
    if dtype is None:
        ids = np.asarray(ids)
        dtype = ids.dtype
    if not jnp.issubdtype(dtype, jnp.integer):  # bools are not integers here either
        raise TypeError(f"{what} must hold integer token ids; got an array of {dtype}.")
    shape = tuple(np.shape(ids))
    if len(shape) != 2 or shape[1] < 1 or shape[0] < 1:
        raise ValueError(f"{what} must have shape [batch>0, seq>0]; got {shape}.")
    if isinstance(ids, Tracer):
        bad = (ids < 0) | (ids >= vocab)
        message = f"{what} must hold token ids in [0, {vocab}) (the vocabulary size is {vocab})"
        return eqx.error_if(jnp.asarray(ids, jnp.int32), bad, message)
    found = _first_out_of_range(ids, vocab)
    if found is not None:
        (row, position), value = found
        raise ValueError(
            f"{what} must hold token ids in [0, {vocab}) (the vocabulary size is {vocab}); "
            f"row {row}, position {position} holds {value}."
        )
    if isinstance(ids, jax.Array):
        return ids if ids.dtype == jnp.int32 else ids.astype(jnp.int32)
    return jax.device_put(np.asarray(ids, np.int32))  # `jnp.asarray` would compile a copy


def _first_out_of_range(ids: Any, vocab: int) -> tuple[tuple[int, int], int] | None:
    """The first `(row, position)` holding an id outside `[0, vocab)`, with the id, read on
    the host shard by shard (a global array of several processes included)."""
    if isinstance(ids, jax.Array) and not ids.is_fully_addressable:
        pieces = [(shard.index, np.asarray(shard.data)) for shard in ids.addressable_shards]
    else:
        pieces = [((), np.asarray(ids))]
    for index, host in pieces:
        bad = (host < 0) | (host >= vocab)
        if bad.any():
            local = tuple(int(i) for i in np.argwhere(bad)[0])
            starts = [(s.start or 0) for s in index] + [0] * (2 - len(index))
            row, position = (local[0] + starts[0], local[1] + starts[1])
            return (row, position), int(host[local])
    return None


def default_cache_size(model: Decoder, total_length: int) -> int:
    """Slots needed for `total_length` positions: the window, if every layer has one smaller."""
    window = model.config.max_window
    return total_length if window is None else min(window, total_length)


def length_bucket(length: int) -> int:
    """The sequence length `generate` compiles for when `length` positions are asked for: the
    next power of two, at least 64, up to 1024; beyond 1024, the next multiple of 1024."""
    if length <= 1024:
        return max(64, 1 << (length - 1).bit_length())
    return -(-length // 1024) * 1024


def _cache_size(cache_size: Any, model: Decoder, prompt_length: int, max_new_tokens: int) -> int:
    """`cache_size`, checked: the cache is a ring buffer, so one smaller than the positions
    some layer still attends to would overwrite keys that layer reads (other logits, no error).
    `None`: the size for the length's bucket (`length_bucket`).
    """
    total = prompt_length + max_new_tokens
    needed = default_cache_size(model, total)
    cache_size = arguments.optional_integer(cache_size, "`cache_size`", minimum=1)
    if cache_size is None:
        return default_cache_size(model, length_bucket(total))
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
    return cache_size


def _cache_sharding(prompt_ids: Array) -> NamedSharding | None:
    """The cache's keys and values sharded as the prompt's batch is (`None`: an unsharded one)."""
    sharding = getattr(prompt_ids, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    batch_axes = sharding.spec[0] if len(sharding.spec) else None
    return sharding.update(spec=PartitionSpec(None, batch_axes))


def _stop_ids(eos_token_id: Any, model: Decoder) -> tuple[int, ...]:
    """The ids generation ends at, each checked to be a token of the vocabulary."""
    vocab = model.config.vocab_size
    if eos_token_id is None:
        stop, where = model.config.stop_token_ids, "`model.config.stop_token_ids`"
    elif isinstance(eos_token_id, str | bytes | bool | np.bool_) or not isinstance(
        eos_token_id, int | np.integer | Sequence | np.ndarray | jax.Array
    ):
        raise TypeError(
            "`eos_token_id` must be None, a token id or a sequence of token ids; got "
            f"{eos_token_id!r} ({type(eos_token_id).__name__})."
        )
    elif isinstance(eos_token_id, int | np.integer):
        stop, where = (eos_token_id,), "`eos_token_id`"
    else:
        if not isinstance(eos_token_id, Sequence):  # an array of ids
            eos_token_id = np.asarray(eos_token_id).reshape(-1).tolist()
        stop, where = tuple(eos_token_id), "`eos_token_id`"
    name = f"{where} (a token of the {vocab}-token vocabulary)"
    if len(stop) > 1:
        name = f"each id of {name}"
    return tuple(arguments.integer(s, name, minimum=0, maximum=vocab - 1) for s in stop)


@functools.partial(
    jax.jit,
    static_argnames=("static", "new_slots", "top_k", "greedy"),
    donate_argnames=("cache",),
)
def _generate_loop(
    params: Decoder,
    cache: KVCache,
    prompt_ids: Int[Array, "batch prompt"],
    key: PRNGKeyArray | None,
    temperature: Any,
    stop_ids: Int[Array, " stops"],
    max_new_tokens: Any,
    *,
    static: Decoder,
    new_slots: int,
    top_k: int | None,
    greedy: bool,
) -> tuple[Int[Array, "batch total"], Float[Array, "batch new vocab"], Int[Array, ""], KVCache]:
    """Prefill, then decode steps in a `while_loop` until `max_new_tokens` (traced) or every
    sequence has ended: the program depends on `new_slots` (the bucket), not on the count.
    The cache is donated and returned, so that its one buffer is updated in place."""
    model = eqx.combine(params, static)
    prompt_length = prompt_ids.shape[1]
    keys = None if key is None else jax.random.split(key, new_slots)  # keys[i] for step i
    stops = stop_ids.shape[0] > 0

    def choose(last: Array, i: Any, done: Array) -> tuple[Array, Array]:
        next_ids = _sample(last, None if keys is None else keys[i], temperature, top_k, greedy)
        if stops:  # pad the sequences that already ended with the first end id
            next_ids = jnp.where(done, stop_ids[0], next_ids)
            done = done | jnp.any(next_ids[:, None] == stop_ids[None, :], axis=-1)
        return next_ids, done

    def put(ids: Array, logits: Array, next_ids: Array, last: Array, i: Any) -> tuple[Array, Array]:
        ids = jax.lax.dynamic_update_slice_in_dim(ids, next_ids[:, None], prompt_length + i, 1)
        logits = jax.lax.dynamic_update_slice_in_dim(logits, last[:, None], i, 1)
        return ids, logits

    step_logits, cache = model.step(prompt_ids, cache)
    last = step_logits[:, -1]
    next_ids, done = choose(last, 0, jnp.zeros(prompt_ids.shape[:1], bool))
    # Buffers made from the prompt and the logits, so that they are sharded as those are.
    ids = jnp.pad(prompt_ids, ((0, 0), (0, new_slots)))
    logits = jnp.broadcast_to(
        jnp.zeros_like(last)[:, None], (last.shape[0], new_slots, last.shape[1])
    )
    ids, logits = put(ids, logits, next_ids, last, 0)

    def more(state: tuple) -> Array:
        i, _, done, *_ = state
        return (i < max_new_tokens) & ~jnp.all(done) if stops else i < max_new_tokens

    def body(state: tuple) -> tuple:
        i, next_ids, done, cache, ids, logits = state
        step_logits, cache = model.step(next_ids[:, None], cache)
        last = step_logits[:, -1]
        next_ids, done = choose(last, i, done)
        ids, logits = put(ids, logits, next_ids, last, i)
        return i + 1, next_ids, done, cache, ids, logits

    state = (jnp.asarray(1, jnp.int32), next_ids, done, cache, ids, logits)
    count, _, _, cache, ids, logits = jax.lax.while_loop(more, body, state)
    return ids, logits, count, cache


def _first(array: Array, axis: int, length: int) -> Array:
    """The first `length` entries of `array` along `axis`, through the host where the array is
    this process's alone (a device slice would compile one program per length)."""
    if not array.is_fully_addressable:
        return jax.lax.slice_in_dim(array, 0, length, axis=axis)
    host = np.asarray(array)[(slice(None),) * axis + (slice(0, length),)]
    return jax.device_put(host, array.sharding)


def generate(
    model: Decoder,
    prompt_ids: Int[ArrayLike, "batch prompt"],
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

    The prefill and every decode step run as one compiled program, whose loop stops after
    `max_new_tokens` steps or once every sequence has ended. The program depends on the batch,
    the prompt length and a **bucket** of the sequence length `prompt + max_new_tokens`, not
    on `max_new_tokens` itself: the next power of two of at least 64 up to 1024 (64, 128, 256,
    512, 1024), then the next multiple of 1024 (2048, 3072, ...). Another `max_new_tokens` in
    the same bucket compiles nothing; so do other stop ids (of the same count) and another
    `temperature > 0`. A new `top_k`, a switch between greedy and sampled decoding, or a new
    `cache_size` compiles again.

    Every argument is checked before any work: the token ids (read on the host: an id outside
    `[0, vocab)` is refused, naming its row and position), the counts, `temperature`, `top_k`
    and the stop ids. `generate` is not traceable (it reads the number of tokens made on the
    host): call it outside `jax.jit`, or write a loop of [`decode_step`][] under `jit`.

    **Arguments:**

    - `model`: the [`Decoder`][] model (any family).
    - `prompt_ids`: integer token ids of prompts of equal length, shape `[batch, prompt]`,
        each in `[0, vocab)`.
    - `max_new_tokens`: how many tokens to add, a positive integer.
    - `key`: random key, needed when `temperature > 0`.
    - `temperature`: 0 for greedy decoding, else the softmax temperature (finite, above 0).
    - `top_k`: sample only among the `top_k` most likely tokens (1 to the vocabulary size).
    - `cache_size`: slots of the KV cache, a ring buffer; `None` (the default): the length's
        bucket (above), or the sliding window if every layer has one and it is shorter (older
        positions are overwritten, as the window never sees them). A size of at least
        `prompt + max_new_tokens` (or the window) is allowed; a smaller one is refused, since
        it would overwrite keys a layer still attends to: a model with any full-attention
        layer (mixed `layer_types`, as Qwen2's or Gemma's, included) needs the whole sequence, a
        sliding-window model its window.
    - `return_logits`: also return the logits each new token was chosen from (the program
        then holds `[batch, bucket - prompt, vocab]` of them, in the model's dtype).
    - `eos_token_id`: the ids that end a sequence, each in `[0, vocab)`; `None` means the
        checkpoint's (`model.config.stop_token_ids`: `generation_config.json`'s
        `eos_token_id`, else `config.json`'s, an id or a list); `()` never stops early.

    **Returns:**

    The token ids `[batch, prompt + new]`, and with `return_logits` the logits
    `[batch, new, vocab]`, where `new` is `max_new_tokens`, or fewer once every sequence has
    produced an end id. A sequence that ended before the others is padded with the first end
    id (as `transformers` pads with `eos_token_id[0]` when there is no pad token). Both are
    cut to `new` on the host and placed as the program left them (the prompt's sharding).
    """
    if not isinstance(model, Decoder):
        raise TypeError(f"`model` must be a Mistral (a Decoder); got {type(model).__name__}.")
    if isinstance(prompt_ids, Tracer):
        raise TypeError(
            "`generate` cannot run under `jax.jit` or another transformation: it runs a "
            "compiled loop of its own and cuts its result on the host. Call it outside, or "
            "write a loop of `decode_step` under `jit`."
        )
    vocab = model.config.vocab_size
    max_new_tokens = arguments.integer(max_new_tokens, "`max_new_tokens`", minimum=1)
    temperature, top_k = _sampling(temperature, top_k, key, vocab)
    return_logits = arguments.boolean(return_logits, "`return_logits`")
    prompt_ids = _checked_ids(prompt_ids, "`prompt_ids`", vocab)
    stop = _stop_ids(eos_token_id, model)
    batch, prompt_length = prompt_ids.shape
    if prompt_length + max_new_tokens > _INT32_MAX:
        raise ValueError(
            f"`max_new_tokens` must leave the sequence at most {_INT32_MAX} positions (int32); "
            f"got {max_new_tokens} after a prompt of {prompt_length}."
        )
    size = _cache_size(cache_size, model, prompt_length, max_new_tokens)
    new_slots = length_bucket(prompt_length + max_new_tokens) - prompt_length
    # Made here, where JAX places it as asked (an Explicit mesh's sharding type included).
    cache = KVCache.empty(
        model.config, batch, size, model.dtype, out_sharding=_cache_sharding(prompt_ids)
    )
    params, static = eqx.partition(model, eqx.is_array)
    ids, logits, count, _ = _generate_loop(
        params,
        cache,
        prompt_ids,
        key,
        temperature,
        np.asarray(stop, np.int32),
        max_new_tokens,
        static=static,
        new_slots=new_slots,
        top_k=top_k,
        greedy=temperature == 0.0,
    )
    count = int(count)
    ids = _first(ids, 1, prompt_length + count)
    return (ids, _first(logits, 1, count)) if return_logits else ids
