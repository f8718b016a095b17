"""What many test files share: bitwise assertions, keys and meshes over the suite's devices,
and a small stacked layer to build (`GPTBlock`).

Imported as `from harness import ...` (pytest puts `tests/` on `sys.path`, as it does for the
worker modules beside this file). Fixtures live in `conftest.py`; plain helpers live here.

The suite's own process has eight CPU devices (`conftest.py` sets `jax_num_cpu_devices`), so
a test takes the first `n` of them for an `n`-device mesh; the subprocesses that tests start
keep one device unless they ask for more.

`GPTBlock` is the tests' own model of "a real layer": the engine is tested on it, not on the
benchmark's Mistral-shaped block in `eqx_lean.bench`, which ships with the package and may
change with what the benchmark measures. Tests of the benchmark itself use the benchmark's block.
"""

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jaxtyping import Array, Float, PRNGKeyArray

from eqx_lean.internal import cast_floating


REPO = pathlib.Path(__file__).resolve().parents[1]
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


# Programs that compile faster than this are not written to the test session's compilation
# cache. Measured over the default tier (2026-11-28, 2 cores): writing every program (0 s) made
# the tier's tests 30 % slower than no cache at all (serialising, compressing and locking some
# 5,000 small programs costs more than compiling them); from 0.5 s, the writes of a build and
# the decoder's steps are found again by later files and processes, 8 % faster than no cache.
# JAX's default, 1 s, would leave out most builds' writes (0.3-0.7 s each).
CACHED_COMPILE_SECONDS = 0.5


def compilation_cache_variables(directory: str, min_compile_seconds: float) -> dict[str, str]:
    """The environment that gives a process JAX's persistent compilation cache in `directory`,
    as the test session has it (`conftest.py` sets these for the session: every process a
    test starts inherits them): programs that took `min_compile_seconds` or more to compile
    are written, and the cache's locking mode (a size limit) makes every read and write of an
    entry one step for the other processes (JAX 0.10.2 writes an entry in place)."""
    return {
        "JAX_COMPILATION_CACHE_DIR": directory,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(min_compile_seconds),
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "JAX_COMPILATION_CACHE_MAX_SIZE": str(64 * 2**30),
    }


COMPILATION_CACHE_VARIABLES = tuple(compilation_cache_variables("", 0))
# The tests whose processes must compile as a first run does, so they start them without the
# session's compilation cache: fresh-process memory figures (compiling is part of what they
# measure) and the compilation cache's own tests. This is the one list; `conftest.py` applies
# it (and the documentation's memory blocks, marked `own process`, run without the cache too).
FRESH_COMPILES = (
    "tests/test_memory.py",
    "tests/test_bench.py",
    "tests/test_build.py::test_peak_memory_in_a_fresh_process",
    "tests/test_io_load.py::test_load_overhead_is_independent_of_the_largest_tensor",
    "tests/test_compilation_cache.py",
    "tests/test_compilation_cache_directory.py",
)


# XLA:CPU compiles the suite's programs with LLVM's optimisation level 1, not XLA's default (3):
# the same HLO, the same buffers, less time in LLVM. Measured over the default tier on this
# project's 2-core machine (2026-11-29, one after another, docs/benchmarks.md "The test loop"):
# level 1 10:32 (901 s of backend compiles), XLA's default 11:27 (1,043 s); level 0 9:04 (705 s)
# but 24 tests failed, every one a bitwise or 1e-6 parity of two programs (LLVM at level 0
# rounds some products differently in each), so 0 is not an option. Applied by `conftest.py`
# where the suite runs on the CPU alone; the processes of `FRESH_COMPILES` and
# `tests/test_xla_optimization.py` (the bitwise parities at XLA's default level) compile at
# XLA's default. `EQX_LEAN_TEST_XLA_DEFAULT=1` turns it off.
OPTIMIZATION_FLAG = "--xla_backend_optimization_level"
TEST_OPTIMIZATION_LEVEL = 1
TEST_OPTIMIZATION = f"{OPTIMIZATION_FLAG}={TEST_OPTIMIZATION_LEVEL}"


