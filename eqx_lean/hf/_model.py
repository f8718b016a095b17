"""The decoder of every family `eqx_lean.hf` reads, in Equinox, its blocks stacked on a leading
layer axis.

One block, assembled from the config's options rather than per family: RMSNorm as `w` or
Gemma's `1 + w`, pre-norms and (Gemma 2/3) post-norms, q/k norms (Qwen3, Gemma 3), a SiLU or
tanh-GELU gated MLP, the attention's query scale and soft cap; around the blocks, Gemma's
embedding scale and final-logit soft cap, and per-layer windows and rotary embeddings.

Numerics follow HuggingFace `transformers` (`MistralForCausalLM`, `LlamaForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Gemma2ForCausalLM`, `Gemma3ForCausalLM`, eager
attention) so that logits agree to float32 rounding: RMSNorm in float32, rotary embeddings in
HF's `rotate_half` layout, softmax in float32, a sliding window in which a query sees
`sliding_window` keys including itself, per layer where the layers differ (`layer_types`).

Attention over a whole sequence (training, a model's call, `hidden_states`) is
[`eqx_lean.nn.attention`][] by default: blockwise, never holding `[heads, seq, seq]` scores;
`attention="eager"` computes HF's eager attention instead (every score, softmax in float32),
the reference the blockwise path is tested against. Decoding with a [`KVCache`][] always takes
the eager path over the cache.
"""

import dataclasses
import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_lean

from .. import _arguments as arguments, _platform
from .._core.sharding import explicit_type_sharding, like_last_axis, resharded_like
from .._product import linear_product
from ..nn import attention as blockwise_attention, positionwise
from ..nn._positionwise import chunk_positions
from ._config import DecoderConfig
from ._rope import (
    apply_rotary,
    attention_mask as attention_mask,
    rotary_cos_sin as rotary_cos_sin,
)


def _project(
    linear: Any, x: Float[Array, "... in"], key: PRNGKeyArray | None = None
) -> Float[Array, "... out"]:
    """Applies a projection: an `eqx.nn.Linear` (its bias added, if it has one), or any module
    with a `project(x, key=...)` method, such as a LoRA-adapted linear (`lora.LoraLinear`)."""
    if isinstance(linear, eqx.nn.Linear):
        # `eqx.nn.Linear` maps one vector; an einsum maps any leading axes, like torch's Linear.
        out = linear_product(x, linear.weight)
        if linear.bias is not None:
            bias = like_last_axis(linear.bias, out)
            out = out + bias.astype(out.dtype).reshape((1,) * (out.ndim - 1) + (-1,))
        return out
    return linear.project(x, key=key)


def embed(
    weight: Float[Array, "vocab hidden"], input_ids: Int[Array, "*batch"]
) -> Float[Array, "*batch hidden"]:
    """The rows of `weight` for `input_ids`, sharded as the ids are (the hidden axis whole).

    With Explicit mesh axes JAX cannot choose where a lookup of sharded rows by sharded ids
    lands, and asks for `out_sharding=`; with Auto axes, or none, XLA chooses, as for
    `weight[input_ids]`.
    """
    ids_sharding = explicit_type_sharding(input_ids)
    if ids_sharding is None:
        return weight[input_ids]
    spec = _padded_spec(ids_sharding.spec, input_ids.ndim) + (None,)
    return weight.at[input_ids].get(out_sharding=ids_sharding.update(spec=PartitionSpec(*spec)))


def _padded_spec(spec: PartitionSpec, ndim: int) -> tuple[Any, ...]:
    """`spec`'s entries, one per dimension of an `ndim`-dimensional array."""
    return tuple(spec) + (None,) * (ndim - len(spec))


class RMSNorm(eqx.Module):
    """Root-mean-square normalisation with HuggingFace's numerics.

    The statistics are computed in float32. Llama's style (`unit_offset=False`) casts the
    normalised values back to the input dtype before the weight multiplies them; Gemma's
    (`unit_offset=True`) multiplies by `1 + weight` in float32 and then casts.

    Differentiated, it keeps only its input and its weight for the backward pass, which
    recomputes the rest (`jax.checkpoint`; an elementwise pass): its own residuals would
    include each position's inverse root broadcast over the hidden axis, a float32 array the
    size of the input that XLA:CPU holds until the layer's backward pass reaches the norm.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)
    unit_offset: bool = eqx.field(static=True, default=False)

    def __call__(self, x: Float[Array, "... dim"]) -> Float[Array, "... dim"]:
        norm = functools.partial(_normalised, eps=self.eps, unit_offset=self.unit_offset)
        return jax.checkpoint(norm, prevent_cse=False)(self.weight, x)


def _normalised(
    weight: Float[Array, " dim"], x: Float[Array, "... dim"], *, eps: float, unit_offset: bool
) -> Float[Array, "... dim"]:
    """`RMSNorm`'s computation (see there), which `RMSNorm` checkpoints."""
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    if unit_offset:
        weight32 = like_last_axis(weight, x).astype(jnp.float32)
        return (normed * (1.0 + weight32.reshape((1,) * (x.ndim - 1) + (-1,)))).astype(x.dtype)
    out_dtype = jnp.promote_types(weight.dtype, x.dtype)
    weight = like_last_axis(weight, x).astype(out_dtype).reshape((1,) * (x.ndim - 1) + (-1,))
    return weight * normed.astype(x.dtype).astype(out_dtype)


