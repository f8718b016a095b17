"""Sharded stacks run through `fold` and `scan`, each layer gathered just before it runs (ZeRO-3).

The multi-device checks run in this process, on the suite's eight CPU devices (`conftest.py`),
or on the first four of them in the slow tier. Every value is checked against the same stack,
unsharded, run by a Python loop over `eqx_lean.unstack` (gradients by differentiating that
loop). Checks of bad arguments that one device can answer run on one device.
"""

import contextlib
import dataclasses
import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import GPTBlock, GPTConfig, keys_of, mesh_of
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, PRNGKeyArray

import eqx_lean


# Every test here shards over the eight forced CPU devices (on a GPU machine too).
pytestmark = pytest.mark.cpu_mesh


NUM_LAYERS = 4
DIM = 16
BLOCK = GPTConfig(num_layers=NUM_LAYERS, dim=32, hidden=128, heads=4)


# --- layers under test ------------------------------------------------------------------------


def make_mlp(key: PRNGKeyArray) -> eqx.nn.MLP:
    return eqx.nn.MLP(DIM, DIM, width_size=4 * DIM, depth=2, activation=jnp.tanh, key=key)


class Attention(eqx.Module):
    """Single-head attention with a per-layer KV cache (`scan`'s `xs`), as Equinox writes it."""

    attention: eqx.nn.MultiheadAttention

    def __init__(self, *, key: PRNGKeyArray):
        self.attention = eqx.nn.MultiheadAttention(2, DIM, key=key)

    def __call__(self, x: Array, cache: Array) -> tuple[Array, Array]:
        context = jnp.concatenate([cache, x])
        return x + self.attention(x, context, context), context[-cache.shape[0] :]


def make_attention(key: PRNGKeyArray) -> Attention:
    return Attention(key=key)


def make_block(key: PRNGKeyArray) -> GPTBlock:
    return GPTBlock(BLOCK, key=key)


def norms_in_float32(path: Any, leaf: jax.ShapeDtypeStruct) -> Any:
    return None if "norm" in jax.tree_util.keystr(path) else jnp.bfloat16


class ParallelMLP(eqx.Module):
    """A tensor-parallel MLP (Megatron's column- then row-parallel split).

    With Explicit mesh axes, the row-parallel product contracts a sharded dimension, so the
    layer says how its output is sharded (like its input); with Auto axes that is a no-op.
    """

    up: Array
    down: Array

    def __init__(self, *, key: PRNGKeyArray):
        kup, kdown = jax.random.split(key)
        self.up = jax.random.normal(kup, (4 * DIM, DIM)) / DIM**0.5
        self.down = jax.random.normal(kdown, (DIM, 4 * DIM)) / (4 * DIM) ** 0.5

    def __call__(self, x: Array) -> Array:
        hidden = jnp.tanh(jnp.einsum("bd,hd->bh", x, self.up))
        out = jnp.einsum("bh,dh->bd", hidden, self.down, out_sharding=jax.typeof(x).sharding)
        return x + out


def make_parallel_mlp(key: PRNGKeyArray) -> ParallelMLP:
    return ParallelMLP(key=key)


# --- comparing against the unsharded loop -----------------------------------------------------


def _differences(found: Any, expected: Any) -> list[str]:
    """Leaves of `found` that differ from `expected` by more than rounding explains.

    Float32 leaves: 1e-5, relative above 1 and absolute below. Bfloat16 leaves (the gradients
    of bfloat16 weights) are float32 sums rounded once to bfloat16. Sharded, or merely compiled
    differently, a sum is taken in another order, so the two float32 sums differ by float32
    rounding on the scale of the leaf (1e-5 of its largest element), and rounding to bfloat16
    adds at most one bfloat16 step of the element: any real error is larger than that.
    """
    problems = []
    found_leaves = jax.tree_util.tree_leaves_with_path(found)
    expected_leaves = jax.tree.leaves(expected)
    if len(found_leaves) != len(expected_leaves) or not expected_leaves:
        return [f"{len(found_leaves)} leaves, expected {len(expected_leaves)}"]
    for (path, a), b in zip(found_leaves, expected_leaves, strict=True):
        where = jax.tree_util.keystr(path)
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{where}: {a.dtype}{a.shape} != {b.dtype}{b.shape}")
            continue
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.dtype == jnp.bfloat16:
            larger = np.maximum(np.maximum(np.abs(a64), np.abs(b64)), np.finfo(np.float32).tiny)
            step = np.exp2(np.floor(np.log2(larger)) - 7)  # bfloat16 keeps 8 significant bits
            bound = step + 1e-5 * np.max(np.abs(b64), initial=0.0)
            error = np.max(np.abs(a64 - b64) / bound, initial=0.0)
            if not error <= 1.0:
                problems.append(f"{where}: {error:.3g} x (one bfloat16 step + float32 rounding)")
            continue
        error = np.max(np.abs(a64 - b64) / np.maximum(1.0, np.abs(b64)), initial=0.0)
        if not error <= 1e-5:
            problems.append(f"{where}: relative error {error:.3g}")
    return problems