def uses_test_optimization(env: Mapping[str, str]) -> bool:
    """Whether a suite started with `env` compiles at the suite's level: on the CPU alone,
    unless `EQX_LEAN_TEST_XLA_DEFAULT=1` asks for XLA's default."""
    return env.get("JAX_PLATFORMS") == "cpu" and env.get("EQX_LEAN_TEST_XLA_DEFAULT") != "1"


def with_test_optimization(flags: str) -> str:
    """`XLA_FLAGS` with the suite's LLVM optimisation level added, unless it names one."""
    if OPTIMIZATION_FLAG in flags:
        return flags
    return " ".join([*flags.split(), TEST_OPTIMIZATION])


def at_xla_default_optimization(env: dict[str, str]) -> dict[str, str]:
    """`env` with the suite's LLVM optimisation level taken out of `XLA_FLAGS`."""
    flags = [f for f in env.get("XLA_FLAGS", "").split() if f != TEST_OPTIMIZATION]
    return {**env, "XLA_FLAGS": " ".join(flags), "EQX_LEAN_TEST_XLA_DEFAULT": "1"}


def without_compilation_cache(env: dict[str, str]) -> dict[str, str]:
    """`env` without the session's compilation cache (see `FRESH_COMPILES`)."""
    return {k: v for k, v in env.items() if k not in COMPILATION_CACHE_VARIABLES}


def subprocess_env(devices: int | None = None, **overrides: str) -> dict[str, str]:
    """The environment of a Python process a test starts: this process's, with this checkout
    first on `PYTHONPATH` (the child imports the `eqx_lean` under test, whatever is installed),
    JAX on the CPU (the suite's tolerances are XLA:CPU's) and, given `devices`, that many
    forced CPU devices in place of any count `XLA_FLAGS` already asks for; then `overrides`.

    A child has one CPU device unless it asks: the suite's own eight come from a JAX option
    that `conftest.py` sets in this process only."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["JAX_PLATFORMS"] = "cpu"
    if devices is not None:
        flags = [
            f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)
        ]
        env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={devices}"])
    env.update(overrides)
    return env


# --- processes that print results: several JAX controllers, read when a test needs them ---------

_RESULTS_MARKER = "EQX_LEAN_RESULTS:"


def print_results(results: Any) -> None:
    """Prints `results` (JSON) on one marked line of stdout, for `ProcessJob.results`."""
    print(_RESULTS_MARKER + json.dumps(results), flush=True)


def _results_of(stdout: str) -> Any:
    lines = [line for line in stdout.splitlines() if line.startswith(_RESULTS_MARKER)]
    assert lines, f"no results printed; stdout ended with:\n{stdout[-2000:]}"
    return json.loads(lines[-1][len(_RESULTS_MARKER) :])


def free_port() -> int:
    """A loopback port free now, for a `jax.distributed` coordinator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessJob:
    """Subprocesses started now (each with `env`, by default `subprocess_env(devices)`), whose
    results (printed with `print_results`) are read when a test needs them."""

    def __init__(
        self,
        commands: list[list[str]],
        devices: int,
        timeout: float,
        env: dict[str, str] | None = None,
    ):
        self.deadline = time.monotonic() + timeout
        # Files, not pipes: a process blocked on a full pipe would stall its peer's collectives.
        self.logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in commands]
        env = subprocess_env(devices) if env is None else env
        self.procs = [
            subprocess.Popen(command, env=env, stdout=out, stderr=err)
            for command, (out, err) in zip(commands, self.logs, strict=True)
        ]

    def results(self) -> list[Any]:
        """Each process's results, in the order of `commands`, once all have ended."""
        outputs = []
        try:
            for proc, (out, err) in zip(self.procs, self.logs, strict=True):
                proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
                out.seek(0)
                err.seek(0)
                assert proc.returncode == 0, err.read()[-4000:]
                outputs.append(_results_of(out.read()))
        finally:
            self.stop()
        return outputs

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for out, err in self.logs:
            out.close()
            err.close()


