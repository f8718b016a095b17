"""Blockwise attention (FlashAttention's algorithm in plain JAX): an online softmax over blocks
of keys, so that no `[heads, seq, seq]` scores are ever held whole.

The forward pass runs a `lax.scan` over blocks of queries; for each, a loop over the blocks of
keys it can see (its bounds computed from the causal mask and the window, so blocks wholly
outside them are never computed) keeps each row's running maximum, its sum of exponentials and
its float32 output. The custom VJP saves only the inputs, the output and each row's
log-sum-exp; the backward pass recomputes one block of scores at a time (a scan over key
blocks, a loop over the query blocks that see them), accumulating the keys' and values'
gradients per key block and the queries' in one float32 buffer. JAX's own differentiation of
the forward loop would keep every block's state, quadratic again.

Grouped-query heads are read by group: query head `h` reads key/value head `h // groups`
(HF's `repeat_kv` order) through a `[kv_heads, groups]` split of the query heads, never a
repeated copy of the keys.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from .. import _arguments as arguments


DEFAULT_BLOCK = 512
"""The query and key positions per block when `block_q`/`block_k` are `None`."""

_F32 = jnp.float32


def _scores(q: Array, k: Array, scale: float, cap: float | None) -> tuple[Array, Array | None]:
    """`[b, kv, g, bq, bk]` float32 scores of one block pair, scaled and soft-capped, and
    `tanh` of the capped argument (for the cap's derivative) where there is a cap."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=_F32) * scale
    if cap is None:
        return s, None
    t = jnp.tanh(s / cap)
    return t * cap, t


def _visible(
    q_start: Array,
    k_start: Array,
    bq: int,
    bk: int,
    keys: int,
    causal: bool,
    window: Array,
    segments: Array | None,
) -> Array:
    """Which scores of a block pair count: `[b or 1, 1, 1, bq, bk]`."""
    qi = q_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    kj = k_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    visible = kj < keys
    if causal:
        visible = visible & (kj <= qi) & (qi - kj < window)
    visible = visible[None, None, None]
    if segments is not None:
        seg_q = lax.dynamic_slice_in_dim(segments, q_start, bq, axis=1)
        seg_k = lax.dynamic_slice_in_dim(segments, k_start, bk, axis=1)
        same = seg_q[:, :, None] == seg_k[:, None, :]
        visible = visible & same[:, None, None]
    return visible


def _key_range(q_start: Array, bq: int, bk: int, nk: int, causal: bool, window: Array) -> Any:
    """The key blocks `[lo, hi)` that queries `q_start .. q_start + bq - 1` can see."""
    if not causal:
        return jnp.int32(0), jnp.int32(nk)
    hi = jnp.minimum(nk, (q_start + bq - 1) // bk + 1)
    lo = jnp.maximum(0, (q_start - window + 1) // bk)
    return lo, hi


def _query_range(k_start: Array, bq: int, bk: int, nq: int, causal: bool, window: Array) -> Any:
    """The query blocks `[lo, hi)` that see some key of `k_start .. k_start + bk - 1`."""
    if not causal:
        return jnp.int32(0), jnp.int32(nq)
    lo = k_start // bq
    hi = jnp.minimum(nq, (k_start + bk - 2 + window) // bq + 1)
    return lo, hi


def _forward(
    q: Array,
    k: Array,
    v: Array,
    window: Array,
    segments: Array | None,
    statics: tuple[bool, float, float | None, int, int, int],
) -> tuple[Array, Array]:
    """The output `[b, t, kv, g, d]` (in `q`'s dtype) and each row's log-sum-exp
    `[b, t, kv, g]` (float32; `inf` for a row that sees no key)."""
    causal, scale, cap, bq, bk, keys = statics
    t, s = q.shape[1], k.shape[1]
    nq, nk = t // bq, s // bk

    def one_query_block(_: None, i: Array) -> tuple[None, tuple[Array, Array]]:
        q_start = i * bq
        qb = lax.dynamic_slice_in_dim(q, q_start, bq, axis=1)
        lo, hi = _key_range(q_start, bq, bk, nk, causal, window)
        acc = jnp.zeros_like(qb, dtype=_F32)
        # [b, kv, g, bq]: the scores' layout, rows last.
        row = jnp.einsum("bqkg->bkgq", jnp.zeros_like(qb[..., 0], dtype=_F32))
        m = row - jnp.inf
        l_sum = row

        def body(j: Array, state: Any) -> Any:
            acc, m, l_sum = state
            k_start = j * bk
            kb = lax.dynamic_slice_in_dim(k, k_start, bk, axis=1)
            vb = lax.dynamic_slice_in_dim(v, k_start, bk, axis=1)
            sc, _ = _scores(qb, kb, scale, cap)
            visible = _visible(q_start, k_start, bq, bk, keys, causal, window, segments)
            sc = jnp.where(visible, sc, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
            safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(sc - safe[..., None])
            alpha = jnp.exp(m - safe)
            l_sum = l_sum * alpha + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), vb, preferred_element_type=_F32)
            acc = acc * jnp.einsum("bkgq->bqkg", alpha)[..., None] + pv
            return acc, m_new, l_sum

        acc, m, l_sum = lax.fori_loop(lo, hi, body, (acc, m, l_sum))
        seen = l_sum > 0
        denominator = jnp.einsum("bkgq->bqkg", jnp.where(seen, l_sum, 1.0))
        out = (acc / denominator[..., None]).astype(q.dtype)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l_sum, 1.0)), jnp.inf)
        return None, (out, jnp.einsum("bkgq->bqkg", lse))

    _, (out, lse) = lax.scan(one_query_block, None, jnp.arange(nq, dtype=jnp.int32))
    # [nq, b, bq, ...] -> [b, nq * bq, ...]
    out = jnp.moveaxis(out, 0, 1).reshape(q.shape)
    lse = jnp.moveaxis(lse, 0, 1).reshape(q.shape[:-1])
    return out, lse


