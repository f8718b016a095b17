"""A fused linear + cross-entropy: the output head's product, the log-sum-exp and the target
logit a chunk of tokens at a time, so that no `[tokens, vocab]` logits are ever held whole.

The forward pass runs one `lax.scan` over chunks of positions. Where the hidden states (or the
head) are differentiated, the same scan also computes their gradient, chunk by chunk, as Liger
Kernel's fused linear cross-entropy does: the gradient of a sum of losses with respect to the
logits is `softmax - one_hot` on the counted tokens, known as soon as the chunk's log-sum-exp
is, so the backward pass only scales the saved gradients by the loss's cotangent and never
computes the head's product again. Which inputs are differentiated is known from
`jax.custom_vjp`'s symbolic zeros (`perturbed`), so an inference call or a LoRA step (head
frozen) computes no head gradient.
"""

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, Float, Int

from .. import _arguments as arguments, _platform
from .._core.sharding import explicit_type_sharding, like_last_axis, resharded_like
from .._product import product_sharding


DEFAULT_CHUNK_BYTES = _platform.LOSS_CHUNK_BYTES
"""The float32 logits of one chunk, in bytes, when `chunk_bytes=None` on a CPU or a TPU: 64 MiB
(131 positions of a 128,256-token vocabulary). On a GPU the default is 256 MiB (see
[`linear_cross_entropy`][eqx_lean.nn.linear_cross_entropy])."""


def _default_chunk_bytes(hidden: Any) -> int:
    """The platform's chunk (`eqx_lean._platform.tricks_of`): that of `hidden`'s devices where
    it is an array already placed, else that of the platform traced for."""
    return _platform.tricks_of(hidden).loss_chunk_bytes


_F32 = jnp.float32


def _chunk_logits(
    h: Array, weight: Array, bias: Array | None, cap: float | None
) -> tuple[Array, Array | None]:
    """`[b, c, vocab]` float32 logits of one chunk, soft-capped, and `tanh(z / cap)` (for the
    cap's derivative) where there is a cap."""
    z = jnp.einsum(
        "bch,vh->bcv",
        h,
        weight,
        preferred_element_type=_F32,
        out_sharding=product_sharding(h, weight),
    )
    if bias is not None:
        z = z + like_last_axis(bias, z).astype(_F32).reshape(1, 1, -1)
    if cap is None:
        return z, None
    t = jnp.tanh(z / cap)
    return t * cap, t


def _chunk_step(
    h: Array,
    weight: Array,
    bias: Array | None,
    labels: Array,
    ignore_index: int,
    cap: float | None,
    want: tuple[bool, bool, bool],
) -> tuple[Array, Array | None, Array | None, Array | None]:
    """One chunk: the sum of its counted losses and, for each input in `want` (hidden, weight,
    bias), the gradient of that sum (the hidden's `[b, c, hidden]` in float32, the head's and
    bias's contributions in float32)."""
    vocab = weight.shape[0]
    s, t = _chunk_logits(h, weight, bias, cap)
    lse = jax.nn.logsumexp(s, axis=-1)
    ids = lax.broadcasted_iota(labels.dtype, s.shape, 2)
    hit = ids == labels[..., None]
    # The target's logit as a masked sum over the vocabulary (one nonzero term): unlike a
    # gather, it needs no output sharding where the vocabulary is sharded over Explicit axes.
    target = jnp.sum(jnp.where(hit, s, 0.0), axis=-1)
    counted = labels != ignore_index
    # A counted label outside the vocabulary has no logit: its loss is NaN, not a silent 0.
    valid = (labels >= 0) & (labels < vocab)
    loss = jnp.where(counted, jnp.where(valid, lse - target, jnp.nan), 0.0)
    total = jnp.sum(loss)
    if not any(want):
        return total, None, None, None
    p = jnp.exp(s - lse[..., None])
    dz = jnp.where(counted[..., None], p - hit.astype(_F32), 0.0)
    if t is not None:
        dz = dz * (1.0 - t * t)
    # The products read the head in its own dtype (a float32 cotangent against a bfloat16 head
    # would make XLA:CPU copy the whole head to float32), accumulating in float32.
    dz_low = dz.astype(weight.dtype)
    dh = dw = db = None
    if want[0]:
        dh = jnp.einsum(
            "bcv,vh->bch",
            dz_low,
            weight,
            preferred_element_type=_F32,
            out_sharding=explicit_type_sharding(h),
        )
    if want[1]:
        dw = jnp.einsum(
            "bcv,bch->vh",
            dz_low,
            h,
            preferred_element_type=_F32,
            out_sharding=explicit_type_sharding(weight),
        )
    if want[2]:
        db = jnp.sum(dz, axis=(0, 1))
    return total, dh, dw, db


