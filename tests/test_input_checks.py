"""Bad inputs refused up front, each with a sentence naming the argument, what it must be and
what it was (issue 41, the walls a new user hits): a `QuantizedArray` used as an array, int8
`quantize` of empty tensors and non-finite values (bitsandbytes' `int8_vectorwise_quant` is the
oracle), bools as sizes, a tuple of separate layers given to `fold` and `scan`, and
compilation-cache directories that are no directory or that other users can write in.

Nearly nothing here compiles: the refusals come before any tracing, layers are NumPy arrays,
and the quantisers run on three small shapes.
"""

import os
import stat
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import REPO

import eqx_lean
from eqx_lean.quant import QuantConfig, quantize


def _ones(*shape: int) -> jax.Array:
    return jax.device_put(np.ones(shape, np.float32))  # a transfer: no program compiled


def _zeros(*shape: int) -> jax.Array:
    return jax.device_put(np.zeros(shape, np.float32))


# --- a QuantizedArray used as an array ------------------------------------------------------


@pytest.fixture(scope="module")
def weight():
    return quantize(_ones(8, 64), name="w")


_MISUSES = {
    ".T": lambda q: q.T,
    ".mT": lambda q: q.mT,
    ".reshape": lambda q: q.reshape(-1),
    ".astype": lambda q: q.astype(jnp.float32),
    "**": lambda q: q**2,
    "-q": lambda q: -q,
    "<": lambda q: q < 0,
    ">=": lambda q: q >= 0,
    "== a number": lambda q: q == 0,
    "!= an array": lambda q: q != np.zeros((8, 64)),
    "len": len,
    "float": float,
    "int": int,
    "bool": bool,
    "iter": list,
    "[0]": lambda q: q[0],
    "q @ x": lambda q: q @ _ones(64),
    "x @ q": lambda q: _ones(8) @ q,
    "jnp.asarray": jnp.asarray,
    "np.asarray": np.asarray,
    "jnp.dot": lambda q: jnp.dot(q, _ones(64)),
    "jax.lax.dot": lambda q: jax.lax.dot(q, _ones(64)),
}


# `jax.lax.dot` names the quantised weight through the private lowering hook (the message is
# JAX's own without it).
@pytest.mark.parametrize(
    "use",
    [pytest.param(u, marks=pytest.mark.private_jax) if u == "jax.lax.dot" else u for u in _MISUSES],
)
def test_a_quantized_array_used_as_an_array_says_what_it_supports(weight, use):
    with pytest.raises(TypeError) as refused:
        _MISUSES[use](weight)
    # JAX's primitives wrap the sentence in their own ("Error interpreting argument to
    # dot_general as a JAX value"), caused by it, which a traceback shows first.
    error = refused.value if use != "jax.lax.dot" else refused.value.__cause__
    message = str(error)
    assert isinstance(error, TypeError), message
    assert "is not supported: `w` is a nf4-quantised weight of shape (8, 64), not an array" in (
        message
    )
    assert "supports only `.dequantize(dtype)`" in message, message
    assert "dense array" in message, message


def test_a_jax_primitive_refuses_a_quantized_array_on_every_path(weight):
    # Where the private hook is not used (another JAX, `EQX_LEAN_NO_PRIVATE_JAX=1`), the
    # message is JAX's own, but the primitive must still refuse, never compute on the codes.
    with pytest.raises(TypeError, match="dot_general"):
        jax.lax.dot(weight, _ones(64))


def test_a_quantized_array_is_still_a_pytree_and_a_module(weight):
    """What the refusals must leave alone: Equinox's equality and hash of modules (static
    fields, caches), `eqx.tree_equal`, flattening, `eqx.filter_jit`."""
    twin = quantize(_ones(8, 64), name="w")
    assert weight == twin and not (weight != twin) and weight != None  # noqa: E711
    assert eqx.tree_equal(weight, twin)
    leaves, treedef = jax.tree.flatten(weight)
    assert jax.tree.unflatten(treedef, leaves) == weight

    class Holder(eqx.Module):
        settings: tuple = eqx.field(static=True)

    assert hash(Holder(("nf4", 64))) == hash(Holder(("nf4", 64)))
    codes = eqx.filter_jit(lambda q: q.codes)
    np.testing.assert_array_equal(codes(weight), weight.codes)
    np.testing.assert_array_equal(codes(twin), weight.codes)  # the same program, from cache


