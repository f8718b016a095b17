"""Every use of private JAX API in eqx_lean, each version-gated, each with a public fallback.

A private API is used only on the JAX series it was tested with (`TESTED_JAX_SERIES`) and only
where it is found; anywhere else the fallback runs: the same values (bit for bit unless the
accessor's docstring says otherwise), at a cost in memory or speed that the docstring states.
`EQX_LEAN_NO_PRIVATE_JAX=1` in the environment (read at import) or `without_private_jax()` (for
tests) forces every fallback.
"""

import contextlib
import functools
import importlib
import inspect
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax


# The JAX releases whose private APIs below were read and tested (major, minor).
TESTED_JAX_SERIES = (0, 10)

# The newest JAX series whose sources docs/jax-compat.md was read from (major, minor):
# `pyproject.toml` admits JAX and jaxlib up to this series and not the next one
# (tests/test_compat.py checks that the two agree).
NEWEST_JAX_SERIES_READ = (0, 11)

# Test seam: `EQX_LEAN_NO_PRIVATE_JAX` (tests/test_compat.py) and `without_private_jax` (the tests
# of every fallback) force the fallbacks; tests/test_compat.py also patches `jax.__version_info__`.
_forced_off = os.environ.get("EQX_LEAN_NO_PRIVATE_JAX", "") not in ("", "0")


def private_jax_allowed() -> bool:
    """Whether private JAX APIs may be used: the tested JAX series, and not forced off."""
    return not _forced_off and tuple(jax.__version_info__[:2]) == TESTED_JAX_SERIES


@contextlib.contextmanager
def without_private_jax() -> Iterator[None]:
    """Within the block, every accessor here takes its public fallback (for tests)."""
    global _forced_off
    before = _forced_off
    _forced_off = True
    try:
        yield
    finally:
        _forced_off = before


# --- shard_alike --------------------------------------------------------------------------------

# Where JAX releases keep `shard_alike`, in order. In every JAX source read for
# docs/jax-compat.md (jax-v0.10.2, jax-v0.11.0 and jax-ml/jax@cec06d1, 0.11.1.dev) its one public
# home is `jax.experimental.shard_alike` (line 16, re-exporting `jax._src.shard_alike`, line 31);
# yet JAX 0.11.2, as installed on the GPU machine of 2026-11-25, had none there and
# `import eqx_lean` failed (0.11.2's sources were not reachable to say where it went). The other
# public names are where JAX has moved experimental sharding APIs before (CHANGELOG.md line 570
# at cec06d1: `jax.experimental.shard` went to `jax.sharding`).
# Test seam: tests/test_compat.py fakes each home and clears the cache of `_find_shard_alike`.
_SHARD_ALIKE_HOMES = ("jax.experimental.shard_alike", "jax.sharding", "jax.lax", "jax")

# The private module that defines `shard_alike` in every release read: searched after the public
# homes, and only where private JAX is allowed.
# Test seam: tests/test_compat.py fakes it.
_SHARD_ALIKE_PRIVATE_HOME = "jax._src.shard_alike"


@functools.cache
def _find_shard_alike(private: bool = False) -> Callable[[Any, Any], tuple[Any, Any]] | None:
    homes = _SHARD_ALIKE_HOMES + ((_SHARD_ALIKE_PRIVATE_HOME,) if private else ())
    for module in homes:
        try:
            found = getattr(importlib.import_module(module), "shard_alike", None)
        except ImportError:
            continue
        if found is not None:
            return found
    return None


def shard_alike(x: Any, y: Any) -> tuple[Any, Any]:
    """JAX's `shard_alike(x, y)`: `(x, y)`, with the partitioner told to shard them alike.

    Found in the first of `_SHARD_ALIKE_HOMES` that has it; where none does, in the private
    module that defines it (`_SHARD_ALIKE_PRIVATE_HOME`), where private JAX is allowed.

    Fallback (no home has it): on a single device there is nothing to tie and `(x, y)` is
    returned as they are; on several devices it is an error (it cannot be emulated: the sharding
    it ties is known only to the compiler).
    """
    found = _find_shard_alike(private_jax_allowed())
    if found is not None:
        return found(x, y)
    if jax.device_count() == 1:
        return x, y
    raise NotImplementedError(
        f"eqx_lean needs `shard_alike` to place a sharded stack's gradient, and JAX "
        f"{jax.__version__} has none in {', '.join(_SHARD_ALIKE_HOMES)}; use JAX 0.10 "
        "(docs/jax-compat.md)."
    )


# --- lowering-rule overrides ------------------------------------------------------------------


# Test seam: tests/test_compat.py clears its cache after hiding `jax.interpreters.mlir`.
@functools.cache
def _lowering_api() -> Any | None:
    """JAX's `mlir` module if it has what overriding lowering rules takes; `None` otherwise.

    `Traced.lower(_private_parameters=...)` is how `jax.export` passes its own lowering rules;
    `mlir.lower_fun` turns a JAX function into a lowering rule. Neither is public API.
    """
    if "_private_parameters" not in inspect.signature(jax.stages.Traced.lower).parameters:
        return None
    try:
        from jax.interpreters import mlir
    except ImportError:
        return None
    if not (hasattr(mlir, "lower_fun") and hasattr(mlir, "LoweringParameters")):
        return None
    return mlir


