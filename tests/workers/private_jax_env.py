"""Run by `tests/test_compat.py` with `EQX_LEAN_NO_PRIVATE_JAX` set: builds a stack of two
random draws large enough for the unrolled hash, and prints whether the private lowering hook is
in use and the stack's sum (`True 123.4`).

Its own process, because the variable is read once, when `eqx_lean` is first imported: the
suite's process imported it long before.

    EQX_LEAN_NO_PRIVATE_JAX=1 python tests/workers/private_jax_env.py
"""

import jax

import eqx_lean
from eqx_lean.internal import can_override_lowering


def main() -> None:
    keys = jax.random.split(jax.random.key(0), 2)
    # 256 x 300 >= 2**16 counters: the unrolled hash, where the hook is allowed.
    built = eqx_lean.build_stacked(lambda k: jax.random.normal(k, (256, 300)), keys)
    print(can_override_lowering(), float(built.sum()))


if __name__ == "__main__":
    main()
