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
from typing import Any

import jax


# The JAX releases whose private APIs below were read and tested (major, minor).
TESTED_JAX_SERIES = (0, 10)

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

# Where JAX releases have kept `shard_alike` (public but experimental: JAX 0.10 has it in
# `jax.experimental.shard_alike`; JAX 0.11.2, as installed on the GPU machine of 2026-11-25,
# does not, and `import eqx_lean` failed there).
_SHARD_ALIKE_HOMES = ("jax.experimental.shard_alike", "jax.sharding", "jax.lax", "jax")


@functools.cache
def _find_shard_alike() -> Callable[[Any, Any], tuple[Any, Any]] | None:
    for module in _SHARD_ALIKE_HOMES:
        try:
            found = getattr(importlib.import_module(module), "shard_alike", None)
        except ImportError:
            continue
        if found is not None:
            return found
    return None


def shard_alike(x: Any, y: Any) -> tuple[Any, Any]:
    """JAX's `shard_alike(x, y)`: `(x, y)`, with the partitioner told to shard them alike.

    On a single device there is nothing to tie and `(x, y)` is returned as they are; on several
    devices a JAX without `shard_alike` is an error (it cannot be emulated: the sharding it
    ties is known only to the compiler).
    """
    found = _find_shard_alike()
    if found is not None:
        return found(x, y)
    if jax.device_count() == 1:
        return x, y
    raise NotImplementedError(
        f"eqx_lean needs `shard_alike` to place a sharded stack's gradient, and JAX "
        f"{jax.__version__} has none in {', '.join(_SHARD_ALIKE_HOMES)}; use JAX 0.10."
    )


# --- lowering-rule overrides ------------------------------------------------------------------


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


# --- linear functions with a custom transpose -------------------------------------------------
#
# `jax.custom_derivatives.linear_call` is the public form of this, but its primitive has no
# batching rule (so `vmap` of a gradient fails) and no JVP rule for non-zero residual tangents
# (so a Hessian fails). The primitive below has all four rules: its transpose *inlines* the
# custom transpose as ordinary JAX operations (after which vmap, jvp and jit see plain code),
# its JVP stays a call of itself while the residuals have zero tangents (first-order forward
# mode) and otherwise differentiates the forward function as plain JAX, and its batching rule
# vmaps both functions.


def _one_example(x: Any, batched: bool) -> jax.ShapeDtypeStruct:
    """`x`'s shape, dtype and (explicit) sharding, without its leading batch axis if `batched`."""
    aval = jax.typeof(x)
    sharding: Any = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        sharding = None
    elif batched:
        spec = tuple(sharding.spec) + (None,) * (aval.ndim - len(sharding.spec))
        sharding = sharding.update(spec=jax.sharding.PartitionSpec(*spec[1:]))
    shape = aval.shape[1:] if batched else aval.shape
    return jax.ShapeDtypeStruct(shape, aval.dtype, sharding=sharding)


def _mesh_of_operands(operands: Sequence[Any]) -> Any:
    """A context setting the abstract mesh the operands' shardings name, if none is set."""
    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    for x in operands:
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty:
            return jax.sharding.use_abstract_mesh(mesh)
    return contextlib.nullcontext()


