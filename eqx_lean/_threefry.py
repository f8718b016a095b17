"""Threefry lowered as straight-line code, so that a random draw fuses into what consumes it.

JAX lowers its Threefry hash (`threefry2x32_p`, behind every `jax.random` draw with the default
implementation) as a rolled `fori_loop` on CPU, to keep compile times down. The loop's state is
two arrays as large as the draw, and XLA cannot fuse a loop with its consumer: a draw of `n`
float32 values therefore needs about `4 n` x 4 bytes of temporaries (both halves of the counter
going in, both halves of the state, the bits coming out). Unrolled, as JAX lowers it on every
other platform, the hash is elementwise arithmetic on an iota, which XLA fuses with the
conversion to floats, the cast and the in-place `dynamic_update_slice` of `build_stacked`'s
writes: the draw needs no temporaries at all, and runs faster (the figures are in
`docs/benchmarks.md`, "Building stacked layers", "Draws fused into the writes").

Only draws are unrolled. Key arithmetic (`split`, `fold_in`: a few counters) stays a loop, so
that it is computed once instead of being fused into, and recomputed for each element of, the
draw it keys.

The values are the same bit for bit (it is the same integer arithmetic); only the lowering
differs. The override is scoped to the programs `_platform.lower` lowers for CPU, never global;
on GPU and TPU JAX's own lowering is already unrolled.
"""

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p
from jaxtyping import Array


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x: Array, bits: int | Array) -> Array:
    bits = jnp.asarray(bits, jnp.uint32)
    return (x << bits) | (x >> (jnp.uint32(32) - bits))


_State = tuple[tuple[Array, Array], tuple[Any, Any, Any], tuple[Any, Any]]


def _initial_state(key1: Array, key2: Array, x1: Array, x2: Array, rotations: Any) -> _State:
    keys = (key1, key2, key1 ^ key2 ^ _KEY_PARITY)
    return (x1 + keys[0], x2 + keys[1]), keys, rotations


def _block(i: Any, state: _State) -> _State:
    """Four rounds, then a key injection; the key schedule and the rotations turn by one."""
    (x1, x2), keys, rotations = state
    for rotation in rotations[0]:
        x1 = x1 + x2
        x2 = _rotate_left(x2, rotation) ^ x1
    x1 = x1 + keys[1]
    x2 = x2 + keys[2] + jnp.asarray(i + 1, jnp.uint32)
    return (x1, x2), (keys[1], keys[2], keys[0]), (rotations[1], rotations[0])


def threefry2x32_unrolled(key1: Array, key2: Array, x1: Array, x2: Array) -> tuple[Array, Array]:
    """Threefry-2x32 with 20 rounds (Salmon et al., 2011), as JAX computes it, without a loop.

    **Arguments:**

    - `key1`, `key2`: the two 32-bit words of the key (`uint32`, broadcastable to the counts).
    - `x1`, `x2`: the two 32-bit words of each counter (`uint32`).

    **Returns:**

    The two hashed words, each of the counters' shape.
    """
    state = _initial_state(key1, key2, x1, x2, _ROTATIONS)
    for i in range(5):
        state = _block(i, state)
    return state[0]


def _threefry2x32_rolled(key1: Array, key2: Array, x1: Array, x2: Array) -> tuple[Array, Array]:
    """The same hash as a loop over its five blocks of rounds, as JAX lowers it on CPU."""
    rotations = tuple(jnp.asarray(r, jnp.uint32) for r in _ROTATIONS)
    return lax.fori_loop(0, 5, _block, _initial_state(key1, key2, x1, x2, rotations))[0]


# Below this many counters, a hash is key arithmetic (`split`, `fold_in`), not a draw worth
# fusing: it is lowered as a loop, see `_hash_for_lowering`. Materialised, its words cost
# 8 bytes a counter, at most 512 KiB here.
_FUSED_MIN_COUNTERS = 2**16


def _hash_for_lowering(key1: Array, key2: Array, x1: Array, x2: Array) -> tuple[Array, Array]:
    """Unrolled for draws, so they fuse into their consumers; a loop for key arithmetic.

    A derived key (a row of `split(key, 9)`, say) feeds a draw as a scalar. Unrolled, XLA fuses
    its hash into the draw's loop, where it is recomputed for every element unless LLVM hoists
    it out, which it does or not depending on unrelated constants, so that a write of one
    number of layers can take many times as long as one of another (`docs/benchmarks.md`,
    "Draws fused into the writes"). A loop cannot be fused (an optimisation barrier did not
    stop XLA:CPU), so as a loop it is computed once, as with JAX's own lowering.
    """
    if x1.size >= _FUSED_MIN_COUNTERS:
        return threefry2x32_unrolled(key1, key2, x1, x2)
    return _threefry2x32_rolled(key1, key2, x1, x2)


# The override `_platform.lower` applies to the programs it lowers for CPU, through `_compat`.
# One tuple for the whole process: it is part of the compilation cache's key.
FUSED_RULES = ((threefry2x32_p, _hash_for_lowering),)
