"""Run by `tests/test_targets.py` with no `JAX_*` variable in its environment: asks for the
compile-only target `8xh100` and prints the `RuntimeError` it raises, which must name the
variable to set (`JAX_PLATFORMS=cpu`).

Its own process, because the variable counts only when set before JAX's first computation, and
the suite's process starts with `JAX_PLATFORMS=cpu` (tests/conftest.py).

    env -u JAX_PLATFORMS python tests/workers/gpu_target_unconfigured.py
"""

import eqx_lean


def main() -> None:
    try:
        eqx_lean.memory.target("8xh100")
    except RuntimeError as error:
        print(error)


if __name__ == "__main__":
    main()