def keys_of(n: int, seed: int = 0) -> jax.Array:
    """`n` typed keys split from `jax.random.key(seed)`, ready (not a pending computation)."""
    return jax.block_until_ready(jax.random.split(jax.random.key(seed), n))


def bits(x: Any) -> np.ndarray:
    """`x`'s bytes as unsigned integers of its item size, so that equality is bitwise (NaNs and
    signed zeros included); integer and boolean arrays as they are."""
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind in "fcV" else x


def arrays(tree: Any) -> list[Any]:
    """The array leaves of `tree`, in order."""
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def assert_bitwise_equal(actual: Any, expected: Any) -> None:
    """`actual` is `expected`: the same tree structure, the same type (shape, dtype and, on
    Explicit mesh axes, sharding) of every array leaf, the same bits, and equal other leaves.
    Shape-dtype structs compare by shape and dtype."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    leaves = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    for i, (a, b) in enumerate(leaves):
        if isinstance(b, jax.ShapeDtypeStruct):
            assert (a.shape, a.dtype) == (b.shape, b.dtype), (i, a, b)
        elif eqx.is_array(b):
            assert jax.typeof(a) == jax.typeof(b), (i, jax.typeof(a), jax.typeof(b))
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"leaf {i}")
        else:
            assert a == b, (i, a, b)


# --- the platform the suite runs on: CPU (always here), or a GPU with the CPU beside it -------
#
# The suite is written for XLA:CPU, with eight forced CPU devices. On a machine whose default
# backend is a GPU (`benchmarks/gpu_tests.sh`), three things change, all decided here from
# `default_backend()`, the one seam (`tests/test_harness_platform.py` fakes it):
# - the tests marked `cpu_mesh` (they need the eight CPU devices) run pinned to the CPU
#   platform: `pinned_to_cpu()`, applied by `conftest.py` around each such test;
# - the tests marked `xla_cpu` (an XLA:CPU plan or program shape asserted as such) are skipped,
#   and those marked `private_jax` wherever `eqx_lean.internal.private_jax_allowed()` is false
#   (`platform_skip_reason`);
# - float32 tolerances come from `tolerance(kind)`, and `conftest.py` sets
#   `jax_default_matmul_precision="highest"`: XLA:GPU computes float32 dots in TF32 by
#   default (measured on the H100, docs/benchmarks.md), torch and XLA:CPU do not.


def default_backend() -> str:
    """The platform JAX runs on by default in this process (`jax.default_backend()`)."""
    return jax.default_backend()


def on_cpu() -> bool:
    """Whether the suite runs on the CPU platform (its tolerances and plans are XLA:CPU's)."""
    return default_backend() == "cpu"


_pinned = [0]  # how deep `pinned_to_cpu` is entered: a module-wide mark and a test's nest


@contextlib.contextmanager
def pinned_to_cpu() -> Iterator[None]:
    """Runs what it wraps on the CPU platform's devices when the default backend is not the
    CPU (nothing changes on the CPU): `jax.default_device` is the first CPU device, and
    `jax.devices()` and `jax.make_mesh` (as the tests, `mesh_of` and eqx_lean call them) give
    and take the CPU devices, the eight `conftest.py` forces. A GPU machine has one GPU; the
    8-device tests (marked `cpu_mesh`) keep their meaning there."""
    if on_cpu() or _pinned[0]:
        _pinned[0] += 1
        try:
            yield
        finally:
            _pinned[0] -= 1
        return
    cpu = jax.devices("cpu")
    real_devices, real_make_mesh = jax.devices, jax.make_mesh

    def devices(backend: Any = None) -> list[Any]:
        return real_devices("cpu" if backend is None else backend)

    def make_mesh(*args: Any, devices: Any = None, **kwargs: Any) -> Mesh:
        return real_make_mesh(*args, devices=cpu if devices is None else devices, **kwargs)

    _pinned[0] += 1
    try:
        with pytest.MonkeyPatch.context() as patch, jax.default_device(cpu[0]):
            patch.setattr(jax, "devices", devices)
            patch.setattr(jax, "make_mesh", make_mesh)
            yield
    finally:
        _pinned[0] -= 1


def platform_skip_reason(markers: Sequence[str]) -> str | None:
    """Why a test with these markers does not run here, or `None` when it runs: `xla_cpu`
    tests run only where the default backend is the CPU, `private_jax` tests only where eqx_lean
    uses private JAX APIs (the tested JAX series, `EQX_LEAN_NO_PRIVATE_JAX` unset)."""
    from eqx_lean.internal import private_jax_allowed

    if "xla_cpu" in markers and not on_cpu():
        return f"asserts an XLA:CPU plan or program; the default backend is {default_backend()}"
    if "private_jax" in markers and not private_jax_allowed():
        return (
            f"asserts a private-JAX path is active; eqx_lean uses none on JAX {jax.__version__}"
            " here (eqx_lean.internal.private_jax_allowed() is false)"
        )
    return None


# Float32 tolerances that differ by platform, by what is compared. On the CPU they are the
# suite's bounds as they stood (never loosened); on a GPU each is justified by a measurement:
# - "loop": a `fold`/`scan` against a Python loop over the same layers, relative to
#   max(1, |value|). XLA:GPU fuses and reduces in another order: a stateful scan was 3.4e-6
#   from its loop on the H100 at the highest matmul precision (docs/benchmarks.md, "The test
#   suite on the H100"), against the CPU's 1e-6.
TOLERANCES: dict[str, dict[str, float]] = {
    "cpu": {"loop": 1e-6},
    "gpu": {"loop": 1e-5},
}


needs_gpu_plugin = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins.xla_cuda12") is None,
    reason="the plan-gpu extra (JAX's CUDA plugin) is not installed",
)
"""For tests that compile for GPUs this machine lacks (the `plan` extra's CUDA plugin)."""