# --- int8 quantize: empty tensors and non-finite values, against bitsandbytes ------------------

_NAN, _INF = float("nan"), float("inf")


def _int8_cases() -> dict[str, np.ndarray]:
    rows = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    rows[1, 3] = _NAN
    rows[2, 0] = _INF
    rows[3, [1, 60]] = [-_INF, _NAN]
    return {"no output channels": np.zeros((0, 64), np.float32), "nan and inf rows": rows}


@pytest.mark.parametrize(
    "case", ["no output channels", "nan and inf rows", "channels of no values", "a bool size"]
)
def test_int8_quantize_of_empty_and_non_finite_tensors_is_bitsandbytes_or_refused(case):
    if case == "channels of no values":
        # bitsandbytes fails on it (a ZeroDivisionError): refused, naming `x` and its shape.
        with pytest.raises(ValueError, match=r"`x` \(shape \(4, 0\), batch_dims=0\) has"):
            quantize(_zeros(4, 0), "int8")
        with pytest.raises(ValueError, match=r"`x` \(shape \(2, 3, 0\), batch_dims=1\)"):
            quantize(_zeros(2, 3, 0), "int8", batch_dims=1)
        return
    if case == "a bool size":
        with pytest.raises(TypeError, match=r"`batch_dims` must be an integer from 0 to 2; got"):
            quantize(_zeros(4, 4), "int8", batch_dims=True)
        return
    torch = pytest.importorskip("torch")
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    x = _int8_cases()[case]
    q = quantize(jax.device_put(x), "int8")
    codes, absmax, _ = bnb_functional.int8_vectorwise_quant(torch.from_numpy(x))
    assert q.shape == x.shape and q.codes.shape == x.shape and q.scales.shape == x.shape[:1]
    np.testing.assert_array_equal(np.asarray(q.codes), codes.numpy())
    theirs = bnb_functional.int8_vectorwise_dequant(codes, absmax).numpy()
    ours = np.asarray(q.dequantize(jnp.float32))
    assert ours.shape == theirs.shape == x.shape
    # A row holding a NaN or an infinity: a non-finite scale (NaN, or inf as bitsandbytes'
    # absmax), codes 0 (compared above) and NaN throughout once decoded, in both.
    finite = np.asarray(np.isfinite(x).all(axis=1))
    np.testing.assert_array_equal(np.isnan(np.asarray(q.scales)), np.isnan(absmax.numpy()))
    np.testing.assert_array_equal(np.isfinite(np.asarray(q.scales)), finite)
    assert np.isnan(ours[~finite]).all() and np.isnan(theirs[~finite]).all()
    # Finite rows are untouched by the others (scales differ in form from bitsandbytes':
    # absmax * float32(1/127) against absmax, tested against NumPy in test_quant.py).
    alone = quantize(jax.device_put(np.where(finite[:, None], x, 0).astype(np.float32)), "int8")
    np.testing.assert_array_equal(np.asarray(alone.codes)[finite], np.asarray(q.codes)[finite])


# --- sizes that are bools (taken as 1) and other non-integers --------------------------------


class _Square(eqx.Module):
    """A layer whose leaves share their first dimension, as a square `eqx.nn.Linear`'s do."""

    w: np.ndarray
    b: np.ndarray

    def __call__(self, x):
        return self.w @ x + self.b


def _squares(n: int = 3) -> list[_Square]:
    return [_Square(np.eye(4, dtype=np.float32) * i, np.zeros(4, np.float32)) for i in range(n)]


def _stack() -> _Square:
    """Three `_Square` layers stacked, without `eqx_lean.stack` (which compiles its writes)."""
    return _Square(np.zeros((3, 4, 4), np.float32), np.zeros((3, 4), np.float32))


