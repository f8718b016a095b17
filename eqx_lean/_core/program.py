"""`make_layer` as a traced program: its jaxpr, its closed-over arrays, and a key by content.

Compiled writes are reused whenever the traced program is the same, never because the Python
function is. Python state that `make_layer` reads (a dict value, a module global, a dataclass
field declared `compare=False`) is baked into the trace as literals and parameters, so changing
it changes the program and its key. Arrays it closes over become the jaxpr's constants: their
values are not part of the key but arguments of the compiled write (keyed on shape, dtype and
sharding), so an array mutated in place gives new values, and no cache keeps a reference to
the user's function or arrays. Small constants (at most `EMBED_MAX_BYTES`) are the exception:
they are embedded in the compiled program by value, a copy, keyed on their bytes, exactly as
`jax.jit` embeds the arrays a function closes over; XLA can then fold arithmetic on them as it
does for `jax.jit(eqx.filter_vmap(make_layer))`, which keeps the two bitwise equal.
"""

import functools
import struct
import types
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
from jax.core import Tracer
from jax.extend import core as jcore

from .layout import Layout


class _Identity:
    """A parameter compared by identity (a callable): held, so its `id` cannot be reused."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value


# Parameters of these types are compared by identity: two different functions may compute
# different things whatever their names. (Objects that define no equality of their own, such
# as a callback's wrapper, are compared by identity through their default `==` anyway.)
_FUNCTION_TYPES = (
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    functools.partial,
)


def _number_key(x: Any) -> Hashable:
    # By bits: 0.0 == -0.0 and nan != nan in Python, but they are different programs.
    if isinstance(x, bool | int):
        return (type(x).__name__, x)
    if isinstance(x, float):
        return ("float", struct.pack("<d", x))
    if isinstance(x, complex):
        return ("complex", struct.pack("<dd", x.real, x.imag))
    array = np.asarray(x)
    return ("array", array.dtype.str, array.shape, array.tobytes())


def aval_key(aval: Any) -> Hashable:
    """Everything of an abstract value that its program depends on."""
    return (
        type(aval).__name__,
        tuple(getattr(aval, "shape", ())),
        str(getattr(aval, "dtype", "")),
        bool(getattr(aval, "weak_type", False)),
        _value_key(getattr(aval, "sharding", None)),
        _value_key(getattr(aval, "vma", None)),
    )


def _value_key(value: Any) -> Hashable:
    """A hashable stand-in for an equation parameter, equal exactly when the value is."""
    if value is None or isinstance(value, str | bytes):
        return value
    if isinstance(value, bool | int | float | complex | np.generic | np.ndarray):
        return _number_key(value)
    if isinstance(value, jcore.ClosedJaxpr):
        return ("closed_jaxpr", jaxpr_key(value.jaxpr), tuple(_number_key(c) for c in value.consts))
    if isinstance(value, jcore.Jaxpr):
        return ("jaxpr", jaxpr_key(value))
    if isinstance(value, jax.Array):
        return _number_key(np.asarray(value))
    if isinstance(value, tuple | list):
        return (type(value).__name__, tuple(_value_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _value_key(v)) for k, v in value.items())))
    if isinstance(value, frozenset | set):
        return ("set", frozenset(_value_key(v) for v in value))
    if isinstance(value, _FUNCTION_TYPES):
        return ("identity", _Identity(value))
    try:
        hash(value)
    except TypeError:
        return ("identity", _Identity(value))
    # Dtypes, enums, meshes, shardings, named tuples of such: hashable and compared by value.
    return (type(value).__module__, type(value).__qualname__, value)


def _context_key(eqn: Any) -> Hashable:
    """The settings an equation recorded when it was traced, and is evaluated under again.

    (`threefry_partitionable` among them: the same draw gives other values without it.)
    """
    ctx = getattr(eqn, "ctx", None)
    fields = ("compute_type", "threefry_partitionable", "cur_abstract_mesh", "xla_metadata")
    return tuple(_value_key(getattr(ctx, name, None)) for name in fields)


# Equation parameters that only derivatives use. Compiled writes evaluate a program forward and
# never differentiate it, and every trace makes these functions afresh: keyed by identity, each
# trace of a layer that calls `jax.nn.relu` (a `custom_jvp`) would be a new program.
_DERIVATIVE_ONLY_PARAMS = {
    "custom_jvp_call": frozenset({"jvp_jaxpr_fun", "jvp_jaxpr_thunk"}),
    "custom_vjp_call": frozenset({"fwd_jaxpr_thunk", "bwd", "out_trees"}),
}


def _params_key(eqn: Any) -> Hashable:
    """An equation's parameters by value, less those only its derivatives use."""
    skipped = _DERIVATIVE_ONLY_PARAMS.get(eqn.primitive.name, frozenset())
    return tuple(sorted((k, _value_key(p)) for k, p in eqn.params.items() if k not in skipped))