def _misplaced(grads: Any, stacked: Any) -> list[str]:
    """Gradient leaves not sharded exactly as the stack's own leaves."""
    problems = []
    grad_leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(grads, eqx.is_array))
    stack_leaves = jax.tree.leaves(eqx.filter(stacked, eqx.is_array))
    for (path, g), s in zip(grad_leaves, stack_leaves, strict=True):
        if not g.sharding.is_equivalent_to(s.sharding, g.ndim):
            problems.append(f"{jax.tree_util.keystr(path)}: {g.sharding} is not {s.sharding}")
    return problems


def _loss(out: Any) -> Array:
    return jnp.sum(
        jnp.stack([jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in jax.tree.leaves(out)])
    )


def _value_and_grad(run: Callable[..., Any], stacked: Any, *args: Any) -> tuple[Any, Any]:
    """`run(stacked, *args)` and the gradient of a scalar of it with respect to `stacked`."""

    def loss(stacked: Any) -> tuple[Array, Any]:
        out = run(stacked, *args)
        return _loss(out), out

    (_, out), grads = eqx.filter_value_and_grad(loss, has_aux=True)(stacked)
    return out, grads


# One jitted function for every check, so that equal calls (the references) compile once.
_jitted_value_and_grad = eqx.filter_jit(_value_and_grad)


def _loop_fold(stacked: Any, x: Array) -> Array:
    for layer in eqx_lean.unstack(stacked):
        x = layer(x)
    return x


def _loop_scan(stacked: Any, x: Array, cache: Array) -> tuple[Array, Array]:
    new_caches = []
    for i, layer in enumerate(eqx_lean.unstack(stacked)):
        x, new_cache = layer(x, cache[i])
        new_caches.append(new_cache)
    return x, jnp.stack(new_caches)


def _expected(loop: Callable[..., Any], reference: Any, *args: Any) -> Any:
    """Output and gradients of the unsharded loop (its inputs copied off the mesh)."""
    return _jitted_value_and_grad(loop, reference, *jax.tree.map(np.asarray, args))


def assert_matches_loop(
    run: Callable[..., Any], sharded: Any, expected: Any, *args: Any, eager: bool = False
) -> None:
    """Output and gradients of `run` on the sharded stack match the unsharded loop's, and the
    gradients are sharded as the stack is."""
    found = (_value_and_grad if eager else _jitted_value_and_grad)(run, sharded, *args)
    assert _differences(found, expected) + _misplaced(found[1], sharded) == []


def _eager_context(mesh: Mesh) -> Any:
    # Eager differentiation on Explicit axes needs the mesh as context (a JAX requirement).
    explicit = mesh.axis_types == (AxisType.Explicit,) * len(mesh.axis_types)
    return jax.set_mesh(mesh) if explicit else contextlib.nullcontext()


def _fold_with(remat: Any) -> Callable[[Any, Array], Array]:
    return lambda stacked, x: eqx_lean.fold(stacked, x, remat=remat)


# --- the checks, on the suite's eight CPU devices (or the first four) -------------------------

SLOW = pytest.mark.slow
KINDS = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