def _scan_chunks(
    hidden: Array,
    weight: Array,
    bias: Array | None,
    labels: Array,
    ignore_index: int,
    cap: float | None,
    chunk: int,
    want: tuple[bool, bool, bool],
) -> tuple[Array, Array | None, Array | None, Array | None]:
    """The sum of the counted losses over `[batch, seq]` and the wanted gradients, one chunk of
    `chunk` positions (of every row) at a time; `seq` is a multiple of `chunk`."""
    seq = hidden.shape[1]
    total = jnp.zeros((), _F32)
    dh = jnp.zeros_like(hidden) if want[0] else None
    dw = jnp.zeros(weight.shape, _F32, device=explicit_type_sharding(weight)) if want[1] else None
    db = None
    if want[2]:
        assert bias is not None
        db = jnp.zeros(bias.shape, _F32, device=explicit_type_sharding(bias))

    def body(carry: Any, i: Array) -> tuple[Any, None]:
        total, dh, dw, db = carry
        start = i * chunk
        h = lax.dynamic_slice_in_dim(hidden, start, chunk, axis=1)
        lab = lax.dynamic_slice_in_dim(labels, start, chunk, axis=1)
        part, dh_i, dw_i, db_i = _chunk_step(h, weight, bias, lab, ignore_index, cap, want)
        total = total + part
        if dh_i is not None:
            dh = lax.dynamic_update_slice_in_dim(dh, dh_i.astype(hidden.dtype), start, axis=1)
        if dw_i is not None:
            dw = dw + dw_i
        if db_i is not None:
            db = db + resharded_like(db_i, db)
        return (total, dh, dw, db), None

    steps = jnp.arange(seq // chunk, dtype=jnp.int32)
    (total, dh, dw, db), _ = lax.scan(body, (total, dh, dw, db), steps)
    return total, dh, dw, db


def _fused(
    hidden: Array,
    weight: Array,
    bias: Array | None,
    labels: Array,
    ignore_index: int,
    cap: float | None,
    chunk: int,
) -> Array:
    return _scan_chunks(
        hidden, weight, bias, labels, ignore_index, cap, chunk, (False, False, False)
    )[0]


def _fused_fwd(
    hidden: Any,
    weight: Any,
    bias: Any,
    labels: Any,
    ignore_index: int,
    cap: float | None,
    chunk: int,
) -> tuple[Array, dict[str, Array]]:
    want = (
        hidden.perturbed,
        weight.perturbed,
        bias is not None and bias.perturbed,
    )
    b = None if bias is None else bias.value
    total, dh, dw, db = _scan_chunks(
        hidden.value, weight.value, b, labels.value, ignore_index, cap, chunk, want
    )
    # The gradients of the summed loss, saved in their inputs' dtypes (as Liger keeps them);
    # the backward pass only scales them. The dict's keys say which were computed.
    saved = {}
    if dh is not None:
        saved["hidden"] = dh
    if dw is not None:
        saved["weight"] = dw.astype(weight.value.dtype)
    if db is not None:
        saved["bias"] = db.astype(b.dtype)  # pyright: ignore[reportOptionalMemberAccess]
    return total, saved


def _fused_bwd(
    ignore_index: int, cap: float | None, chunk: int, saved: dict[str, Array], g: Any
) -> tuple[Any, Any, Any, None]:
    del ignore_index, cap, chunk
    if isinstance(g, SymbolicZero):
        return None, None, None, None

    def scaled(name: str) -> Array | None:
        if name not in saved:
            return None
        grad = saved[name]
        return (grad.astype(_F32) * g).astype(grad.dtype)

    return scaled("hidden"), scaled("weight"), scaled("bias"), None


_fused_vjp = jax.custom_vjp(_fused, nondiff_argnums=(4, 5, 6))
_fused_vjp.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


def _check(hidden: Any, weight: Any, labels: Any, bias: Any) -> None:
    if not hasattr(hidden, "shape") or hidden.ndim < 2:
        raise ValueError(
            "`hidden` must be an array of shape [..., seq, hidden] (at least 2 dimensions); got "
            f"{getattr(hidden, 'shape', hidden)!r}."
        )
    if not hasattr(weight, "shape") or weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            "`weight` must be the head as [vocab, hidden] (HF's `lm_head.weight` and embedding "
            f"layout), its second dimension `hidden`'s last ({hidden.shape[-1]}); got "
            f"{getattr(weight, 'shape', weight)!r}."
        )
    if not hasattr(labels, "shape") or tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"`labels` must have `hidden`'s shape without its last axis, {hidden.shape[:-1]}; "
            f"got {getattr(labels, 'shape', labels)!r}."
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"`labels` must be integers; got dtype {labels.dtype}.")
    if not jnp.issubdtype(hidden.dtype, jnp.floating) or hidden.dtype != weight.dtype:
        raise TypeError(
            "`hidden` and `weight` must have one floating dtype (the head's product reads "
            f"both as they are); got {hidden.dtype} and {weight.dtype}."
        )
    if bias is not None and (not hasattr(bias, "shape") or tuple(bias.shape) != weight.shape[:1]):
        raise ValueError(
            f"`bias` must be None or a vector of the vocabulary's size, {weight.shape[0]}; got "
            f"{getattr(bias, 'shape', bias)!r}."
        )