def _split_key(key: PRNGKeyArray | None, num: int) -> list[PRNGKeyArray | None]:
    """`num` keys from `key`, or `num` Nones (no randomness: inference)."""
    return [None] * num if key is None else list(jax.random.split(key, num))


KV = tuple[Float[Array, "batch seq kv_heads head_dim"], Float[Array, "batch seq kv_heads head_dim"]]

ATTENTION_KINDS = ("blockwise", "eager")


def _check_packed(input_ids: Any, segment_ids: Any, positions: Any) -> None:
    """Packed rows give both `segment_ids` and `positions`, integers shaped as `input_ids`."""
    if (segment_ids is None) != (positions is None):
        raise ValueError(
            "`segment_ids` and `positions` must be given together (packed rows: each token's "
            "document and its position in it) or not at all."
        )
    for name, value in (("segment_ids", segment_ids), ("positions", positions)):
        if value is None:
            continue
        if tuple(value.shape) != tuple(input_ids.shape) or not jnp.issubdtype(
            value.dtype, jnp.integer
        ):
            raise ValueError(
                f"`{name}` must be integers of `input_ids`' shape {tuple(input_ids.shape)}; got "
                f"{value.dtype}{list(value.shape)}."
            )


def check_attention(attention: Any) -> str:
    """`attention` if it names a kind the decoder computes; a `ValueError` otherwise."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f'`attention` must be "blockwise" or "eager"; got {attention!r}.')
    return attention


class Attention(eqx.Module):
    """Grouped-query self-attention with rotary embeddings (HF eager-attention numerics).

    `q_norm` and `k_norm` (Qwen3, Gemma 3), when not `None`, normalise each head of the
    queries and keys before they are rotated; `scale` multiplies the scores (`None`:
    `head_dim ** -0.5`), `soft_cap` caps them (`tanh(s / cap) * cap`, Gemma 2) before the mask.
    """

    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None
    scale: float | None = eqx.field(static=True, default=None)
    soft_cap: float | None = eqx.field(static=True, default=None)

    def __call__(
        self,
        x: Float[Array, "batch seq hidden"],
        rotary: tuple[Float[Array, "seq head_dim"], Float[Array, "seq head_dim"]],
        positions: Int[Array, " seq"],
        past: KV | None = None,
        past_positions: Int[Array, " past"] | None = None,
        *,
        window: int | Int[Array, ""] | None = None,
        key: PRNGKeyArray | None = None,
        attention: str = "blockwise",
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq hidden"], KV]:
        """Attends from `x` to itself and to `past` (keys and values already rotated).

        `window` is this layer's sliding window (`None`: full causal attention). `key`, when
        given, is split between the four projections (for LoRA dropout). `attention` is
        `"blockwise"` ([`eqx_lean.nn.attention`][], used where there is no `past`) or
        `"eager"` (every score held, HF's eager numerics: the reference). `segment_ids`
        (packed rows, no `past`): a query sees only the keys of its own document.

        **Returns:**

        The attention output and this call's new (rotated) keys and values.
        """
        batch, seq, _ = x.shape
        groups = self.num_heads // self.num_kv_heads
        cos, sin = rotary
        q_key, k_key, v_key, o_key = _split_key(key, 4)
        q = _project(self.q_proj, x, q_key).reshape(batch, seq, self.num_heads, self.head_dim)
        k = _project(self.k_proj, x, k_key).reshape(batch, seq, self.num_kv_heads, self.head_dim)
        v = _project(self.v_proj, x, v_key).reshape(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        scale = self.head_dim**-0.5 if self.scale is None else self.scale

        if past is None and attention == "blockwise":
            # `positions` run from 0 without gaps here (a call over the whole sequence), so
            # the causal mask and the window are those of the sequence's indices.
            out = blockwise_attention(
                q,
                k,
                v,
                causal=True,
                window=window,
                segment_ids=segment_ids,
                scale=scale,
                logit_soft_cap=self.soft_cap,
            )
            out = out.reshape(batch, seq, self.num_heads * self.head_dim)
            return _project(self.o_proj, out, o_key), (k, v)

        keys, values, key_positions = k, v, positions
        if past is not None:
            assert past_positions is not None
            # A cache placed otherwise than the batch (an unsharded cache, a sharded prompt)
            # follows the new keys: with Explicit mesh axes JAX concatenates only arrays of one
            # sharding.
            past = (resharded_like(past[0], k), resharded_like(past[1], v))
            keys = jnp.concatenate([past[0], k], axis=1)
            values = jnp.concatenate([past[1], v], axis=1)
            key_positions = jnp.concatenate([past_positions, positions])

        # Query head h reads key/value head h // groups, as HF's `repeat_kv` arranges them.
        q = q.reshape(batch, seq, self.num_kv_heads, groups, self.head_dim)
        scores = jnp.einsum("btgrd,bsgd->bgrts", q, keys) * scale
        if self.soft_cap is not None:
            scores = jnp.tanh(scores / self.soft_cap) * self.soft_cap
        mask = attention_mask(positions, key_positions, window)[None]
        if segment_ids is not None:
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
        out = jnp.einsum("bgrts,bsgd->btgrd", weights, values)
        out = out.reshape(batch, seq, self.num_heads * self.head_dim)
        return _project(self.o_proj, out, o_key), (k, v)


class MLP(eqx.Module):
    """The gated feed-forward block: `down(act(gate(x)) * up(x))`, `act` SiLU (SwiGLU) or, with
    `activation="gelu_pytorch_tanh"`, GELU's tanh approximation (Gemma's GeGLU)."""

    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear
    activation: str = eqx.field(static=True, default="silu")

    def __call__(
        self,
        x: Float[Array, "... hidden"],
        *,
        key: PRNGKeyArray | None = None,
        chunk: int | None = None,
    ) -> Float[Array, "... hidden"]:
        """The block on `x`; with `chunk`, `x` (`[batch, seq, hidden]`) is taken `chunk`
        positions at a time ([`eqx_lean.nn.positionwise`][]), so that the `[tokens,
        intermediate]` activations are those of one chunk (LoRA dropout then draws per chunk)."""
        if chunk is not None and x.ndim == 3 and x.shape[1] > chunk:
            return positionwise(self._whole, x, chunk=chunk, key=key)
        return self._whole(x, key=key)

    def _whole(
        self, x: Float[Array, "... hidden"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... hidden"]:
        gate_key, up_key, down_key = _split_key(key, 3)
        gate = _project(self.gate_proj, x, gate_key)
        if self.activation == "silu":
            gate = jax.nn.silu(gate)
        else:
            gate = jax.nn.gelu(gate, approximate=True)
        return _project(self.down_proj, gate * _project(self.up_proj, x, up_key), down_key)


LAYER_INPUT = "decoder_layer_input"
"""The name (`jax.ad_checkpoint.checkpoint_name`) of the hidden states entering each decoder
layer: the carry of the decoder's scan over its layers. A name-based checkpoint policy given as
`remat=` selects it, such as `jax.checkpoint_policies.save_only_these_names(LAYER_INPUT)` or
`save_and_offload_only_these_names(names_which_can_be_offloaded=[LAYER_INPUT], ...)` (MaxText's
name for the same tensor)."""


class DecoderBlock(eqx.Module):
    """One decoder layer: attention then MLP, each with a residual connection.

    Without post-norms (`pre_feedforward_layernorm` is `None`) it is the pre-norm layer of
    Llama: `x + attn(input_layernorm(x))`, then `x + mlp(post_attention_layernorm(x))`. With
    them (Gemma 2 and 3, whose names these are), each branch is normalised on both sides:
    `x + post_attention_layernorm(attn(input_layernorm(x)))`, then
    `x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`.

    Its input is named [`LAYER_INPUT`][eqx_lean.hf.LAYER_INPUT] for checkpoint policies.
    """

    input_layernorm: RMSNorm
    self_attn: Attention
    post_attention_layernorm: RMSNorm
    mlp: MLP
    pre_feedforward_layernorm: RMSNorm | None = None
    post_feedforward_layernorm: RMSNorm | None = None

    def __call__(
        self,
        x: Float[Array, "batch seq hidden"],
        rotary: tuple[Float[Array, "seq head_dim"], Float[Array, "seq head_dim"]],
        positions: Int[Array, " seq"],
        past: KV | None = None,
        past_positions: Int[Array, " past"] | None = None,
        *,
        window: int | Int[Array, ""] | None = None,
        key: PRNGKeyArray | None = None,
        attention: str = "blockwise",
        segment_ids: Int[Array, "batch seq"] | None = None,
        mlp_chunk: int | None = None,
    ) -> tuple[Float[Array, "batch seq hidden"], KV]:
        """One layer on `x`; `window` is its sliding window (`None`: full attention),
        `attention` and `segment_ids` as for its `self_attn` (`Attention`), `mlp_chunk` the
        positions per chunk of its MLP (`None`: the whole sequence at once)."""
        x = checkpoint_name(x, LAYER_INPUT)
        attn_key, mlp_key = _split_key(key, 2)
        attended, kv = self.self_attn(
            self.input_layernorm(x),
            rotary,
            positions,
            past,
            past_positions,
            window=window,
            key=attn_key,
            attention=attention,
            segment_ids=segment_ids,
        )
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + attended
            return x + self.mlp(self.post_attention_layernorm(x), key=mlp_key, chunk=mlp_chunk), kv
        x = x + self.post_attention_layernorm(attended)
        out = self.mlp(self.pre_feedforward_layernorm(x), key=mlp_key, chunk=mlp_chunk)
        return x + self.post_feedforward_layernorm(out), kv


MLP_CHUNK_BYTES = _platform.MLP_CHUNK_BYTES
"""The most bytes of one chunk's widest MLP activation (`[batch, chunk, intermediate]`) when a
decoder call's `mlp_chunk_bytes` is `None`, on GPUs and TPUs: 256 MiB. Planned for one H100
(`docs/benchmarks.md`, issue 44): at 131,072 tokens of an 8B Llama, chunks of 8,192 positions
bring the step from 63.11 GiB to 50.48. On CPUs the default is 8 MiB (measured: a 1B
bfloat16 LoRA step at 1 x 8,192 tokens plans 1.55 GiB of XLA:CPU temporaries, 1.84 with 32 MiB
chunks, 2.97 with one chunk; at 1 x 2,048 it runs no slower)."""


def _mlp_chunk(config: DecoderConfig, x: Array, chunk_bytes: int | None) -> int | None:
    """The positions per chunk of each layer's MLP on `x` (`[batch, seq, hidden]`), keeping
    `[batch, chunk, intermediate]` within `chunk_bytes` (`None`: the platform's, that of `x`'s
    devices where it is placed, else the one traced for); `None` where the whole sequence
    does."""
    chunk_bytes = arguments.optional_integer(chunk_bytes, "`mlp_chunk_bytes`", minimum=1)
    if chunk_bytes is None:
        chunk_bytes = _platform.tricks_of(x).mlp_chunk_bytes
    batch, seq = x.shape[0], x.shape[1]
    per_position = batch * config.intermediate_size * x.dtype.itemsize
    if seq * per_position <= chunk_bytes:
        return None
    return chunk_positions(seq, per_position, chunk_bytes)


def _rotary(
    config: DecoderConfig,
    positions: Int[Array, " seq"],
    row_positions: Int[Array, "batch seq"] | None,
    dtype: Any,
    theta: float,
    *,
    local: bool = False,
) -> tuple[Float[Array, "*rows seq head_dim"], Float[Array, "*rows seq head_dim"]]:
    """The rotary tables of a call: `[seq, head_dim]`, or one per row for packed rows (each
    token rotated by its position in its document). `local`: Gemma 3's local rope (the default
    one at `theta`), else `config.rope_scaling` at `theta`."""
    rotated = positions if row_positions is None else row_positions.reshape(-1)
    scaling = None if local else config.rope_scaling
    cos, sin = rotary_cos_sin(rotated, config.resolved_head_dim, theta, dtype, scaling)
    if row_positions is not None:
        cos, sin = cos.reshape(*row_positions.shape, -1), sin.reshape(*row_positions.shape, -1)
    return cos, sin


_INT32_MAX = 2**31 - 1
# No device holds a cache this large (256 TiB): a size that asks for one is a mistake, refused
# with its arithmetic rather than failing in the allocator.
_MAX_CACHE_BYTES = 2**48


class KVCache(eqx.Module):
    """A fixed-size key/value cache for every layer, used as a ring buffer.

    Position `p` lives in slot `p % size`; `slot_positions` records which position each slot
    holds (-1 while empty), so the attention mask (causal and sliding-window) is computed from
    absolute positions and a cache of `sliding_window` slots serves any sequence length.
    """

    keys: Float[Array, "layers batch size kv_heads head_dim"]
    values: Float[Array, "layers batch size kv_heads head_dim"]
    slot_positions: Int[Array, " size"]
    next_position: Int[Array, ""]

    @classmethod
    def empty(
        cls,
        config: DecoderConfig,
        batch_size: int,
        size: int,
        dtype: Any,
        *,
        out_sharding: NamedSharding | None = None,
    ) -> "KVCache":
        """An empty cache of `size` slots per layer and sequence.

        **Arguments:**

        - `config`: the model's config (its layers, key/value heads and head size).
        - `batch_size`: the sequences the cache holds, a positive integer.
        - `size`: the slots per layer and sequence, a positive integer (positions are int32,
            so at most `2**31 - 1`, and the whole cache under `2**48` bytes).
        - `dtype`: the keys' and values' dtype (the model's).
        - `out_sharding`: as for `jnp.zeros`: where the keys and values
            (`[layers, batch, size, kv_heads, head_dim]`) are placed, such as
            `NamedSharding(mesh, P(None, "data"))` for a batch sharded over "data" (what
            [`generate`][eqx_lean.hf.generate] gives a sharded prompt); the slot positions
            are then replicated on its mesh. `None` places the cache as `jnp.zeros` does.

        **Returns:**

        The empty [`KVCache`][].
        """
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"`config` must be a DecoderConfig; got {type(config).__name__}.")
        batch_size = arguments.integer(batch_size, "`batch_size`", minimum=1)
        # Slot positions are int32, and a cache holds every slot of every layer at once.
        size = arguments.integer(size, "`size`", minimum=1, maximum=_INT32_MAX)
        per_slot = (
            2
            * config.num_hidden_layers
            * batch_size
            * config.num_key_value_heads
            * config.resolved_head_dim
            * jnp.dtype(dtype).itemsize
        )
        if size * per_slot > _MAX_CACHE_BYTES:
            raise ValueError(
                f"`size` must keep the cache's keys and values under {_MAX_CACHE_BYTES} bytes "
                f"(2**48); got {size} slots of {per_slot} bytes each (both, every layer, the "
                f"whole batch): {size * per_slot} bytes."
            )
        shape = (
            config.num_hidden_layers,
            batch_size,
            size,
            config.num_key_value_heads,
            config.resolved_head_dim,
        )
        replicated = None if out_sharding is None else out_sharding.update(spec=PartitionSpec())
        return cls(
            keys=jnp.zeros(shape, dtype, device=out_sharding),
            values=jnp.zeros(shape, dtype, device=out_sharding),
            slot_positions=jnp.full((size,), -1, jnp.int32, device=replicated),
            next_position=jnp.zeros((), jnp.int32, device=replicated),
        )

    @property
    def size(self) -> int:
        return self.slot_positions.shape[0]

    def write(self, new_keys: Array, new_values: Array, positions: Int[Array, " seq"]) -> "KVCache":
        """Stores the new entries `[layers, batch, seq, ...]` for `positions` into their slots."""
        keep = min(positions.shape[0], self.size)  # older entries would be overwritten anyway
        positions = positions[-keep:]
        slots = positions % self.size
        # With Explicit mesh axes JAX asks where a scatter into a sharded batch lands: where
        # the cache already is.
        return KVCache(
            keys=self.keys.at[:, :, slots].set(
                new_keys[:, :, -keep:], out_sharding=explicit_type_sharding(self.keys)
            ),
            values=self.values.at[:, :, slots].set(
                new_values[:, :, -keep:], out_sharding=explicit_type_sharding(self.values)
            ),
            slot_positions=self.slot_positions.at[slots].set(positions),
            next_position=positions[-1] + 1,
        )


class Decoder(eqx.Module):
    """A decoder of any family `eqx_lean.hf` reads: token embedding,
    stacked decoder blocks, final RMSNorm, LM head.

    `layers` is a single [`DecoderBlock`][] whose array leaves carry a leading layer axis (as
    built by [`eqx_lean.build_stacked`][]). `lm_head` is `None` when the config ties the head
    to the embedding (`tie_word_embeddings`): the embedding matrix is then the head. Call the
    model on `input_ids` of shape `[batch, seq]` for logits `[batch, seq, vocab]`; use
    [`Decoder.step`][] with a [`KVCache`][] for incremental decoding.
    """

    embed_tokens: eqx.nn.Embedding
    layers: DecoderBlock
    norm: RMSNorm
    lm_head: eqx.nn.Linear | None
    config: DecoderConfig = eqx.field(static=True)

    @property
    def dtype(self) -> Any:
        return self.embed_tokens.weight.dtype

    def _logits(
        self,
        input_ids: Int[Array, "batch seq"],
        positions: Int[Array, " seq"],
        past: KV | None,
        past_positions: Int[Array, " past"] | None,
        *,
        remat: bool | None = None,
        key: PRNGKeyArray | None = None,
        final_hidden: bool = False,
        attention: str = "blockwise",
        segment_ids: Int[Array, "batch seq"] | None = None,
        row_positions: Int[Array, "batch seq"] | None = None,
        mlp_chunk_bytes: int | None = None,
    ) -> tuple[Float[Array, "batch seq vocab"], KV | None]:
        if input_ids.ndim != 2:
            raise ValueError(f"`input_ids` must have shape [batch, seq]; got {input_ids.shape}.")
        x = embed(self.embed_tokens.weight, input_ids)
        config = self.config
        if config.scale_embeddings:
            # Gemma: times sqrt(hidden), rounded to the model's dtype first, as transformers.
            x = x * jnp.asarray(config.hidden_size**0.5, x.dtype)
        mlp_chunk = _mlp_chunk(config, x, mlp_chunk_bytes)
        rotary = _rotary(config, positions, row_positions, x.dtype, config.rope_theta)
        # Gemma 3's sliding layers rotate with their own base: both tables, chosen per layer.
        local = config.local_rope_layers
        local_rotary, layer_local = None, None
        if local is not None:
            assert config.rope_local_base_freq is not None
            local_rotary = _rotary(
                config, positions, row_positions, x.dtype, config.rope_local_base_freq, local=True
            )
            layer_local = jnp.asarray(local, jnp.bool_)
        keep_kv = past is not None
        # One key per layer, sliced by the scan like the cache.
        layer_keys = None if key is None else jax.random.split(key, config.num_hidden_layers)
        # Layers with one window share it statically; different windows (Qwen2's
        # `layer_types`) are one int32 per layer, sliced by the scan (full attention: int32 max).
        windows = config.layer_windows
        uniform = all(w == windows[0] for w in windows)
        layer_windows = None
        if not uniform:
            never = jnp.iinfo(jnp.int32).max
            layer_windows = jnp.asarray([never if w is None else w for w in windows], jnp.int32)

        def call(
            block: DecoderBlock,
            x: Array,
            per_layer: tuple[KV | None, PRNGKeyArray | None, Int[Array, ""] | None, Any],
        ) -> tuple[Array, KV | None]:
            past_i, key_i, window_i, local_i = per_layer
            window = windows[0] if uniform else window_i
            layer_rotary = rotary
            if local_rotary is not None:
                layer_rotary = (
                    jnp.where(local_i, local_rotary[0], rotary[0]),
                    jnp.where(local_i, local_rotary[1], rotary[1]),
                )
            x, kv = block(
                x,
                layer_rotary,
                positions,
                past_i,
                past_positions,
                window=window,
                key=key_i,
                attention=attention,
                segment_ids=segment_ids,
                mlp_chunk=mlp_chunk,
            )
            return x, (kv if keep_kv else None)

        x, new_kv = eqx_lean.scan(
            self.layers, x, (past, layer_keys, layer_windows, layer_local), call=call, remat=remat
        )
        x = self.norm(x)
        if final_hidden:
            return x, new_kv
        if self.lm_head is None:
            logits = linear_product(x, self.embed_tokens.weight)
        else:
            logits = _project(self.lm_head, x)
        cap = config.final_logit_softcapping
        if cap is not None:  # Gemma 2, in the logits' dtype as transformers
            logits = jnp.tanh(logits / cap) * cap
        return logits, new_kv

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        *,
        remat: bool | None = None,
        key: PRNGKeyArray | None = None,
        attention: str = "blockwise",
        segment_ids: Int[Array, "batch seq"] | None = None,
        positions: Int[Array, "batch seq"] | None = None,
        mlp_chunk_bytes: int | None = None,
    ) -> Float[Array, "batch seq vocab"]:
        """Logits for every position of `input_ids` (causal, from position 0).

        **Arguments:**

        - `input_ids`: integer token ids of shape `[batch, seq]`.
        - `remat`: recompute each block's activations in the backward pass (for training).
        - `key`: randomness for training-time layers (LoRA dropout, see `lora.py`); `None`
            runs them deterministically, as in inference.
        - `attention`: `"blockwise"` ([`eqx_lean.nn.attention`][]: no `[heads, seq, seq]`
            scores held) or `"eager"` (HF's eager attention, every score held: the float32
            reference).
        - `segment_ids`, `positions`: packed rows (as
            [`pack_documents`][eqx_lean.hf.pack_documents] makes them): each token's document
            `[batch, seq]` (a token attends only within its document) and its position in that
            document (the rotary embeddings'); `None` for one sequence per row from position
            0. Each is given with the other.
        - `mlp_chunk_bytes`: each layer's MLP runs over chunks of positions whose widest
            activation (`[batch, chunk, intermediate]` in the model's dtype) stays within
            this many bytes ([`eqx_lean.nn.positionwise`][]), so that a long sequence's MLP
            holds one chunk's activations, in the forward and the backward pass. `None`:
            the platform's, 256 MiB on GPUs and TPUs ([`eqx_lean.hf.MLP_CHUNK_BYTES`][]),
            8 MiB on CPUs; a sequence within it is one chunk, computed as without chunking.

        **Returns:**

        Logits of shape `[batch, seq, vocab]`, in the model's dtype.
        """
        return self._whole_sequence(
            input_ids, False, remat, key, attention, segment_ids, positions, mlp_chunk_bytes
        )

    def hidden_states(
        self,
        input_ids: Int[Array, "batch seq"],
        *,
        remat: Any = None,
        key: PRNGKeyArray | None = None,
        attention: str = "blockwise",
        segment_ids: Int[Array, "batch seq"] | None = None,
        positions: Int[Array, "batch seq"] | None = None,
        mlp_chunk_bytes: int | None = None,
    ) -> Float[Array, "batch seq hidden"]:
        """The final hidden states of every position (after the final norm, before the head):
        what a fused loss such as [`eqx_lean.nn.linear_cross_entropy`][] takes instead of the
        logits.

        **Arguments:**

        As for calling the model.

        **Returns:**

        Hidden states of shape `[batch, seq, hidden]`, in the model's dtype; the logits are
        `hidden_states @ head.T`, the head being `lm_head.weight` or, when tied, the embedding.
        """
        return self._whole_sequence(
            input_ids, True, remat, key, attention, segment_ids, positions, mlp_chunk_bytes
        )

    def _whole_sequence(
        self,
        input_ids: Int[Array, "batch seq"],
        final_hidden: bool,
        remat: Any,
        key: PRNGKeyArray | None,
        attention: str,
        segment_ids: Int[Array, "batch seq"] | None,
        positions: Int[Array, "batch seq"] | None,
        mlp_chunk_bytes: int | None,
    ) -> Float[Array, "batch seq out"]:
        """The logits (or, with `final_hidden`, the final hidden states) of a whole sequence
        from position 0, without a cache: what calling the model and `hidden_states` share."""
        attention = check_attention(attention)
        _check_packed(input_ids, segment_ids, positions)
        out, _ = self._logits(
            input_ids,
            jnp.arange(input_ids.shape[1], dtype=jnp.int32),
            None,
            None,
            remat=remat,
            key=key,
            final_hidden=final_hidden,
            attention=attention,
            segment_ids=segment_ids,
            row_positions=positions,
            mlp_chunk_bytes=mlp_chunk_bytes,
        )
        return out

    def step(
        self, input_ids: Int[Array, "batch seq"], cache: KVCache
    ) -> tuple[Float[Array, "batch seq vocab"], KVCache]:
        """Runs `input_ids` as the next positions after those in `cache` (prefill or decode).

        **Arguments:**

        - `input_ids`: the new tokens, shape `[batch, seq]` (`seq=1` for a decode step).
        - `cache`: the cache from [`KVCache.empty`][] or a previous step.

        **Returns:**

        The logits of the new tokens `[batch, seq, vocab]` and the updated cache.
        """
        seq = input_ids.shape[1]
        positions = cache.next_position + jnp.arange(seq, dtype=jnp.int32)
        logits, new_kv = self._logits(
            input_ids, positions, (cache.keys, cache.values), cache.slot_positions
        )
        assert new_kv is not None
        return logits, cache.write(new_kv[0], new_kv[1], positions)


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], std: float) -> Array:
    return std * jax.random.normal(key, shape, jnp.float32)


def _linear(
    in_features: int, out_features: int, std: float, *, key: PRNGKeyArray, bias: bool = False
) -> eqx.nn.Linear:
    # Equinox's uniform init is replaced (biases start at zero, as HF's); under `jit` XLA drops
    # the unused random draw.
    linear = eqx.nn.Linear(in_features, out_features, use_bias=bias, key=key)
    linear = eqx.tree_at(lambda m: m.weight, linear, _normal(key, (out_features, in_features), std))
    if bias:
        linear = eqx.tree_at(lambda m: m.bias, linear, jnp.zeros((out_features,), jnp.float32))
    return linear


def _rms_norm(
    config: DecoderConfig, norm_std: float, *, key: PRNGKeyArray, size: int | None = None
) -> RMSNorm:
    """A norm of `size` (`None`: `hidden_size`) that starts as the identity: weight 1, or 0
    where the norm multiplies by `1 + w` (Gemma, as transformers initialises it)."""
    size = config.hidden_size if size is None else size
    offset = bool(config.norm_unit_offset)
    weight = jnp.full((size,), 0.0 if offset else 1.0, jnp.float32)
    if norm_std:
        weight = weight + _normal(key, (size,), norm_std)
    return RMSNorm(weight, config.rms_norm_eps, offset)


def make_block(
    config: DecoderConfig,
    *,
    key: PRNGKeyArray,
    std: float | None = None,
    norm_std: float = 0.0,
) -> DecoderBlock:
    """Builds one decoder block with HF-like random init (float32).

    **Arguments:**

    - `config`: the model shape.
    - `key`: the block's random key.
    - `std`: standard deviation of the normal init of every matrix; `None` means
        `config.initializer_range` (0.02, as HF).
    - `norm_std`: RMSNorm weights are `1 + norm_std * normal` (`norm_std * normal` where the
        norm multiplies by `1 + w`, Gemma's; HF: 0; tests use more, so that norms are not the
        identity).

    **Returns:**

    A [`DecoderBlock`][].
    """
    std = config.initializer_range if std is None else std
    hidden, inner, head_dim = config.hidden_size, config.intermediate_size, config.resolved_head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    keys = jax.random.split(key, 13)
    qkv, o, mlp_bias = config.attention_bias, config.o_proj_bias, config.mlp_bias
    q_norm = k_norm = None
    if config.qk_norm:
        q_norm = _rms_norm(config, norm_std, key=keys[9], size=head_dim)
        k_norm = _rms_norm(config, norm_std, key=keys[10], size=head_dim)
    attention = Attention(
        q_proj=_linear(hidden, heads * head_dim, std, key=keys[0], bias=qkv),
        k_proj=_linear(hidden, kv_heads * head_dim, std, key=keys[1], bias=qkv),
        v_proj=_linear(hidden, kv_heads * head_dim, std, key=keys[2], bias=qkv),
        o_proj=_linear(heads * head_dim, hidden, std, key=keys[3], bias=o),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        q_norm=q_norm,
        k_norm=k_norm,
        scale=config.attention_scale,
        soft_cap=config.attn_logit_softcapping,
    )
    assert config.hidden_act is not None
    mlp = MLP(
        gate_proj=_linear(hidden, inner, std, key=keys[4], bias=mlp_bias),
        up_proj=_linear(hidden, inner, std, key=keys[5], bias=mlp_bias),
        down_proj=_linear(inner, hidden, std, key=keys[6], bias=mlp_bias),
        activation=config.hidden_act,
    )
    pre_feedforward = post_feedforward = None
    if config.post_norms:
        pre_feedforward = _rms_norm(config, norm_std, key=keys[11])
        post_feedforward = _rms_norm(config, norm_std, key=keys[12])
    return DecoderBlock(
        input_layernorm=_rms_norm(config, norm_std, key=keys[7]),
        self_attn=attention,
        post_attention_layernorm=_rms_norm(config, norm_std, key=keys[8]),
        mlp=mlp,
        pre_feedforward_layernorm=pre_feedforward,
        post_feedforward_layernorm=post_feedforward,
    )


@dataclasses.dataclass(frozen=True)
class _BlockFactory:
    """`make_block` with its settings bound; equal by value, so that `build_stacked` reuses
    its compiled per-layer writes for every model of the same configuration."""

    config: DecoderConfig
    std: float | None
    norm_std: float

    def __call__(self, key: PRNGKeyArray) -> DecoderBlock:
        return make_block(self.config, key=key, std=self.std, norm_std=self.norm_std)


# Test seam: tests/test_docs.py wraps it to record the embedding and head draws.
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal_matrix(key: PRNGKeyArray, shape: tuple[int, int], std: float, dtype: Any) -> Array:
    # Jitted so that the float32 draw is a temporary freed before the next tensor is built.
    return _normal(key, shape, std).astype(dtype)


def _resolve_dtype(config: DecoderConfig, dtype: Any) -> Any:
    return jnp.dtype(config.dtype if dtype is None else dtype)


def init(
    config: DecoderConfig,
    *,
    key: PRNGKeyArray,
    dtype: Any = None,
    std: float | None = None,
    norm_std: float = 0.0,
    progress: bool = False,
) -> Decoder:
    """Builds a randomly initialised decoder without ever holding it at float32.

    The embedding, head and final norm are built first (each one's float32 temporaries are
    freed before the next), then the blocks with [`eqx_lean.build_stacked`][] one layer at a
    time, each draw fused into its in-place write, so the peak stays near the final size.

    **Arguments:**

    - `config`: the model shape.
    - `key`: the random key.
    - `dtype`: the storage and compute dtype; `None` means `config.dtype`.
    - `std`, `norm_std`: as for [`make_block`][] (embedding and head use `std` too).
    - `progress`: show a progress bar over the layers.

    **Returns:**

    The [`Decoder`][] model (its head tied to the embedding with `tie_word_embeddings`).
    """
    dtype = _resolve_dtype(config, dtype)
    std = config.initializer_range if std is None else std
    embed_key, head_key, norm_key, layers_key = jax.random.split(key, 4)
    embed = _normal_matrix(embed_key, (config.vocab_size, config.hidden_size), std, dtype)
    head = None
    if not config.tie_word_embeddings:
        head = _normal_matrix(head_key, (config.vocab_size, config.hidden_size), std, dtype)
    norm = _rms_norm(config, norm_std, key=norm_key)
    norm = RMSNorm(norm.weight.astype(dtype), norm.eps, norm.unit_offset)
    layers = eqx_lean.build_stacked(
        _BlockFactory(config, std, norm_std),
        jax.random.split(layers_key, config.num_hidden_layers),
        dtype,
        progress=progress,
    )
    return Decoder(
        embed_tokens=eqx.nn.Embedding(weight=embed),
        layers=layers,
        norm=norm,
        lm_head=None if head is None else _linear_from_weight(head),
        config=config,
    )


# The name before issue 45, kept so that pickles naming `_model.Mistral` still load; the public
# deprecated alias is `eqx_lean.hf.Mistral`, which warns.
Mistral = Decoder


def _linear_from_weight(weight: Float[Array, "out in"]) -> eqx.nn.Linear:
    out_features, in_features = weight.shape
    abstract = eqx.filter_eval_shape(
        lambda: eqx.nn.Linear(in_features, out_features, use_bias=False, key=jax.random.key(0))
    )
    return eqx.tree_at(lambda m: m.weight, abstract, weight)
