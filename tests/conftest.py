import jax
import pytest


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    """Returns a function producing fresh, distinct keys; mirrors Equinox's own fixture."""
    counter = iter(range(2**31))
    return lambda: jax.random.key(next(counter))