def chunk_positions(batch: int, seq: int, vocab: int, chunk_bytes: int) -> int:
    """The positions per chunk: as many as keep `batch x positions x vocab` float32 logits
    within `chunk_bytes` (at least one), spread evenly over the chunks so that padding the
    sequence to a multiple of it adds fewer positions than there are chunks."""
    most = max(1, min(seq, chunk_bytes // (4 * max(1, batch) * vocab)))
    chunks = -(-seq // most)
    return -(-seq // chunks)


def linear_cross_entropy(
    hidden: Float[Array, "*batch seq hidden"],
    weight: Float[Array, "vocab hidden"],
    labels: Int[Array, "*batch seq"],
    *,
    bias: Float[Array, " vocab"] | None = None,
    ignore_index: int = -100,
    logit_soft_cap: float | None = None,
    chunk_bytes: int | None = None,
    reduction: Literal["mean", "sum"] = "mean",
) -> Float[Array, ""]:
    """Cross-entropy of the logits `hidden @ weight.T + bias` against `labels`, computed a
    chunk of positions at a time so that the `[tokens, vocab]` logits are never held whole.

    For each chunk the head's product is accumulated in float32, optionally soft-capped
    (`tanh(logits / logit_soft_cap) * logit_soft_cap`, Gemma 2's final-logit cap), and reduced
    to its log-sum-exp and the target's logit. Under differentiation the same pass computes the
    gradients of whatever is differentiated among `hidden`, `weight` and `bias` (as Liger
    Kernel's fused linear cross-entropy does), so the backward pass never computes the head's
    product again and holds one chunk of logits at most; a frozen head (LoRA) costs no
    gradient. Use it on the final hidden states of any model (for the HF decoder,
    [`eqx_lean.hf.next_token_loss`][] does).

    The labels are *not* shifted: `labels[..., t]` is the target of `hidden[..., t, :]` (shift
    them yourself for next-token prediction, as `next_token_loss` does). Forward-mode
    differentiation (`jax.jvp`) is not supported (a `jax.custom_vjp`).

    **Arguments:**

    - `hidden`: the final hidden states `[..., seq, hidden]` (after the final norm, before the
        head). Chunks run along `seq`, every leading row at once.
    - `weight`: the head as `[vocab, hidden]`: `eqx.nn.Linear(hidden, vocab).weight`, HF's
        `lm_head.weight`, or a tied embedding matrix as it is. Same dtype as `hidden`.
    - `labels`: integer targets shaped like `hidden` without its last axis.
    - `bias`: the head's bias `[vocab]`, or `None`.
    - `ignore_index`: the label of positions not counted (HF's `-100`).
    - `logit_soft_cap`: a positive number, or `None` for no cap.
    - `chunk_bytes`: the most bytes of float32 logits one chunk holds (all leading rows
        together). A chunk holds at least one position of every row. `None` chooses by
        platform (that of `hidden`'s devices, or JAX's default backend inside a trace): 256
        MiB on a GPU, where smaller chunks were measured much slower (on one H200: the
        documentation's benchmarks, "The loss without the logits"); 64 MiB on a CPU
        (measured) and on a TPU (not measured). Smaller chunks hold less and run more,
        smaller products.
    - `reduction`: `"mean"`, the mean over the counted positions (`labels != ignore_index`),
        or `"sum"`, their sum. As in torch's `cross_entropy` (and so HF's `ForCausalLMLoss`),
        the mean with no position counted is NaN (0 / 0), and so are its gradients; the sum is
        then 0.

    **Returns:**

    The loss, a float32 scalar. A counted label outside `[0, vocab)` makes it NaN.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from eqx_lean.nn import linear_cross_entropy

    hidden = jax.random.normal(jax.random.key(0), (2, 8, 16))  # [batch, seq, hidden]
    head = jax.random.normal(jax.random.key(1), (50, 16))  # [vocab, hidden]
    labels = jnp.array([[-100] * 3 + [1, 2, 3, 4, 5], [7] * 8])  # a masked prompt in row 0
    loss, (d_hidden, d_head) = jax.value_and_grad(linear_cross_entropy, argnums=(0, 1))(
        hidden, head, labels
    )
    logits = hidden @ head.T  # what the loss never holds whole
    counted = labels != -100
    picked = jnp.take_along_axis(
        jax.nn.log_softmax(logits), jnp.where(counted, labels, 0)[..., None], axis=-1
    )[..., 0]
    mean = -jnp.sum(jnp.where(counted, picked, 0.0)) / jnp.sum(counted, dtype=jnp.float32)
    assert jnp.allclose(loss, mean)
    ```
    """
    _check(hidden, weight, labels, bias)
    ignore_index = arguments.integer(ignore_index, "`ignore_index`")
    cap = None
    if logit_soft_cap is not None:
        cap = arguments.number(logit_soft_cap, "`logit_soft_cap`", above=0.0)
    chunk_bytes = arguments.optional_integer(chunk_bytes, "`chunk_bytes`", minimum=1)
    if reduction not in ("mean", "sum"):
        raise ValueError(f'`reduction` must be "mean" or "sum"; got {reduction!r}.')
    if chunk_bytes is None:
        chunk_bytes = _default_chunk_bytes(hidden)

    seq, vocab = hidden.shape[-2], weight.shape[0]
    batch = math.prod(hidden.shape[:-2])
    hidden3 = hidden.reshape(batch, seq, hidden.shape[-1])
    labels2 = labels.reshape(batch, seq)
    chunk = chunk_positions(batch, seq, vocab, chunk_bytes)
    padded = -(-seq // chunk) * chunk
    if padded != seq:
        # Positions added at the end of every row, not counted: their gradient is zero.
        hidden3 = jnp.pad(hidden3, ((0, 0), (0, padded - seq), (0, 0)))
        labels2 = jnp.pad(labels2, ((0, 0), (0, padded - seq)), constant_values=ignore_index)
    total = _fused_vjp(hidden3, weight, bias, labels2, ignore_index, cap, chunk)
    if reduction == "sum":
        return total
    count = jnp.sum(labels != ignore_index, dtype=jnp.int32).astype(_F32)
    return total / count
