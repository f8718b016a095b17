"""Threefry lowered as straight-line code, so that a random draw fuses into what consumes it.

JAX lowers its Threefry hash (`threefry2x32_p`, behind every `jax.random` draw with the default
implementation) as a rolled `fori_loop` on CPU, to keep compile times down. The loop's state is
two arrays as large as the draw, and XLA cannot fuse a loop with its consumer: a draw of `n`
float32 values therefore needs about `4 n` x 4 bytes of temporaries (both halves of the counter
going in, both halves of the state, the bits coming out). Unrolled, as JAX lowers it on every
other platform, the hash is elementwise arithmetic on an iota, which XLA fuses with the
conversion to floats, the cast and the in-place `dynamic_update_slice` of `build_stacked`'s
writes: the draw needs no temporaries at all, and runs 2.6x (normal) to 6x (uniform) faster.

Only draws are unrolled. Key arithmetic (`split`, `fold_in`: a few counters) stays a loop, so
that it is computed once instead of being fused into, and recomputed for each element of, the
draw it keys.

The values are the same bit for bit (it is the same integer arithmetic); only the lowering
differs. The override is scoped to the programs lowered through `lower`, never global.
"""

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p
from jax.interpreters import mlir
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
    it out, which it does or not depending on unrelated constants: a Mistral-7B MLP write of
    3 layers took 7 s instead of 0.5 s for 2. A loop cannot be fused (an optimisation barrier
    did not stop XLA:CPU), so as a loop it is computed once, as with JAX's own lowering.
    """
    if x1.size >= _FUSED_MIN_COUNTERS:
        return threefry2x32_unrolled(key1, key2, x1, x2)
    return _threefry2x32_rolled(key1, key2, x1, x2)


def _lowering_parameters() -> Any | None:
    """Parameters that make `_hash_for_lowering` Threefry's rule; `None` where JAX has no hook.

    `Traced.lower(_private_parameters=...)` is how `jax.export` passes its own lowering rules; it
    is not public API, so a JAX without it (or without these classes) lowers as usual: the same
    values, with JAX's temporaries.
    """
    if "_private_parameters" not in inspect.signature(jax.stages.Traced.lower).parameters:
        return None
    try:
        rule = mlir.lower_fun(_hash_for_lowering, multiple_results=True)
        return mlir.LoweringParameters(override_lowering_rules=((threefry2x32_p, rule),))
    except (AttributeError, TypeError):
        return None


# One object for the whole process: it is part of the compilation cache's key.
_PARAMETERS = _lowering_parameters()


def fuses_threefry() -> bool:
    """Whether `lower` can lower Threefry unrolled with this JAX."""
    return _PARAMETERS is not None


def lower(traced: jax.stages.Traced) -> jax.stages.Lowered:
    """Lowers a traced program with Threefry unrolled, so its draws fuse into their consumers.

    Only the lowering changes: the random values are bitwise those of the default lowering.
    Compiled programs are cached as usual (the override is part of the cache key).

    **Arguments:**

    - `traced`: the result of `jax.jit(f).trace(*args)`.

    **Returns:**

    The `jax.stages.Lowered` program, ready for `.compile()`.
    """
    if _PARAMETERS is None:
        return traced.lower()
    return traced.lower(_private_parameters=_PARAMETERS)
