"""The layers the benchmarks build: Mistral-shaped decoder blocks, embeddings, one wide leaf."""

import dataclasses

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray


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


class MLP(eqx.Module):
    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(self, config: BlockConfig, *, key: PRNGKeyArray):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate_proj = eqx.nn.Linear(config.dim, config.hidden, use_bias=False, key=kg)
        self.up_proj = eqx.nn.Linear(config.dim, config.hidden, use_bias=False, key=ku)
        self.down_proj = eqx.nn.Linear(config.hidden, config.dim, use_bias=False, key=kd)


class Block(eqx.Module):
    """The parameters of one Mistral decoder block (construction only: no forward pass)."""

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