def _blockwise(
    q: Array,
    k: Array,
    v: Array,
    window: Array,
    segments: Array | None,
    statics: tuple[bool, float, float | None, int, int, int],
) -> Array:
    return _forward(q, k, v, window, segments, statics)[0]


def _blockwise_fwd(
    q: Array,
    k: Array,
    v: Array,
    window: Array,
    segments: Array | None,
    statics: tuple[bool, float, float | None, int, int, int],
) -> tuple[Array, tuple[Any, ...]]:
    out, lse = _forward(q, k, v, window, segments, statics)
    return out, (q, k, v, window, segments, out, lse)


def _blockwise_bwd(
    statics: tuple[bool, float, float | None, int, int, int], saved: Any, d_out: Array
) -> tuple[Array, Array, Array, None, None]:
    causal, scale, cap, bq, bk, keys = statics
    q, k, v, window, segments, out, lse = saved
    t, s = q.shape[1], k.shape[1]
    nq, nk = t // bq, s // bk
    # Each row's sum of d_out * out: the softmax's derivative without the full probabilities.
    delta = jnp.sum(d_out.astype(_F32) * out.astype(_F32), axis=-1)  # [b, t, kv, g]
    dq = jnp.zeros_like(q, dtype=_F32)

    def one_key_block(dq: Array, j: Array) -> tuple[Array, tuple[Array, Array]]:
        k_start = j * bk
        kb = lax.dynamic_slice_in_dim(k, k_start, bk, axis=1)
        vb = lax.dynamic_slice_in_dim(v, k_start, bk, axis=1)
        dk = jnp.zeros_like(kb, dtype=_F32)
        dv = jnp.zeros_like(vb, dtype=_F32)
        lo, hi = _query_range(k_start, bq, bk, nq, causal, window)

        def body(i: Array, state: Any) -> Any:
            dq, dk, dv = state
            q_start = i * bq
            qb = lax.dynamic_slice_in_dim(q, q_start, bq, axis=1)
            dob = lax.dynamic_slice_in_dim(d_out, q_start, bq, axis=1)
            lse_b = jnp.einsum("bqkg->bkgq", lax.dynamic_slice_in_dim(lse, q_start, bq, axis=1))
            delta_b = jnp.einsum("bqkg->bkgq", lax.dynamic_slice_in_dim(delta, q_start, bq, axis=1))
            sc, tanh = _scores(qb, kb, scale, cap)
            visible = _visible(q_start, k_start, bq, bk, keys, causal, window, segments)
            p = jnp.where(visible, jnp.exp(sc - lse_b[..., None]), 0.0)
            dv = dv + jnp.einsum(
                "bkgqs,bqkgd->bskd", p.astype(dob.dtype), dob, preferred_element_type=_F32
            )
            dp = jnp.einsum("bqkgd,bskd->bkgqs", dob, vb, preferred_element_type=_F32)
            ds = p * (dp - delta_b[..., None])
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            ds = (ds * scale).astype(q.dtype)
            dq_b = jnp.einsum("bkgqs,bskd->bqkgd", ds, kb, preferred_element_type=_F32)
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qb, preferred_element_type=_F32)
            dq_old = lax.dynamic_slice_in_dim(dq, q_start, bq, axis=1)
            dq = lax.dynamic_update_slice_in_dim(dq, dq_old + dq_b, q_start, axis=1)
            return dq, dk, dv

        dq, dk, dv = lax.fori_loop(lo, hi, body, (dq, dk, dv))
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq, (dk, dv) = lax.scan(one_key_block, dq, jnp.arange(nk, dtype=jnp.int32))
    dk = jnp.moveaxis(dk, 0, 1).reshape(k.shape)
    dv = jnp.moveaxis(dv, 0, 1).reshape(v.shape)
    return dq.astype(q.dtype), dk, dv, None, None