@pytest.fixture(autouse=True, scope="module")
def highest_precision() -> Iterator[None]:
    """Every value here, the unsharded references included, at full float32 matmul precision
    (set for the module, so that the module-scoped references below are computed under it)."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((8, "explicit"), id="8-explicit"),
        pytest.param((8, "auto"), id="8-auto"),
        pytest.param((4, "explicit"), id="4-explicit", marks=SLOW),
        pytest.param((4, "auto"), id="4-auto", marks=SLOW),
    ],
)
def layout(request) -> tuple[int, str]:
    """The device count and mesh axis type of a check: 8 devices by default, 4 with the slow
    tier (the first 4 of the suite's 8)."""
    return request.param


@dataclasses.dataclass(frozen=True)
class Reference:
    """A check's mesh, the keys its stack is built from, its input(s), and the unsharded loop's
    output and gradients for them."""

    mesh: Mesh
    keys: Array
    args: tuple[Any, ...]
    expected: Any


@pytest.fixture(scope="module")
def mlp(layout: tuple[int, str]) -> Reference:
    """An Equinox MLP, unchanged, on a one-axis mesh."""
    devices, kind = layout
    keys = keys_of(NUM_LAYERS)
    reference = eqx_lean.build_stacked(make_mlp, keys)
    x = jax.random.normal(jax.random.key(1), (DIM,))
    mesh = mesh_of((devices,), ("data",), KINDS[kind])
    return Reference(mesh, keys, (x,), _expected(_loop_fold, reference, x))


@pytest.fixture(scope="module")
def mlp_stack(mlp: Reference) -> Any:
    """The MLP stack sharded by `fsdp` over the mesh's one axis."""
    return eqx_lean.build_stacked(make_mlp, mlp.keys, sharding=eqx_lean.fsdp(mlp.mesh))


def test_make_mesh_default_is_explicit_and_auto_is_auto(mlp: Reference, layout: tuple[int, str]):
    """The "explicit" checks run on the mesh `jax.make_mesh` makes by default (Explicit axes
    since JAX 0.7); the "auto" ones on Auto axes."""
    devices, kind = layout
    expected = ("Explicit",) if kind == "explicit" else ("Auto",)
    assert tuple(t.name for t in mlp.mesh.axis_types) == expected
    if kind == "explicit":
        default = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
        assert default == mlp.mesh


REMATS = [
    pytest.param(None, id="none"),
    pytest.param(True, id="true"),
    pytest.param(jax.checkpoint_policies.dots_saveable, id="dots_saveable", marks=SLOW),
    pytest.param("nested", id="nested", marks=SLOW),
]


@pytest.mark.parametrize("remat", REMATS)
def test_fsdp_mlp_fold_matches_unsharded_loop(mlp: Reference, mlp_stack: Any, remat: Any):
    """Outputs and gradients within 1e-5; gradients sharded as the stack is."""
    assert_matches_loop(_fold_with(remat), mlp_stack, mlp.expected, *mlp.args)


def test_fsdp_mlp_fold_eagerly(mlp: Reference, mlp_stack: Any):
    (x,) = mlp.args
    eager_forward = eqx_lean.fold(mlp_stack, x)
    assert _differences(eager_forward, mlp.expected[0]) == []
    with _eager_context(mlp.mesh):
        assert_matches_loop(eqx_lean.fold, mlp_stack, mlp.expected, x, eager=True)


def test_fsdp_attention_scan_with_kv_cache(layout: tuple[int, str]):
    """Equinox attention with a per-layer KV cache, through `scan`."""
    devices, kind = layout
    mesh = mesh_of((devices,), ("data",), KINDS[kind])
    keys = keys_of(NUM_LAYERS)
    reference = eqx_lean.build_stacked(make_attention, keys)
    sharded = eqx_lean.build_stacked(make_attention, keys, sharding=eqx_lean.fsdp(mesh))
    args = (
        jax.random.normal(jax.random.key(2), (3, DIM)),
        jax.random.normal(jax.random.key(3), (NUM_LAYERS, 5, DIM)),
    )

    def scan(stacked: Any, x: Array, cache: Array) -> Any:
        call = lambda layer, x, c: layer(x, c)  # noqa: E731
        return eqx_lean.scan(stacked, x, cache, call=call, remat=True)

    assert_matches_loop(scan, sharded, _expected(_loop_scan, reference, *args), *args)


@pytest.fixture(scope="module")
def block(layout: tuple[int, str]) -> Reference:
    """A GPT-2-style block, bfloat16 weights and float32 norms, on a batch of one row per
    device (not yet placed on the one-axis mesh)."""
    devices, kind = layout
    keys = keys_of(NUM_LAYERS)
    reference = eqx_lean.build_stacked(make_block, keys, norms_in_float32)
    x = jax.random.normal(jax.random.key(4), (devices, 6, BLOCK.dim))
    mesh = mesh_of((devices,), ("data",), KINDS[kind])
    return Reference(mesh, keys, (x,), _expected(_loop_fold, reference, x))


def test_fsdp_bfloat16_block_with_data_parallel_batch(block: Reference, layout: tuple[int, str]):
    """The batch sharded over the mesh axis that shards the stack (data parallel + fsdp)."""
    fsdp = eqx_lean.fsdp(block.mesh)
    sharded = eqx_lean.build_stacked(make_block, block.keys, norms_in_float32, fsdp)
    x_data = jax.device_put(block.args[0], NamedSharding(block.mesh, P("data")))
    fold = _fold_with(True)
    assert_matches_loop(fold, sharded, block.expected, x_data)
    output_sharding = _jitted_value_and_grad(fold, sharded, x_data)[0].sharding
    if layout[1] == "explicit":  # with Auto axes, where the output lands is XLA's choice
        assert str(output_sharding.spec) == "P('data', None, None)"


@SLOW
def test_fsdp_and_data_parallel_on_different_axes(block: Reference, layout: tuple[int, str]):
    """The stack sharded over "fsdp", the batch over "data", of a 2-D mesh."""
    devices, kind = layout
    mesh = mesh_of((devices // 2, 2), ("data", "fsdp"), KINDS[kind])
    fsdp = eqx_lean.fsdp(mesh, "fsdp")
    sharded = eqx_lean.build_stacked(make_block, block.keys, norms_in_float32, fsdp)
    x_data = jax.device_put(block.args[0], NamedSharding(mesh, P("data")))
    assert_matches_loop(_fold_with(True), sharded, block.expected, x_data)


@pytest.fixture(scope="module")
def tensor_parallel(layout: tuple[int, str]) -> Reference:
    """Parallel MLPs on a data x model mesh, the batch sharded over "data"."""
    devices, kind = layout
    keys = keys_of(NUM_LAYERS, seed=5)
    reference = eqx_lean.build_stacked(make_parallel_mlp, keys)
    x = jax.random.normal(jax.random.key(6), (devices, DIM))
    expected = _expected(_loop_fold, reference, x)
    mesh = mesh_of((devices // 2, 2), ("data", "model"), KINDS[kind])
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    return Reference(mesh, keys, (x,), expected)


MEGATRON = {"up": P("model", None), "down": P(None, "model")}


def _by_name(mesh: Mesh, specs: dict[str, Any]) -> Callable[[Any, Any], Any]:
    return lambda path, leaf: NamedSharding(mesh, specs[jax.tree_util.keystr(path)[1:]])


def test_gather_false_keeps_tensor_parallel_shards(tensor_parallel: Reference):
    """Tensor parallel only, kept as it is: nothing is gathered."""
    tp = tensor_parallel
    (x,) = tp.args
    megatron = _by_name(tp.mesh, MEGATRON)
    sharded = eqx_lean.build_stacked(make_parallel_mlp, tp.keys, sharding=megatron)
    keep = lambda stacked, x: eqx_lean.fold(stacked, x, gather=False)  # noqa: E731
    assert_matches_loop(keep, sharded, tp.expected, x)
    dynamic, static = eqx.partition(sharded, eqx.is_array)
    compiled = jax.jit(lambda d, x: keep(eqx.combine(d, static), x)).lower(dynamic, x).compile()
    assert (compiled.as_text() or "").count("all-gather(") == 0


def _gather_form(form: str, mesh: Mesh) -> Any:
    """The user's gather spec (MEGATRON, or replicated for "one-") in the form named `form`."""
    abstract = eqx.filter_eval_shape(make_parallel_mlp, jax.random.key(0))
    named = {name: NamedSharding(mesh, spec) for name, spec in MEGATRON.items()}
    if form == "rule":
        return lambda path, leaf: MEGATRON[jax.tree_util.keystr(path)[1:]]
    if form == "prefix-specs":
        return eqx.tree_at(lambda m: (m.up, m.down), abstract, (MEGATRON["up"], MEGATRON["down"]))
    if form == "prefix-named":
        return eqx.tree_at(lambda m: (m.up, m.down), abstract, (named["up"], named["down"]))
    if form == "one-spec":
        return P()
    assert form == "one-named", form
    return NamedSharding(mesh, P())


GATHER_FORMS = [
    "rule",
    pytest.param("prefix-specs", marks=SLOW),
    pytest.param("prefix-named", marks=SLOW),
    "one-spec",
    pytest.param("one-named", marks=SLOW),
]


@pytest.mark.parametrize("form", GATHER_FORMS)
def test_gather_to_a_user_spec(tensor_parallel: Reference, layout: tuple[int, str], form: str):
    """fsdp over "data" and tensor parallel over "model", gathered over "data" only (or all).

    The layer records the shardings it receives; they are checked with Explicit axes only (with
    Auto axes a traced array does not carry its sharding)."""
    tp = tensor_parallel
    (x,) = tp.args
    both = _by_name(tp.mesh, {"up": P("model", "data"), "down": P("data", "model")})
    sharded = eqx_lean.build_stacked(make_parallel_mlp, tp.keys, sharding=both)
    gather = _gather_form(form, tp.mesh)
    received: set[str] = set()

    def call(layer: ParallelMLP, x: Array) -> Array:
        received.add(str(jax.typeof(layer.up).sharding.spec))
        received.add(str(jax.typeof(layer.down).sharding.spec))
        return layer(x)

    def run(stacked: Any, x: Array) -> Array:
        return eqx_lean.fold(stacked, x, call=call, gather=gather)

    assert_matches_loop(run, sharded, tp.expected, x)
    if layout[1] == "explicit":
        if form.startswith("one-"):
            assert sorted(received) == ["P(None, None)"]
        else:
            assert sorted(received) == ["P('model', None)", "P(None, 'model')"]


@pytest.mark.parametrize("devices", [8, pytest.param(4, marks=SLOW)])
def test_error_gather_spec_not_dividing_a_leaf(devices: int):
    mesh = mesh_of((devices,), ("data",))
    make_linear = lambda key: eqx.nn.Linear(6, 8, key=key)  # noqa: E731
    sharded = eqx_lean.build_stacked(make_linear, keys_of(NUM_LAYERS), sharding=eqx_lean.fsdp(mesh))
    last_axis = lambda path, leaf: P(*([None] * (leaf.ndim - 1)), "data")  # noqa: E731
    with pytest.raises(ValueError) as caught:  # 4 or 8 devices do not divide 6 input features
        eqx_lean.fold(sharded, jnp.zeros(6), call=lambda layer, x: x, gather=last_axis)
    message = str(caught.value)
    assert message.startswith("`gather`: leaf .weight of shape (8, 6)"), message
    assert "not divisible" in message, message


@pytest.fixture(scope="module")
def sharded_forward() -> ModuleType:
    """`benchmarks/sharded_forward.py`, imported into this process. Its `forward_memory` only
    compiles, on the first 8 of this process's devices. Importing it sets `XLA_FLAGS` (for its
    own runs); by then this process's backend has started, and the variable is restored, so
    that no subprocess a later test starts inherits it."""
    assert len(jax.devices()) == 8  # starts the backend before the import sets XLA_FLAGS
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "sharded_forward.py"
    spec = importlib.util.spec_from_file_location("sharded_forward", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    xla_flags = os.environ.get("XLA_FLAGS")
    try:
        spec.loader.exec_module(module)
    finally:
        if xla_flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = xla_flags
    return module


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=lambda t: t.name)
def test_forward_memory_is_a_shard_plus_a_few_layers(sharded_forward, axis_type: AxisType):
    """Per device: stack / devices + 3 layers + 4 MiB of arguments, outputs and temporaries."""
    m = sharded_forward.forward_memory(8, axis_type)
    assert m["total"] <= m["bar"], (axis_type, m)
    # The gathered layers are temporaries: the arguments are the shard and the input.
    assert m["argument"] <= m["stack"] / 8 + 2**20, (axis_type, m)


# --- errors, on one device --------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_device() -> tuple[Any, Any]:
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    keys = jax.random.split(jax.random.key(0), 2)
    return mesh, eqx_lean.build_stacked(make_mlp, keys, sharding=eqx_lean.fsdp(mesh))


def test_error_gather_not_a_policy(one_device):
    _, stacked = one_device
    for bad in (None, "data", 1):
        with pytest.raises(TypeError, match=r"`gather` must be True .* False .*; got"):
            eqx_lean.fold(stacked, jnp.zeros(DIM), gather=bad)  # pyright: ignore


def test_error_gather_spec_names_unknown_axis(one_device):
    _, stacked = one_device
    with pytest.raises(ValueError, match=r"`gather`: leaf \.layers\[0\]\.weight .*'model'"):
        eqx_lean.fold(stacked, jnp.zeros(DIM), gather=P("model"))


def test_error_gather_spec_longer_than_leaf(one_device):
    _, stacked = one_device
    with pytest.raises(ValueError, match=r"`gather`: leaf \.layers\[0\]\.bias .*more dimensions"):
        eqx_lean.fold(stacked, jnp.zeros(DIM), gather=P(None, None))


def test_error_gather_rule_returns_a_non_sharding(one_device):
    _, stacked = one_device
    with pytest.raises(TypeError, match=r"`gather` for leaf \.layers\[0\]\.weight must be"):
        eqx_lean.fold(stacked, jnp.zeros(DIM), gather=lambda path, leaf: "replicated")


def test_error_gather_prefix_does_not_match(one_device):
    _, stacked = one_device
    with pytest.raises(ValueError, match=r"`gather` must be one Sharding .* does not match"):
        eqx_lean.fold(stacked, jnp.zeros(DIM), gather={"weight": P()})


def test_error_gather_on_another_mesh(one_device):
    _, stacked = one_device
    other = jax.make_mesh((1,), ("model",), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"leaf \.layers\[0\]\.weight a sharding on the mesh"):
        eqx_lean.fold(stacked, jnp.zeros(DIM), gather=NamedSharding(other, P()))


def test_error_gather_policy_on_an_unsharded_stack():
    stacked = eqx_lean.build_stacked(make_mlp, jax.random.split(jax.random.key(0), 2))
    with pytest.raises(ValueError, match=r"no array leaf of `stacked` lies on a device mesh"):
        eqx_lean.fold(stacked, jnp.zeros(DIM), gather=P())


def test_gather_is_a_no_op_off_a_mesh():
    """Unsharded stacks run as before: `gather=True` adds nothing to the program."""
    stacked = eqx_lean.build_stacked(make_mlp, jax.random.split(jax.random.key(0), 2))
    dynamic, static = eqx.partition(stacked, eqx.is_array)

    def jaxpr(gather: bool) -> str:
        fold = lambda d: eqx_lean.fold(eqx.combine(d, static), jnp.zeros(DIM), gather=gather)  # noqa: E731
        return str(jax.make_jaxpr(fold)(dynamic))

    assert jaxpr(True) == jaxpr(False)


def test_the_gather_barrier_is_lowered_for_cpu_and_tpu_only():
    # Measured (benchmarks/private_paths.py, docs/benchmarks.md, issue 46): on XLA:CPU it saves a
    # relayout of the whole stack; on a v5e-4 it lowers a Llama-8B LoRA step's plan by 0.11 GiB
    # per chip; on 4 H100s it changes nothing. One device is enough: a layer sharded on a
    # one-device axis is still gathered to its replicated spec.
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,))
    keys = jax.random.split(jax.random.key(0), 3)
    make = lambda k: {"w": jax.random.normal(k, (8, 8))}  # noqa: E731
    stacked = eqx_lean.build_stacked(make, keys, sharding=NamedSharding(mesh, P("data")))
    x = jnp.ones(8)

    def barriers(gather: bool, platform: str) -> int:
        call = lambda layer, x: layer["w"] @ x  # noqa: E731
        forward = jax.jit(lambda s, x: eqx_lean.fold(s, x, call=call, gather=gather))
        lowered = forward.trace(stacked, x).lower(lowering_platforms=(platform,))
        return lowered.as_text().count("optimization_barrier")

    # scan's own barrier is one (on CPU only); the gather adds one, on CPU and TPU.
    assert barriers(False, "cpu") + 1 == barriers(True, "cpu")
    assert barriers(True, "tpu") == barriers(False, "tpu") + 1 == 1
    assert barriers(True, "cuda") == barriers(False, "cuda") == 0
    assert barriers(True, "rocm") == barriers(False, "rocm") == 0
