"""The layers the benchmarks build: Mistral-shaped decoder blocks, embeddings, one wide leaf."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    num_layers: int = 24
    dim: int = 1024
    hidden: int = 3584
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


PRESETS = {
    "default": BlockConfig(),
    "large": BlockConfig(num_layers=40, dim=2048, hidden=7168, heads=16, kv_heads=4),
    "mistral7b": BlockConfig(
        num_layers=32, dim=4096, hidden=14336, heads=32, kv_heads=8, vocab=32000
    ),
}


class Attention(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)

    def __init__(self, config: BlockConfig, *, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        kv_dim = config.kv_heads * config.head_dim
        self.q_proj = eqx.nn.Linear(config.dim, config.dim, use_bias=False, key=kq)
        self.k_proj = eqx.nn.Linear(config.dim, kv_dim, use_bias=False, key=kk)
        self.v_proj = eqx.nn.Linear(config.dim, kv_dim, use_bias=False, key=kv)
        self.o_proj = eqx.nn.Linear(config.dim, config.dim, use_bias=False, key=ko)
        self.num_heads = config.heads
        self.num_kv_heads = config.kv_heads

    def __call__(self, x: Float[Array, "batch seq dim"]) -> Float[Array, "batch seq dim"]:
        """Causal grouped-query self-attention (no rotary embedding), softmax in float32."""
        batch, seq, dim = x.shape
        head_dim = dim // self.num_heads
        groups = self.num_heads // self.num_kv_heads
        q = _project(self.q_proj, x).reshape(batch, seq, self.num_kv_heads, groups, head_dim)
        k = _project(self.k_proj, x).reshape(batch, seq, self.num_kv_heads, head_dim)
        v = _project(self.v_proj, x).reshape(batch, seq, self.num_kv_heads, head_dim)
        scores = jnp.einsum("btgrd,bsgd->bgrts", q, k) * head_dim**-0.5
        causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
        scores = jnp.where(causal[None, None, None], scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
        out = jnp.einsum("bgrts,bsgd->btgrd", weights, v).reshape(batch, seq, dim)
        return _project(self.o_proj, out)


class MLP(eqx.Module):
    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(self, config: BlockConfig, *, key: PRNGKeyArray):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate_proj = eqx.nn.Linear(config.dim, config.hidden, use_bias=False, key=kg)
        self.up_proj = eqx.nn.Linear(config.dim, config.hidden, use_bias=False, key=ku)
        self.down_proj = eqx.nn.Linear(config.hidden, config.dim, use_bias=False, key=kd)

    def __call__(self, x: Float[Array, "... dim"]) -> Float[Array, "... dim"]:
        """SwiGLU: `down(silu(gate(x)) * up(x))`."""
        gate = jax.nn.silu(_project(self.gate_proj, x))
        return _project(self.down_proj, gate * _project(self.up_proj, x))


class Block(eqx.Module):
    """One Mistral-shaped decoder block: pre-norm attention and SwiGLU MLP, with residuals.

    The forward pass (no rotary embedding) computes in the activations' dtype, so bfloat16
    weights with float32 activations compute in float32, and normalises in float32.
    """

    input_norm: eqx.nn.RMSNorm
    attention: Attention
    post_attention_norm: eqx.nn.RMSNorm
    mlp: MLP

    def __init__(self, config: BlockConfig, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.input_norm = eqx.nn.RMSNorm(config.dim)
        self.attention = Attention(config, key=ka)
        self.post_attention_norm = eqx.nn.RMSNorm(config.dim)
        self.mlp = MLP(config, key=km)

    def __call__(self, x: Float[Array, "batch seq dim"]) -> Float[Array, "batch seq dim"]:
        x = x + self.attention(_rms_norm(self.input_norm, x))
        return x + self.mlp(_rms_norm(self.post_attention_norm, x))


def _project(linear: eqx.nn.Linear, x: Float[Array, "... in"]) -> Float[Array, "... out"]:
    # `eqx.nn.Linear` maps one vector; an einsum maps any leading axes.
    return jnp.einsum("...i,oi->...o", x, linear.weight.astype(x.dtype))


def _rms_norm(norm: eqx.nn.RMSNorm, x: Float[Array, "... dim"]) -> Float[Array, "... dim"]:
    # `eqx.nn.RMSNorm` normalises one vector; this is its formula over the last axis, in float32.
    x32 = x.astype(jnp.float32)
    out = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + norm.eps)
    broadcast = (1,) * (x.ndim - 1) + (-1,)
    if norm.weight is not None:
        out = out * norm.weight.astype(jnp.float32).reshape(broadcast)
    if norm.bias is not None:
        out = out + norm.bias.astype(jnp.float32).reshape(broadcast)
    return out.astype(x.dtype)


class Embeddings(eqx.Module):
    """Token embedding, final norm and untied LM head: the non-stacked part of the model."""

    embed: eqx.nn.Embedding
    norm: eqx.nn.RMSNorm
    lm_head: eqx.nn.Linear

    def __init__(self, config: BlockConfig, *, key: PRNGKeyArray):
        ke, kh = jax.random.split(key)
        self.embed = eqx.nn.Embedding(config.vocab, config.dim, key=ke)
        self.norm = eqx.nn.RMSNorm(config.dim)
        self.lm_head = eqx.nn.Linear(config.dim, config.vocab, use_bias=False, key=kh)


def wide_layer(key: PRNGKeyArray) -> dict[str, jax.Array]:
    """A layer that is one big leaf: a 16 MiB float32 matrix (4096 x 1024), a bias and a scalar.

    With JAX's own Threefry lowering on CPU, writing it needs 4x the matrix in temporaries, the
    case sharded construction's bar was last met on (`benchmarks/sharded_writes.py`).
    """
    kw, kb, ks = jax.random.split(key, 3)
    return {
        "w": jax.random.normal(kw, (4096, 1024)),
        "b": jax.random.normal(kb, (1024,)),
        "s": jax.random.uniform(ks, ()),
    }