_blockwise_vjp = jax.custom_vjp(_blockwise, nondiff_argnums=(5,))
_blockwise_vjp.defvjp(_blockwise_fwd, _blockwise_bwd)


def _check(q: Any, k: Any, v: Any, segment_ids: Any) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or x.ndim != 4:
            raise ValueError(
                f"`{name}` must be an array [batch, seq, heads, head_dim]; got "
                f"{getattr(x, 'shape', x)!r}."
            )
    if k.shape != v.shape:
        raise ValueError(f"`k` and `v` must have one shape; got {k.shape} and {v.shape}.")
    b, t, h, d = q.shape
    if k.shape[0] != b or k.shape[1] != t or k.shape[3] != d:
        raise ValueError(
            "`k` and `v` must have `q`'s batch, sequence and head size (self-attention over "
            f"one sequence), [{b}, {t}, kv_heads, {d}]; got {k.shape}."
        )
    if h % k.shape[2]:
        raise ValueError(
            "`q`'s heads must be a multiple of `k`'s (grouped-query attention); got "
            f"{h} and {k.shape[2]}."
        )
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(
            f"`q`, `k` and `v` must have one floating dtype; got {q.dtype}, {k.dtype} and "
            f"{v.dtype}."
        )
    if segment_ids is not None and (
        not hasattr(segment_ids, "shape")
        or tuple(segment_ids.shape) != (b, t)
        or not jnp.issubdtype(segment_ids.dtype, jnp.integer)
    ):
        raise ValueError(
            f"`segment_ids` must be None or integers of shape [batch, seq], ({b}, {t}); got "
            f"{getattr(segment_ids, 'dtype', '')}{list(getattr(segment_ids, 'shape', []))}."
        )


def _block(value: Any, what: str, seq: int) -> int:
    size = arguments.optional_integer(value, what, minimum=1)
    return min(seq, DEFAULT_BLOCK if size is None else size)


def attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    causal: bool = True,
    window: int | Int[Array, ""] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    scale: float | None = None,
    logit_soft_cap: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Self-attention computed a block of queries and a block of keys at a time (an online
    softmax, as FlashAttention), so that no `[heads, seq, seq]` scores are ever held whole.

    The layout is `[batch, seq, heads, head_dim]` for all three inputs (HF's and
    `jax.nn.dot_product_attention`'s). Grouped-query heads are read by group: query head `h`
    attends with key/value head `h // (heads // kv_heads)`, as HF's `repeat_kv` arranges them,
    without a repeated copy. Scores are `scale * q @ k.T`, optionally soft-capped
    (`tanh(s / logit_soft_cap) * logit_soft_cap`, Gemma 2's attention cap) and accumulated in
    float32 whatever the inputs' dtype; the output has the inputs' dtype.

    Under differentiation only the inputs, the output and each row's log-sum-exp are saved; the
    backward pass recomputes the scores one block at a time. A sliding window's key blocks
    that no query of a block can see are skipped (not computed, not only masked), in the
    forward and the backward pass, even where the window is traced. Forward-mode
    differentiation (`jax.jvp`) is not supported (a `jax.custom_vjp`).

    **Arguments:**

    - `q`: queries `[batch, seq, heads, head_dim]`.
    - `k`, `v`: keys and values `[batch, seq, kv_heads, head_dim]` (the same positions as the
        queries: self-attention), `heads` a multiple of `kv_heads`; one dtype for all three.
    - `causal`: query `i` sees keys `j <= i` only; `False` lets every query see every key.
    - `window`: with `causal`, query `i` sees keys `i - window < j <= i` (`window` keys
        including itself, HF's `sliding_window`); a positive integer, a traced int32 scalar,
        or `None` for no window.
    - `segment_ids`: integers `[batch, seq]` for packed documents: query `i` sees key `j` only
        where both have the same id (restart the positions per document yourself, for the
        rotary embeddings). `None`: one document per row.
    - `scale`: the scores' factor; `None` means `head_dim ** -0.5`.
    - `logit_soft_cap`: a positive number, or `None` for no cap.
    - `block_q`, `block_k`: query and key positions per block (`None`: 512, or the sequence
        where it is shorter). The sequence need not be a multiple: it is padded, and the
        padding is masked.

    **Returns:**

    The attention output `[batch, seq, heads, head_dim]` in the inputs' dtype (before the
    output projection).

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from eqx_lean.nn import attention

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 10, 4, 8))  # [batch, seq, heads, head_dim]
    k = jax.random.normal(keys[1], (2, 10, 2, 8))  # two key/value heads, two groups
    v = jax.random.normal(keys[2], (2, 10, 2, 8))
    out = attention(q, k, v, window=3, block_q=4, block_k=4)
    # The same with every score held: head h reads key/value head h // 2.
    kr, vr = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / jnp.sqrt(8.0)
    i, j = jnp.arange(10)[:, None], jnp.arange(10)[None, :]
    s = jnp.where((j <= i) & (i - j < 3), s, -jnp.inf)
    expected = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vr)
    assert jnp.allclose(out, expected, atol=1e-5)
    ```
    """
    _check(q, k, v, segment_ids)
    causal = arguments.boolean(causal, "`causal`")
    b, t, h, d = q.shape
    kv = k.shape[2]
    if window is not None and not causal:
        raise ValueError("`window` needs `causal=True` (a window reaches back from each query).")
    if isinstance(window, jax.Array):
        if jnp.shape(window) != () or not jnp.issubdtype(jnp.result_type(window), jnp.integer):
            raise ValueError(f"`window` must be a positive integer scalar; got {window!r}.")
        w = jnp.asarray(window, jnp.int32)
    elif window is None:
        w = None
    else:
        w = arguments.integer(window, "`window`", minimum=1)
    factor = d**-0.5 if scale is None else arguments.number(scale, "`scale`", above=0.0)
    cap = None
    if logit_soft_cap is not None:
        cap = arguments.number(logit_soft_cap, "`logit_soft_cap`", above=0.0)
    bq = _block(block_q, "`block_q`", t)
    bk = _block(block_k, "`block_k`", t)
    padded = -(-t // bq) * bq
    padded_k = -(-t // bk) * bk
    # A window longer than the padded sequence sees everything: clamping it keeps the loop
    # bounds' arithmetic within int32 (a layer's "no window" may be int32's largest value).
    reach = max(padded, padded_k) + 1
    window_arr = jnp.int32(reach) if w is None else jnp.minimum(w, reach).astype(jnp.int32)
    qg = q.reshape(b, t, kv, h // kv, d)
    if padded != t:
        qg = jnp.pad(qg, ((0, 0), (0, padded - t), (0, 0), (0, 0), (0, 0)))
    if padded_k != t:
        k = jnp.pad(k, ((0, 0), (0, padded_k - t), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, padded_k - t), (0, 0), (0, 0)))
    segments = segment_ids
    if segments is not None:
        segments = segments.astype(jnp.int32)
        longest = max(padded, padded_k)
        if longest != t:
            segments = jnp.pad(segments, ((0, 0), (0, longest - t)), constant_values=-1)
    statics = (causal, float(factor), cap, bq, bk, t)
    out = _blockwise_vjp(qg, k, v, window_arr, segments, statics)
    return out[:, :t].reshape(b, t, h, d)