def jaxpr_key(jaxpr: Any) -> Hashable:
    """The content of a jaxpr, with its variables renamed in order of appearance."""
    names: dict[Any, int] = {}

    def atom(v: Any) -> Hashable:
        if isinstance(v, jcore.Literal):
            return ("literal", _value_key(v.val), aval_key(v.aval))
        if v not in names:
            names[v] = len(names)
        return names[v]

    def binder(v: Any) -> Hashable:
        if isinstance(v, jcore.DropVar):
            return ("drop", aval_key(v.aval))
        return (atom(v), aval_key(v.aval))

    constvars = tuple(binder(v) for v in jaxpr.constvars)
    invars = tuple(binder(v) for v in jaxpr.invars)
    eqns = tuple(
        (
            eqn.primitive.name,
            tuple(atom(v) for v in eqn.invars),
            _params_key(eqn),
            tuple(binder(v) for v in eqn.outvars),
            _value_key(tuple(sorted(map(str, eqn.effects)))),
            _context_key(eqn),
        )
        for eqn in jaxpr.eqns
    )
    outvars = tuple(atom(v) for v in jaxpr.outvars)
    return (constvars, invars, eqns, outvars)


def closed_jaxpr_key(closed: Any) -> Hashable:
    """The content of a closed jaxpr: its program (`jaxpr_key`) and its constants by value."""
    return _value_key(closed)


# Closed-over arrays up to this size are embedded in the compiled writes (see the docstring).
EMBED_MAX_BYTES = 2**20


def _embeds(const: Any) -> bool:
    if isinstance(const, Tracer):
        return False
    return int(np.prod(np.shape(const))) * np.dtype(const.dtype).itemsize <= EMBED_MAX_BYTES


class LayerProgram(NamedTuple):
    """`make_layer` traced once on an abstract key.

    **Attributes:**

    - `jaxpr`: the program from one key to the layer's array leaves (flattened).
    - `consts`: the arrays `make_layer` closes over, the jaxpr's constants, in order.
    - `embedded`: for each constant, whether compiled writes embed it (a copy, keyed by value)
        instead of taking it as an argument.
    - `layout`: the layer's leaves (as `ShapeDtypeStruct`s) and its static part.
    - `key`: the program's content (equations, parameters, literals, the shapes and dtypes of
        its inputs and constants), hashable; equal for two traces of the same program.
    """

    jaxpr: Any
    consts: tuple[Any, ...]
    embedded: tuple[bool, ...]
    layout: Layout
    key: Hashable

    def argument_consts(self) -> tuple[Any, ...]:
        """The constants compiled writes take as arguments (those not embedded)."""
        return tuple(c for c, e in zip(self.consts, self.embedded, strict=True) if not e)

    def embedded_values(self) -> tuple[np.ndarray | None, ...]:
        """Host copies of the embedded constants (`None` in place of an argument)."""
        return tuple(
            np.array(c) if e else None for c, e in zip(self.consts, self.embedded, strict=True)
        )

    def argument_structs(self, sharding: Any = None) -> tuple[jax.ShapeDtypeStruct, ...]:
        return tuple(
            jax.ShapeDtypeStruct(np.shape(c), c.dtype, sharding=sharding)
            for c in self.argument_consts()
        )


_TRACING_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
)


def trace_layer(make_layer: Callable[[Any], Any], key: jax.ShapeDtypeStruct) -> LayerProgram:
    """Traces `make_layer` on an abstract key, freshly each call (see the module docstring).

    JAX's own trace cache is keyed on the function object, so a wrapper made for this call is
    traced, never `make_layer` itself: every call sees the Python state of its moment.
    """
    statics = []

    def dynamic_part(k: Any) -> list[Any]:
        layer = make_layer(k)
        dynamic, static = eqx.partition(layer, eqx.is_array)
        statics.append((static, jax.tree.structure(dynamic)))
        return jax.tree.leaves(dynamic)

    try:
        closed, shapes = jax.make_jaxpr(dynamic_part, return_shape=True)(key)
    except _TRACING_ERRORS as e:
        raise TypeError(
            f"`make_layer` failed when called on a traced key ({type(e).__name__}). "
            "`make_layer` must be traceable: it is called under `jax.jit` with an abstract key, so "
            "it must build the layer with JAX operations only (no `int(key)`, `np.asarray(key)`, "
            "or Python control flow on the key's values)."
        ) from e
    except TypeError as e:
        if isinstance(make_layer, type):
            raise TypeError(
                f"`make_layer` must be a function of one key that returns a layer, such as "
                f"`lambda key: {make_layer.__name__}(config, key=key)`; calling the class "
                f"{make_layer.__name__} with the key alone failed: {e}"
            ) from e
        raise
    static, treedef = statics[0]
    abstract = eqx.combine(jax.tree.unflatten(treedef, shapes), static)
    layout = Layout.of(abstract)
    consts = tuple(closed.consts)
    embedded = tuple(_embeds(c) for c in consts)
    const_keys = tuple(
        _number_key(np.asarray(c)) if e else (np.shape(c), str(c.dtype))
        for c, e in zip(consts, embedded, strict=True)
    )
    program_key = (jaxpr_key(closed.jaxpr), const_keys, aval_key(key))
    return LayerProgram(closed.jaxpr, consts, embedded, layout, program_key)


def has_tracers(*trees: Any) -> bool:
    """Whether any leaf of `trees` is a tracer, or a trace (`jit`, `eval_shape`...) is active.

    The public test for "am I being traced": a fresh array is a tracer under `jit` and
    `eval_shape` but not under `vmap` or `grad`, whose tracers show only in their inputs.
    """
    leaves = jax.tree.leaves(trees)
    if any(isinstance(x, Tracer) for x in leaves):
        return True
    return isinstance(jax.numpy.zeros(()), Tracer)