# One `LoweringParameters` per set of rules for the whole process: JAX's compilation cache keys
# on the object, so a fresh one per call would compile every program again.
@functools.cache
def _override_parameters(rules: tuple[tuple[Any, Callable[..., Any]], ...]) -> Any:
    mlir = _lowering_api()
    assert mlir is not None
    lowered = tuple((p, mlir.lower_fun(fn, multiple_results=True)) for p, fn in rules)
    return mlir.LoweringParameters(override_lowering_rules=lowered)


def can_override_lowering() -> bool:
    """Whether `lower_with_overrides` applies its rules on this JAX (else it lowers as usual)."""
    return private_jax_allowed() and _lowering_api() is not None


def lower_with_overrides(
    traced: jax.stages.Traced,
    rules: Sequence[tuple[Any, Callable[..., Any]]],
    lowering_platforms: tuple[str, ...] | None = None,
) -> jax.stages.Lowered:
    """Lowers `traced` with each primitive in `rules` lowered as the given JAX function.

    Fallback (another JAX series, or private JAX forced off): `traced.lower()`, JAX's own rules.
    Callers must only pass rules that compute the same values as JAX's, so that both paths agree.

    **Arguments:**

    - `traced`: the result of `jax.jit(f).trace(*args)`.
    - `rules`: pairs `(primitive, function)`; the function takes and returns the primitive's
        operands and results as a sequence (`multiple_results=True`). Pass the same function
        objects every time: they are part of the compilation cache's key.
    - `lowering_platforms`: as for `jax.stages.Traced.lower`.

    **Returns:**

    The `jax.stages.Lowered` program.
    """
    if not can_override_lowering():
        return traced.lower(lowering_platforms=lowering_platforms)
    parameters = _override_parameters(tuple(rules))
    return traced.lower(lowering_platforms=lowering_platforms, _private_parameters=parameters)


# --- defining a primitive ----------------------------------------------------------------------


class PrimitiveRules(NamedTuple):
    """The JAX internals that define a new primitive and its JVP, transpose, batching and
    lowering rules (`eqx_lean._scan.linear_call` defines one)."""

    Primitive: Any  # `jax.extend.core.Primitive`
    ad: Any  # `jax.interpreters.ad`: `primitive_jvps`, `primitive_transposes`, `Zero`, ...
    batching: Any  # `jax.interpreters.batching`: `fancy_primitive_batchers`
    batch_jaxpr: Callable[..., Any]  # `jax._src.interpreters.batching.batch_jaxpr`
    mlir: Any  # `jax.interpreters.mlir`: `register_lowering`, `lower_fun`


@functools.cache
def _find_primitive_rules() -> PrimitiveRules | None:
    try:
        from jax._src.interpreters import batching as batching_internals
        from jax.extend.core import Primitive
        from jax.interpreters import ad, batching, mlir
    except ImportError:
        return None
    required = (
        (ad, ("primitive_jvps", "primitive_transposes", "Zero", "instantiate_zeros")),
        (ad, ("is_undefined_primal",)),
        (batching, ("fancy_primitive_batchers",)),
        (batching_internals, ("batch_jaxpr",)),
        (mlir, ("register_lowering", "lower_fun")),
    )
    if not all(hasattr(module, name) for module, names in required for name in names):
        return None
    return PrimitiveRules(Primitive, ad, batching, batching_internals.batch_jaxpr, mlir)


def primitive_rules() -> PrimitiveRules | None:
    """The internals that define a primitive with custom rules; `None` where private JAX is
    not allowed or this JAX lacks one of them.

    Fallback: the caller's (`eqx_lean._scan.linear_call` then calls its function directly and
    lets JAX derive the transpose).
    """
    return _find_primitive_rules() if private_jax_allowed() else None


# --- refusing a type as a JAX value -------------------------------------------------------------


def refuse_as_jax_value(cls: type, refusal: Callable[[Any], Exception]) -> bool:
    """Has JAX raise `refusal(x)` when a primitive (`jax.lax.dot`, `jax.lax.add`, ...) is given
    an `x` of type `cls`, by JAX's handler of how an argument becomes a JAX value
    (`jax._src.dtypes.register_canonicalize_value_handler`, not public). JAX raises it as the
    cause of its own "Error interpreting argument to dot_general as a JAX value", so a
    traceback shows the caller's sentence. Registered once, at import: `without_private_jax`
    does not undo it. Returns whether it was registered.

    Fallback: none registered; JAX's own `TypeError` (the argument's type "is not a valid JAX
    type").
    """
    if not private_jax_allowed():
        return False
    try:
        from jax._src import dtypes
    except ImportError:
        return False
    register = getattr(dtypes, "register_canonicalize_value_handler", None)
    if register is None:
        return False

    def handler(x: Any) -> Any:
        raise refusal(x)

    register(cls, handler)
    return True
