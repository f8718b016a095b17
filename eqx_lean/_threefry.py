"""Threefry lowered as straight-line code, so that a random draw fuses into what consumes it.

JAX lowers its Threefry hash (`threefry2x32_p`, behind every `jax.random` draw with the default
implementation) as a rolled `fori_loop` on CPU, to keep compile times down. The loop's state is
two arrays as large as the draw, and XLA cannot fuse a loop with its consumer: a draw of `n`
float32 values therefore needs about `4 n` x 4 bytes of temporaries (both halves of the counter
going in, both halves of the state, the bits coming out). Unrolled, as JAX lowers it on every
other platform, the hash is elementwise arithmetic on an iota, which XLA fuses with the
conversion to floats, the cast and the in-place `dynamic_update_slice` of `build_stacked`'s
writes: the draw needs no temporaries at all, and runs about three times faster.

The values are the same bit for bit (it is the same integer arithmetic); only the lowering
differs. The override is scoped to the programs lowered through `lower`, never global.
"""

import inspect

import jax
import numpy as np
from jax.extend.random import threefry2x32_p
from jax.interpreters import mlir
from jaxtyping import Array


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x: Array, bits: int) -> Array:
    return (x << np.uint32(bits)) | (x >> np.uint32(32 - bits))


def threefry2x32_unrolled(key1: Array, key2: Array, x1: Array, x2: Array) -> tuple[Array, Array]:
    """Threefry-2x32 with 20 rounds (Salmon et al., 2011), as JAX computes it, without a loop.

    **Arguments:**

    - `key1`, `key2`: the two 32-bit words of the key (`uint32`, broadcastable to the counts).
    - `x1`, `x2`: the two 32-bit words of each counter (`uint32`).

    **Returns:**

    The two hashed words, each of the counters' shape.
    """
    keys = (key1, key2, key1 ^ key2 ^ _KEY_PARITY)
    x1, x2 = x1 + keys[0], x2 + keys[1]
    for block in range(5):
        for rotation in _ROTATIONS[block % 2]:
            x1 = x1 + x2
            x2 = _rotate_left(x2, rotation) ^ x1
        # Key injection after every four rounds: the key schedule rotates by one word each time.
        x1 = x1 + keys[(block + 1) % 3]
        x2 = x2 + keys[(block + 2) % 3] + np.uint32(block + 1)
    return x1, x2


_UNROLLED_RULE = mlir.lower_fun(threefry2x32_unrolled, multiple_results=True)
_PARAMETERS = mlir.LoweringParameters(override_lowering_rules=((threefry2x32_p, _UNROLLED_RULE),))


def _can_override_lowering() -> bool:
    # `Traced.lower(_private_parameters=...)` is how `jax.export` passes its lowering rules; it
    # is not public API, so a JAX without it lowers as usual (same values, more temporaries).
    return "_private_parameters" in inspect.signature(jax.stages.Traced.lower).parameters


FUSES_THREEFRY = _can_override_lowering()


def lower(traced: jax.stages.Traced) -> jax.stages.Lowered:
    """Lowers a traced program with Threefry unrolled, so its draws fuse into their consumers.

    Only the lowering changes: the random values are bitwise those of the default lowering.
    Compiled programs are cached as usual (the override is part of the cache key).

    **Arguments:**

    - `traced`: the result of `jax.jit(f).trace(*args)`.

    **Returns:**

    The `jax.stages.Lowered` program, ready for `.compile()`.
    """
    if not FUSES_THREEFRY:
        return traced.lower()
    return traced.lower(_private_parameters=_PARAMETERS)