_SIZES = {
    "quantize blocksize=True": (
        lambda: quantize(_ones(64), blocksize=True),
        TypeError,
        r"`blocksize` must be an integer of at least 1; got True \(bool\)",
    ),
    "quantize blocksize=64.0": (
        lambda: quantize(_ones(64), blocksize=64.0),  # pyright: ignore[reportArgumentType]
        TypeError,
        r"`blocksize` must be an integer of at least 1; got 64\.0",
    ),
    "quantize batch_dims=True": (
        lambda: quantize(_ones(2, 64), batch_dims=True),
        TypeError,
        r"`batch_dims` must be an integer from 0 to 2; got True \(bool\)",
    ),
    "quantize batch_dims=3": (
        lambda: quantize(_ones(2, 64), batch_dims=3),
        ValueError,
        r"`batch_dims` must be an integer from 0 to 2; got 3\.",
    ),
    "QuantConfig blocksize=True": (
        lambda: QuantConfig(blocksize=True),
        TypeError,
        r"`blocksize` must be an integer of at least 2; got True \(bool\)",
    ),
    "QuantConfig.quantize batch_dims=True": (
        lambda: QuantConfig().quantize(_ones(2, 64), batch_dims=True),
        TypeError,
        r"`batch_dims` must be an integer from 0 to 2; got True",
    ),
    "allocate_stacked num_layers=True": (
        lambda: eqx_lean.allocate_stacked(_squares(1)[0], True),
        TypeError,
        r"`num_layers` must be an integer of at least 1; got True \(bool\)",
    ),
    "fold num_layers=True": (
        lambda: eqx_lean.fold(_stack(), np.ones(4), num_layers=True),
        TypeError,
        r"`num_layers` \(the number of stacked layers\) must be None or an integer of at "
        r"least 1; got True \(bool\)",
    ),
    "scan num_layers=True": (
        lambda: eqx_lean.scan(
            _stack(), np.ones(4), call=lambda f, x, _: (f(x), None), num_layers=True
        ),
        TypeError,
        r"`num_layers` \(the number of stacked layers\) must be None or an integer",
    ),
    "target memory_fraction=True": (
        lambda: eqx_lean.memory.target("h100", memory_fraction=True),
        TypeError,
        r"`memory_fraction` must be a finite number.*; got True \(bool\)",
    ),
}


@pytest.mark.parametrize("case", _SIZES, ids=list(_SIZES))
def test_sizes_that_are_bools_or_floats_are_refused_naming_the_argument(case):
    call, error, message = _SIZES[case]
    with pytest.raises(error, match=message):
        call()


# --- fold and scan of separate layers ----------------------------------------------------------


_SEQUENCES = {
    "fold, a tuple of square layers": lambda: eqx_lean.fold(tuple(_squares()), np.ones(4)),
    "fold, a tuple and a call": lambda: eqx_lean.fold(
        tuple(_squares()), np.ones(4), call=lambda layers, x: x
    ),
    "scan, a tuple of square layers": lambda: eqx_lean.scan(
        tuple(_squares()), np.ones(4), call=lambda layers, x, _: (x, None)
    ),
    "fold, a list": lambda: eqx_lean.fold(_squares(), np.ones(4)),
    "scan, a list of one": lambda: eqx_lean.scan(
        _squares(1), np.ones(4), call=lambda layers, x, _: (x, None)
    ),
}


@pytest.mark.parametrize("case", _SEQUENCES, ids=list(_SEQUENCES))
def test_a_sequence_of_separate_layers_is_refused_saying_what_a_stack_is(case):
    kind = "list" if "list" in case else "tuple"
    count = 1 if "of one" in case else 3
    with pytest.raises(TypeError) as refused:
        _SEQUENCES[case]()
    message = str(refused.value)
    assert message.startswith(
        "`stacked` must be one module whose array leaves carry a leading layer axis (built by "
        "`eqx_lean.build_stacked` or `eqx.filter_vmap(make_layer)(keys)`); got a "
        f"{kind} of {count} separate layers."
    ), message
    assert "eqx_lean.stack(layers)" in message and "in a dict" in message, message