@functools.cache
def _custom_transpose_primitive() -> Any | None:
    """The `eqx_lean_linear_call` primitive, defined on first use; `None` if JAX lacks the API."""
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

    primitive = Primitive("eqx_lean_linear_call")
    primitive.multiple_results = True

    def impl(*args: Any, fun: Callable[..., Any], **_: Any) -> list[Any]:
        return list(fun(*args))

    def abstract_eval(*args: Any, out_avals: tuple[Any, ...], **_: Any) -> list[Any]:
        del args
        return list(out_avals)

    def bind(args: Sequence[Any], **params: Any) -> list[Any]:
        return primitive.bind(*args, **params)

    def jvp(primals: Sequence[Any], tangents: Sequence[Any], **params: Any) -> Any:
        num_res, out_avals = params["num_res"], params["out_avals"]
        primals_out = bind(primals, **params)
        res_dots, lin_dots = tangents[:num_res], tangents[num_res:]
        if all(type(t) is ad.Zero for t in res_dots):
            if all(type(t) is ad.Zero for t in lin_dots):
                return primals_out, [ad.Zero(a.to_tangent_aval()) for a in out_avals]
            lin_dots = [ad.instantiate_zeros(t) for t in lin_dots]
            return primals_out, bind([*primals[:num_res], *lin_dots], **params)
        # Tangents on the residuals (second-order forward mode): the forward function as plain
        # JAX. Correct; its transpose, if any, is then JAX's own rather than the custom one.
        dots = [ad.instantiate_zeros(t) for t in tangents]
        _, tangents_out = jax.jvp(lambda *a: list(params["fun"](*a)), list(primals), dots)
        return primals_out, tangents_out

    def transpose(cts: Sequence[Any], *args: Any, **params: Any) -> list[Any]:
        num_res = params["num_res"]
        res = args[:num_res]
        assert not any(ad.is_undefined_primal(r) for r in res)
        assert all(ad.is_undefined_primal(x) for x in args[num_res:])
        cts = [ad.instantiate_zeros(ct) for ct in cts]
        lin_cts = params["transpose"](*res, *cts)
        return [None] * num_res + list(lin_cts)

    def batch(axis_data: Any, args: Sequence[Any], dims: Sequence[Any], **params: Any) -> Any:
        num_res, size = params["num_res"], axis_data.size
        if all(d is None for d in dims):  # JAX calls the rule for unbatched operands too
            out = bind(args, **params)
            return out, [None] * len(out)
        fallback = params["unbatched_fallback"]
        if fallback is not None and any(d is None for d in dims[num_res:]):
            # A linear input the batch does not reach (a stack that the vmapped function closes
            # over): batching the custom transpose would give one cotangent of it per example,
            # summed only afterwards. JAX's own derivative of `fallback` sums as it goes.
            # Unbatched operands are closed over, not passed with `in_axes=None`: with Explicit
            # mesh axes, vmap refuses unmapped arguments sharded over the axis it maps.
            batched = [
                jax.numpy.moveaxis(a, d, 0)
                for a, d in zip(args, dims, strict=True)
                if d is not None
            ]

            def of_batched(*values: Any) -> Any:
                supply = iter(values)
                full = [a if d is None else next(supply) for a, d in zip(args, dims, strict=True)]
                return list(fallback(*full))

            # Which outputs the batch reaches (see below): those are mapped, the others not.
            with _mesh_of_operands(args):
                closed = jax.make_jaxpr(of_batched)(*[_one_example(a, True) for a in batched])
                _, out_batched = batching_internals.batch_jaxpr(
                    closed, axis_data, [True] * len(batched), False
                )
            out_axes = [0 if b else None for b in out_batched]
            vmapped = jax.vmap(
                of_batched,
                in_axes=0,
                out_axes=out_axes,
                axis_name=axis_data.name,
                axis_size=size,
                spmd_axis_name=axis_data.spmd_name,
            )
            return list(vmapped(*batched)), out_axes
        args = [
            a if d is None else jax.numpy.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True)
        ]
        res_batched = [d is not None for d in dims[:num_res]]
        # Every linear input batched, so that every cotangent is: broadcasting an unbatched one
        # happens outside the primitive, where JAX transposes it (to a sum over the batch).
        lin = [
            a if d is not None else jax.numpy.broadcast_to(a, (size, *jax.numpy.shape(a)))
            for a, d in zip(args[num_res:], dims[num_res:], strict=True)
        ]
        # Which outputs the batch reaches (a collective over the axis, as in batch norm, can
        # leave an output unbatched): a `custom_jvp` gives the primal output the tangent's
        # batching, so a needlessly batched tangent would batch a primal that is not.
        per_example = [
            _one_example(a, b)
            for a, b in zip(
                [*args[:num_res], *lin], [*res_batched, *([True] * len(lin))], strict=True
            )
        ]
        # Traced and batched under the operands' mesh: with Explicit axes, avals carry
        # shardings on it, and batching them outside that context fails.
        with _mesh_of_operands(args):
            closed = jax.make_jaxpr(params["fun"])(*per_example)
            _, out_batched = batching_internals.batch_jaxpr(
                closed, axis_data, (*res_batched, *([True] * len(lin))), False
            )
        out_axes = [0 if b else None for b in out_batched]
        vmap = functools.partial(
            jax.vmap,
            axis_name=axis_data.name,
            axis_size=size,
            spmd_axis_name=axis_data.spmd_name,
        )
        res_axes = [0 if b else None for b in res_batched]
        fun = vmap(params["fun"], in_axes=(*res_axes, *([0] * len(lin))), out_axes=out_axes)
        transpose = vmap(params["transpose"], in_axes=(*res_axes, *out_axes))
        out_avals = tuple(
            a.update(shape=(size, *a.shape)) if b else a
            for a, b in zip(params["out_avals"], out_batched, strict=True)
        )
        out = bind(
            [*args[:num_res], *lin],
            fun=fun,
            transpose=transpose,
            num_res=num_res,
            out_avals=out_avals,
            unbatched_fallback=None,
        )
        return out, out_axes

    primitive.def_impl(impl)
    primitive.def_abstract_eval(abstract_eval)
    ad.primitive_jvps[primitive] = jvp
    ad.primitive_transposes[primitive] = transpose
    batching.fancy_primitive_batchers[primitive] = batch
    mlir.register_lowering(primitive, mlir.lower_fun(impl, multiple_results=True))
    return primitive


