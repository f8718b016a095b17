"""A position-wise function (an MLP, a norm, a projection) over a long sequence in chunks of
positions, so that its intermediates are those of one chunk, in the forward pass and in the
gradient.

A transformer's MLP widens every position to its intermediate size (14,336 for an 8B Llama):
at 131,072 tokens that is 3.5 GiB per bfloat16 intermediate, several of them live in the
backward pass. The function is run by a `lax.scan` over chunks of positions, each chunk under
`jax.checkpoint`: the scan's backward recomputes one chunk's intermediates from its slice of
the input, which is read from the input itself (no stacked copy is saved), and writes the
chunk's gradient into place. Chunking changes nothing a position computes, only how many are
computed at once.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, PRNGKeyArray

from .. import _arguments as arguments
from .._core.sharding import explicit_spec, explicit_type_sharding


def chunk_positions(seq: int, bytes_per_position: int, chunk_bytes: int) -> int:
    """The positions per chunk: as many as keep `bytes_per_position` each within
    `chunk_bytes` (at least one), preferring a divisor of `seq` (no padding) when one is at
    least half that many, else spread evenly so that padding adds fewer positions than there
    are chunks."""
    most = max(1, min(seq, chunk_bytes // max(1, bytes_per_position)))
    for chunk in range(most, (most - 1) // 2, -1):
        if seq % chunk == 0:
            return chunk
    chunks = -(-seq // most)
    return -(-seq // chunks)


def positionwise(
    fn: Callable[..., Float[Array, "batch chunk out"]],
    x: Float[Array, "batch seq in"],
    *,
    chunk: int,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "batch seq out"]:
    """`fn(x, key=key)` for a position-wise `fn`, computed `chunk` positions at a time.

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from eqx_lean.nn import positionwise

    mlp = eqx.nn.MLP(64, 64, width_size=512, depth=1, key=jax.random.key(0))
    widen = jax.vmap(jax.vmap(lambda h: mlp(h)))  # [batch, seq, 64] -> [batch, seq, 64]
    x = jax.random.normal(jax.random.key(1), (2, 1000, 64))
    y = positionwise(lambda h, key: widen(h), x, chunk=256)
    assert jnp.allclose(y, widen(x), atol=1e-6)
    ```

    `fn` must treat each position on its own (what it computes at position `t` depends only
    on `x[:, t]`): an MLP, a norm, a linear layer, not attention. It is run by a `lax.scan`
    over chunks of `chunk` positions of every row; each chunk is checkpointed, so the gradient
    holds the intermediates of one chunk at a time and recomputes them (about one more
    forward pass of `fn`). A sequence that `chunk` does not divide is padded with zeros at the
    end (their outputs are dropped). With one chunk or fewer, `fn` runs once on the whole of
    `x`, unchanged.

    **Arguments:**

    - `fn`: `fn(x_chunk, key=key_chunk) -> y_chunk`, mapping `[batch, chunk, in]` to
        `[batch, chunk, out]`; arrays it closes over (weights) are differentiated as usual.
    - `x`: the input, `[batch, seq, in]`.
    - `chunk`: positions per chunk, a positive integer.
    - `key`: randomness for `fn` (dropout): chunk `i` gets `jax.random.fold_in(key, i)`;
        `None` passes `key=None` to every chunk.

    **Returns:**

    `[batch, seq, out]`: `fn`'s output for every position.
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be callable; got {fn!r}.")
    chunk = arguments.integer(chunk, "`chunk`", minimum=1)
    if getattr(x, "ndim", None) != 3:
        raise ValueError(
            f"`x` must be an array of shape [batch, seq, features]; got {getattr(x, 'shape', x)}."
        )
    seq = x.shape[1]
    if seq <= chunk:
        return fn(x, key=key)
    chunks = -(-seq // chunk)
    padded = chunks * chunk
    if padded != seq:
        x = jnp.pad(x, ((0, 0), (0, padded - seq), (0, 0)))

    def one(i: Array) -> Array:
        # The slice is taken inside the checkpoint, so the backward saves only `i`: the chunk
        # is read again from `x`, never kept as a stacked copy of it.
        part = lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1)
        return fn(part, key=None if key is None else jax.random.fold_in(key, i))

    one = jax.checkpoint(one, prevent_cse=False)
    out_struct = jax.eval_shape(one, jnp.zeros((), jnp.int32))
    # Sharded as `x` is on Explicit mesh axes (its rows), its feature axis whole.
    rows = explicit_type_sharding(x)
    sharding = None
    if rows is not None:
        spec = explicit_spec(x)
        assert spec is not None
        sharding = NamedSharding(rows.mesh, PartitionSpec(*spec[:2]))
    out = jnp.zeros((x.shape[0], padded, *out_struct.shape[2:]), out_struct.dtype, device=sharding)

    def body(out: Array, i: Array) -> tuple[Array, None]:
        return lax.dynamic_update_slice_in_dim(out, one(i), i * chunk, axis=1), None

    out, _ = lax.scan(body, out, jnp.arange(chunks, dtype=jnp.int32))
    return out if padded == seq else out[:, :seq]