# --- compilation-cache directories -------------------------------------------------------------


def _directory(tmp_path: Path, case: str) -> tuple[Path, str]:
    """The directory of `case`, and the start of what the refusal must say of it."""
    path = tmp_path / "cache"
    if case == "a file":
        path.write_text("not a directory")
        return path, f"{path} exists and is not a directory"
    if case == "a dangling symbolic link":
        path.symlink_to(tmp_path / "missing")
        return path, f"{path} is a symbolic link to {tmp_path / 'missing'}, which does not exist"
    path.mkdir()
    modes = {"group-writable": 0o770, "world-writable": 0o777, "world-writable, sticky": 0o1777}
    if case in modes:
        path.chmod(modes[case])
        who = "its group" if case == "group-writable" else "everyone"
        return path, f"{who} may write in it (mode {modes[case]:04o})"
    assert case == "another user's"
    if os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    os.chown(path, 65534, -1)
    return path, "it belongs to another user (uid 65534; this process runs as 0)"


_CACHES = [
    "a file",
    "a dangling symbolic link",
    "group-writable",
    "world-writable",
    "world-writable, sticky",
    "another user's",
]


@pytest.mark.parametrize("case", [*_CACHES, "JAX's own, world-writable", "shared='yes'"])
def test_a_compilation_cache_directory_others_can_write_or_that_is_none_is_refused(
    case, tmp_path, monkeypatch
):
    # A refusal comes before JAX is configured, so this process's configuration is safe.
    before = jax.config.jax_compilation_cache_dir  # pyright: ignore[reportAttributeAccessIssue]
    if case == "shared='yes'":
        with pytest.raises(TypeError, match=r"`shared` must be true or false; got 'yes'"):
            eqx_lean.use_compilation_cache(tmp_path, shared="yes")  # pyright: ignore[reportArgumentType]
        return
    if case == "JAX's own, world-writable":
        # JAX's own setting (JAX_COMPILATION_CACHE_DIR), kept but checked; with `shared=True`
        # it is used as it is (this branch configures nothing).
        path, why = _directory(tmp_path, "world-writable")
        monkeypatch.delenv("EQX_LEAN_COMPILATION_CACHE", raising=False)
        jax.config.update("jax_compilation_cache_dir", str(path))
        try:
            with pytest.raises(OSError) as refused:
                eqx_lean.use_compilation_cache()
            assert eqx_lean.use_compilation_cache(shared=True) == path
        finally:
            jax.config.update("jax_compilation_cache_dir", before)
        source = "JAX's jax_compilation_cache_dir, or JAX_COMPILATION_CACHE_DIR"
    else:
        path, why = _directory(tmp_path, case)
        with pytest.raises(OSError) as refused:
            eqx_lean.use_compilation_cache(path)
        source = "passed to use_compilation_cache"
    message = str(refused.value)
    assert type(refused.value) is OSError, message  # not a bare FileExistsError
    assert message.startswith(f"The compilation cache's directory {path} ({source}) must be"), (
        message
    )
    assert why in message, message
    if case not in ("a file", "a dangling symbolic link"):
        assert "writable by this user alone" in message and "`shared=True`" in message, message
        assert stat.S_ISDIR(path.stat().st_mode)  # left as it was
    assert jax.config.jax_compilation_cache_dir == before  # pyright: ignore[reportAttributeAccessIssue]


# --- the docs say what the bitsandbytes comparison switches off --------------------------------


def test_the_docs_give_the_bitsandbytes_caveats_and_the_switch_the_tests_use():
    docs = " ".join((REPO / "docs" / "fine-tuning.md").read_text().split())
    tests = (REPO / "tests" / "test_quant_hf.py").read_text()
    switch = "support_avx512bf16_for_cpu = False"
    assert switch in tests and f"`bitsandbytes.nn.Linear4bit`, `module.{switch}`" in docs
    assert "AVX512-BF16" in docs and "not a multiple of 64" in docs