def has_custom_transpose() -> bool:
    """Whether `linear_call_with_transpose` uses its custom transpose on this JAX."""
    return private_jax_allowed() and _custom_transpose_primitive() is not None


def linear_call_with_transpose(
    fun: Callable[..., Sequence[Any]],
    transpose: Callable[..., Sequence[Any]],
    residuals: Sequence[Any],
    linear: Sequence[Any],
    out_like: Sequence[Any],
    unbatched_fallback: Callable[..., Sequence[Any]] | None = None,
) -> list[Any]:
    """Returns `fun(*residuals, *linear)`, a linear function of `linear` whose transpose is
    `transpose(*residuals, *cotangents)`.

    Reverse-mode differentiation (`grad`, `vjp`) of code that calls this runs `transpose`
    in place of the transpose JAX would derive from `fun`; forward mode (`jvp`, `jacfwd`) runs
    `fun`. Both must be written in JAX and agree (be transposes of each other), as for
    `jax.custom_derivatives.linear_call`.

    Fallback (another JAX series, or private JAX forced off): `fun` is called directly and JAX
    derives its transpose: the same values up to float rounding (the two transposes may sum
    in another order), at the memory cost of JAX's own transpose.

    **Arguments:**

    - `fun`: `fun(*residuals, *linear) -> outputs`, a sequence of arrays linear in `linear`.
    - `transpose`: `transpose(*residuals, *cotangents) -> linear cotangents`, one cotangent
        per output and one result per element of `linear`, with its shape and dtype.
    - `residuals`: arrays `fun` is not linear in; they are never differentiated here (a
        tangent on them is handled by differentiating `fun` as plain JAX).
    - `linear`: arrays of an inexact dtype.
    - `out_like`: one array (or tracer) per output of `fun` with that output's shape, dtype
        and (explicit) sharding, e.g. the primal value whose tangent the output is.
    - `unbatched_fallback`: optionally, `fun` again in a form whose transpose JAX derives well
        (`fallback(*residuals, *linear)`); under `vmap` with a linear input that is not batched
        it is called instead, and differentiated by JAX.

    **Returns:**

    The outputs of `fun`, as a list.
    """
    primitive = _custom_transpose_primitive() if private_jax_allowed() else None
    if primitive is None:
        return list(fun(*residuals, *linear))
    out_avals = tuple(jax.typeof(x).to_tangent_aval() for x in out_like)
    return primitive.bind(
        *residuals,
        *linear,
        fun=fun,
        transpose=transpose,
        num_res=len(residuals),
        out_avals=out_avals,
        unbatched_fallback=unbatched_fallback,
    )
