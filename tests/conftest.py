import jax
import pytest


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    """Returns a function producing fresh, distinct keys; mirrors Equinox's own fixture."""
    counter = iter(range(2**31))
    return lambda: jax.random.key(next(counter))


class CompileCounter:
    """Counts XLA backend compilations (through `jax.monitoring`)."""

    def __init__(self):
        self.count = 0

    def __call__(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


@pytest.fixture
def compiles():
    """A `CompileCounter` listening while the test runs."""
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    yield counter
    jax.monitoring.unregister_event_duration_listener(counter)
