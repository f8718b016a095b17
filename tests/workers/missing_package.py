"""Run by `tests/test_docs.py` with one argument, `optax` or `tqdm`: hides that package from
imports, then makes the call that needs it, which must fail with an `ImportError` naming the
checkout's extra that installs it (the test reads the traceback on stderr).

Its own process, because a package hidden through `sys.modules` stays hidden, and one already
imported stays imported, for the rest of the process: the suite's process has both.

    PYTHONPATH=. python tests/workers/missing_package.py optax|tqdm
"""

import sys


def hide(*modules: str) -> None:
    """`import` of each of `modules` raises `ImportError` from now on: `None` in `sys.modules`
    is Python's documented way to say so."""
    for module in modules:
        sys.modules[module] = None  # pyright: ignore[reportArgumentType]


def train_without_optax() -> None:
    hide("optax")
    from examples.mistral7b.train import adamw

    adamw()


def progress_without_tqdm() -> None:
    hide("tqdm", "tqdm.auto")
    import equinox as eqx
    import jax

    import eqx_lean

    keys = jax.random.split(jax.random.key(0), 2)
    eqx_lean.build_stacked(lambda k: eqx.nn.Linear(2, 2, key=k), keys, progress=True)


CALLS = {"optax": train_without_optax, "tqdm": progress_without_tqdm}


if __name__ == "__main__":
    CALLS[sys.argv[1]]()