def tolerance(kind: str) -> float:
    """The float32 tolerance of `kind` (`TOLERANCES`) on the platform the suite runs on; a
    platform without its own column (a TPU) takes the GPU's."""
    platform = "cpu" if on_cpu() else "gpu"
    return TOLERANCES[platform][kind]


def mesh_of(
    shape: Sequence[int], names: Sequence[str], axis_type: AxisType = AxisType.Explicit
) -> Mesh:
    """A mesh of `shape` over the first `prod(shape)` of this process's devices, every axis of
    `axis_type` (JAX's default, Explicit, unless given)."""
    devices = jax.devices()[: int(np.prod(shape))]
    assert len(devices) == int(np.prod(shape)), f"{shape} needs more than {len(devices)} devices"
    return jax.make_mesh(tuple(shape), tuple(names), (axis_type,) * len(shape), devices=devices)


# --- a GPT-2-style block: the stacked layer of many tests -------------------------------------


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The sizes of a `GPTBlock`, and how many of them a test stacks (`num_layers`).

    `heads` must divide `dim`. `bias`: whether the linear layers have biases (GPT-2's do), but
    for the key projection's, which never does (see `GPTAttention`); without, their `bias`
    fields are `None`, which some sharding tests need.
    """

    num_layers: int
    dim: int
    hidden: int
    heads: int
    bias: bool = True

    def __post_init__(self) -> None:
        # Checked here, so that a test's config fails where it is written, not in a reshape.
        if self.dim % self.heads:
            raise ValueError(f"`heads` ({self.heads}) must divide `dim` ({self.dim}).")


class GPTAttention(eqx.Module):
    """Causal multi-head self-attention over one sequence, with a linear layer for each of the
    query, key, value and output projections (`dim` to `dim`).

    The key projection has no bias (as in Whisper): a bias of the keys adds the same amount to
    every score of a query, which softmax ignores, so its gradient is exactly zero and would
    be computed as rounding noise that no tolerance relative to the gradient can judge.
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)

    def __init__(self, config: GPTConfig, *, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        dim, bias = config.dim, config.bias
        self.query_proj = eqx.nn.Linear(dim, dim, use_bias=bias, key=kq)
        self.key_proj = eqx.nn.Linear(dim, dim, use_bias=False, key=kk)
        self.value_proj = eqx.nn.Linear(dim, dim, use_bias=bias, key=kv)
        self.output_proj = eqx.nn.Linear(dim, dim, use_bias=bias, key=ko)
        self.num_heads = config.heads

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        seq, dim = x.shape
        head_dim = dim // self.num_heads

        def heads(linear: eqx.nn.Linear) -> Float[Array, "seq heads head_dim"]:
            return jax.vmap(linear)(x).reshape(seq, self.num_heads, head_dim)

        q, k, v = heads(self.query_proj), heads(self.key_proj), heads(self.value_proj)
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
        # Of rank 3, as `scores` is: the suite raises on implicit rank promotion.
        causal = jnp.tril(jnp.ones((1, seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        mixed = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v)
        return jax.vmap(self.output_proj)(mixed.reshape(seq, dim))


class GPTMLP(eqx.Module):
    """`down(gelu(up(x)))`, from `dim` to `hidden` and back, on one position."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, config: GPTConfig, *, key: PRNGKeyArray):
        ku, kd = jax.random.split(key)
        self.up = eqx.nn.Linear(config.dim, config.hidden, use_bias=config.bias, key=ku)
        self.down = eqx.nn.Linear(config.hidden, config.dim, use_bias=config.bias, key=kd)

    def __call__(self, x: Float[Array, " dim"]) -> Float[Array, " dim"]:
        return self.down(jax.nn.gelu(self.up(x)))


class GPTBlock(eqx.Module):
    """A GPT-2-style decoder block: pre-LayerNorm causal attention and a gelu MLP, each added
    to its input (the residual). Every leaf is an array; the norms' paths contain "norm" (for
    the tests' dtype rules), the projections' do not.

    The forward pass computes in the activations' dtype: the weights are cast to it first, so
    bfloat16 weights with float32 activations compute in float32 (the suite's strict dtype
    promotion would reject the mixed product). The norms normalise in at least float32.
    """

    attention_norm: eqx.nn.LayerNorm
    attention: GPTAttention
    mlp_norm: eqx.nn.LayerNorm
    mlp: GPTMLP

    def __init__(self, config: GPTConfig, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.attention_norm = eqx.nn.LayerNorm(config.dim)
        self.attention = GPTAttention(config, key=ka)
        self.mlp_norm = eqx.nn.LayerNorm(config.dim)
        self.mlp = GPTMLP(config, key=km)

    def __call__(self, x: Float[Array, "batch seq dim"]) -> Float[Array, "batch seq dim"]:
        return jax.vmap(cast_floating(self, x.dtype)._sequence)(x)

    def _sequence(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        # Equinox's layers take one position: `vmap` maps them over the sequence.
        x = x + self.attention(jax.vmap(self.attention_norm)(x))
        return x + jax.vmap(self.mlp)(jax.vmap(self.mlp_norm)(x))


# The block sizes the test files share: a file that builds a small block takes one of these, so
# that files compile the same programs (found in the session's compilation cache after the
# first file that compiled them).
TINY_BLOCK = GPTConfig(num_layers=3, dim=16, hidden=64, heads=2)
SMALL_BLOCK = GPTConfig(num_layers=3, dim=32, hidden=128, heads=4)


# The decoder shapes the HF-layer test files share (`eqx_lean.hf.DecoderConfig` fields; a file
# adds or replaces fields with `dict(TINY_DECODER, ...)`): a tiny decoder every fsdp test can
# split over 8 devices, and a smaller one, in float32, for the config and load checks.
TINY_DECODER: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=None,
)
MICRO_DECODER: dict[str, Any] = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    sliding_window=None,
    dtype="float32",
)
