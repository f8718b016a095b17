"""A linear function with a custom transpose: the primitive through which `fold` and `scan`
run their own backward (`backward`) under reverse mode.

`jax.custom_derivatives.linear_call` is the public form of this, but its primitive has no
batching rule (so `vmap` of a gradient fails) and no JVP rule for non-zero residual tangents
(so a Hessian fails). The primitive below has all four rules: its transpose *inlines* the
custom transpose as ordinary JAX operations (after which vmap, jvp and jit see plain code), its
JVP stays a call of itself while the residuals have zero tangents (first-order forward mode)
and otherwise differentiates the forward function as plain JAX, and its batching rule vmaps
both functions. Its batching rule is also where the backward is chosen for a stack the batch
does not reach (`unbatched_fallback`).

The JAX internals it needs come from `eqx_lean._compat.primitive_rules`, with its fallback.
"""

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .. import _compat
from .._core.sharding import aval_mesh


def _one_example(x: Any, batched: bool) -> jax.ShapeDtypeStruct:
    """`x`'s shape, dtype and (explicit) sharding, without its leading batch axis if `batched`."""
    aval = jax.typeof(x)
    sharding: Any = getattr(aval, "sharding", None)
    if aval_mesh(x) is None:
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
        mesh = aval_mesh(x)
        if mesh is not None:
            return jax.sharding.use_abstract_mesh(mesh)
    return contextlib.nullcontext()


@functools.cache
def _primitive(rules: _compat.PrimitiveRules) -> Any:
    """The `eqx_lean_linear_call` primitive, defined on first use with `rules`."""
    ad, batching, mlir = rules.ad, rules.batching, rules.mlir
    primitive = rules.Primitive("eqx_lean_linear_call")
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
                _, out_batched = rules.batch_jaxpr(closed, axis_data, [True] * len(batched), False)
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
            _, out_batched = rules.batch_jaxpr(
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
    return _compat.primitive_rules() is not None


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
    rules = _compat.primitive_rules()
    if rules is None:
        return list(fun(*residuals, *linear))
    primitive = _primitive(rules)
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
