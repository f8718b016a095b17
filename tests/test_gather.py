"""Sharded stacks run through `fold` and `scan`, each layer gathered just before it runs (ZeRO-3).

The device count is fixed when JAX starts, so the multi-device checks run in fresh processes
with 4 or 8 forced CPU devices (`python tests/test_gather.py devices N`), which print a JSON
dict of results that the tests below read. Every value is checked against the same stack,
unsharded, run by a Python loop over `eqx_lean.unstack` (gradients by differentiating that
loop). Checks of bad arguments that one device can answer run in this process.
"""

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array, PRNGKeyArray

import eqx_lean
from eqx_lean.internal import Block, BlockConfig


NUM_LAYERS = 4
DIM = 16
BLOCK = BlockConfig(num_layers=NUM_LAYERS, dim=32, hidden=64, heads=4, kv_heads=2)
REMATS: dict[str, Any] = {
    "none": None,
    "true": True,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "nested": "nested",
}


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


def make_block(key: PRNGKeyArray) -> Block:
    return Block(BLOCK, key=key)


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


# --- checks run with forced CPU devices -------------------------------------------------------


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


def _compare(
    results: dict[str, Any],
    name: str,
    run: Callable[..., Any],
    sharded: Any,
    expected: Any,
    *args: Any,
    eager: bool = False,
) -> None:
    """Output and gradients of `run` on the sharded stack against the unsharded loop's."""
    try:
        found = (_value_and_grad if eager else _jitted_value_and_grad)(run, sharded, *args)
    except Exception as e:
        results[name] = [f"{type(e).__name__}: {str(e)[:500]}"]
        return
    results[name] = _differences(found, expected) + _misplaced(found[1], sharded)


def _mesh(shape: tuple[int, ...], names: tuple[str, ...], kind: str) -> Any:
    devices = jax.devices()[: int(np.prod(shape))]
    if kind == "explicit":  # JAX's default: Explicit axes (since JAX 0.7)
        return jax.make_mesh(shape, names, devices=devices)
    return jax.make_mesh(shape, names, (AxisType.Auto,) * len(shape), devices=devices)


def _eager_context(mesh: Any, kind: str) -> Any:
    # Eager differentiation on Explicit axes needs the mesh as context (a JAX requirement).
    return jax.set_mesh(mesh) if kind == "explicit" else contextlib.nullcontext()


def _fold_with(remat: Any) -> Callable[[Any, Array], Array]:
    return lambda stacked, x: eqx_lean.fold(stacked, x, remat=remat)


def _mlp_checks(results: dict[str, Any], devices: int, kind: str, slow: bool) -> None:
    """An Equinox MLP, unchanged: remat modes jitted, and eagerly."""
    mesh = _mesh((devices,), ("data",), kind)
    results[f"{kind}/axis-types"] = [t.name for t in mesh.axis_types]
    keys = jax.random.split(jax.random.key(0), NUM_LAYERS)
    reference = eqx_lean.build_stacked(make_mlp, keys)
    sharded = eqx_lean.build_stacked(make_mlp, keys, sharding=eqx_lean.fsdp(mesh))
    x = jax.random.normal(jax.random.key(1), (DIM,))
    expected = _expected(_loop_fold, reference, x)
    for name, remat in REMATS.items():
        if slow or name in DEFAULT_REMATS:
            _compare(results, f"{kind}/mlp/fold/{name}", _fold_with(remat), sharded, expected, x)
    with _eager_context(mesh, kind):
        _compare(results, f"{kind}/mlp/eager", eqx_lean.fold, sharded, expected, x, eager=True)
    try:
        eager_forward = eqx_lean.fold(sharded, x)
        results[f"{kind}/mlp/eager-forward"] = _differences(eager_forward, expected[0])
    except Exception as e:
        results[f"{kind}/mlp/eager-forward"] = [f"{type(e).__name__}: {e}"]


def _attention_checks(results: dict[str, Any], devices: int, kind: str) -> None:
    """Equinox attention with a per-layer KV cache, through `scan`."""
    mesh = _mesh((devices,), ("data",), kind)
    keys = jax.random.split(jax.random.key(0), NUM_LAYERS)
    reference = eqx_lean.build_stacked(make_attention, keys)
    sharded = eqx_lean.build_stacked(make_attention, keys, sharding=eqx_lean.fsdp(mesh))
    args = (
        jax.random.normal(jax.random.key(2), (3, DIM)),
        jax.random.normal(jax.random.key(3), (NUM_LAYERS, 5, DIM)),
    )

    def scan(stacked: Any, x: Array, cache: Array) -> Any:
        call = lambda layer, x, c: layer(x, c)  # noqa: E731
        return eqx_lean.scan(stacked, x, cache, call=call, remat=True)

    expected = _expected(_loop_scan, reference, *args)
    _compare(results, f"{kind}/attention/scan", scan, sharded, expected, *args)


def _block_checks(results: dict[str, Any], devices: int, kind: str, slow: bool) -> None:
    """A Mistral-shaped block, bfloat16 weights and float32 norms, on a batch sharded over the
    mesh axis that shards the stack (data parallel + fsdp), or over another one."""
    mesh = _mesh((devices,), ("data",), kind)
    keys = jax.random.split(jax.random.key(0), NUM_LAYERS)
    reference = eqx_lean.build_stacked(make_block, keys, norms_in_float32)
    sharded = eqx_lean.build_stacked(make_block, keys, norms_in_float32, eqx_lean.fsdp(mesh))
    x = jax.random.normal(jax.random.key(4), (devices, 6, BLOCK.dim))
    expected = _expected(_loop_fold, reference, x)
    x_data = jax.device_put(x, NamedSharding(mesh, P("data")))
    fold = _fold_with(True)
    _compare(results, f"{kind}/block/data-parallel", fold, sharded, expected, x_data)
    out_sharding = _jitted_value_and_grad(fold, sharded, x_data)[0].sharding
    results[f"{kind}/block/output-sharding"] = str(out_sharding.spec)
    if not slow:
        return
    mesh = _mesh((devices // 2, 2), ("data", "fsdp"), kind)
    fsdp = eqx_lean.fsdp(mesh, "fsdp")
    sharded = eqx_lean.build_stacked(make_block, keys, norms_in_float32, fsdp)
    x_data = jax.device_put(x, NamedSharding(mesh, P("data")))
    _compare(results, f"{kind}/block/data-and-fsdp-axes", fold, sharded, expected, x_data)


def _tensor_parallel_checks(results: dict[str, Any], devices: int, kind: str, slow: bool) -> None:
    mesh = _mesh((devices // 2, 2), ("data", "model"), kind)
    keys = jax.random.split(jax.random.key(5), NUM_LAYERS)
    reference = eqx_lean.build_stacked(make_parallel_mlp, keys)
    x = jax.random.normal(jax.random.key(6), (devices, DIM))
    expected = _expected(_loop_fold, reference, x)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    megatron = {"up": P("model", None), "down": P(None, "model")}

    def by_name(specs: dict[str, Any]) -> Callable[[Any, Any], Any]:
        return lambda path, leaf: NamedSharding(mesh, specs[jax.tree_util.keystr(path)[1:]])

    # Tensor parallel only, kept as it is: nothing is gathered.
    sharded = eqx_lean.build_stacked(make_parallel_mlp, keys, sharding=by_name(megatron))
    keep = lambda stacked, x: eqx_lean.fold(stacked, x, gather=False)  # noqa: E731
    _compare(results, f"{kind}/tp/keep", keep, sharded, expected, x)
    dynamic, static = eqx.partition(sharded, eqx.is_array)
    compiled = jax.jit(lambda d, x: keep(eqx.combine(d, static), x)).lower(dynamic, x).compile()
    results[f"{kind}/tp/keep-all-gathers"] = (compiled.as_text() or "").count("all-gather(")

    # fsdp over "data" and tensor parallel over "model": gathered over "data" only, with the
    # user's spec given in each form (or over both axes); the layer records what it received
    # (with Explicit axes; with Auto axes a traced array does not carry its sharding).
    both = {"up": P("model", "data"), "down": P("data", "model")}
    sharded = eqx_lean.build_stacked(make_parallel_mlp, keys, sharding=by_name(both))
    abstract = eqx.filter_eval_shape(make_parallel_mlp, keys[0])
    named = {name: NamedSharding(mesh, spec) for name, spec in megatron.items()}
    gathers = {
        "rule": lambda path, leaf: megatron[jax.tree_util.keystr(path)[1:]],
        "prefix-specs": eqx.tree_at(
            lambda m: (m.up, m.down), abstract, (megatron["up"], megatron["down"])
        ),
        "prefix-named": eqx.tree_at(
            lambda m: (m.up, m.down), abstract, (named["up"], named["down"])
        ),
        "one-spec": P(),
        "one-named": NamedSharding(mesh, P()),
    }
    for form, gather in gathers.items():
        if not (slow or form in DEFAULT_GATHER_FORMS):
            continue
        received: list[str] = []

        def call(layer: ParallelMLP, x: Array, received: list[str] = received) -> Array:
            received.append(str(jax.typeof(layer.up).sharding.spec))
            received.append(str(jax.typeof(layer.down).sharding.spec))
            return layer(x)

        def run(stacked: Any, x: Array, gather: Any = gather, call: Any = call) -> Array:
            return eqx_lean.fold(stacked, x, call=call, gather=gather)

        _compare(results, f"{kind}/tp/gather-{form}", run, sharded, expected, x)
        results[f"{kind}/tp/gather-{form}/received"] = sorted(set(received))


def _error_checks(results: dict[str, Any], devices: int) -> None:
    mesh = _mesh((devices,), ("data",), "explicit")
    keys = jax.random.split(jax.random.key(0), NUM_LAYERS)
    make_linear = lambda key: eqx.nn.Linear(6, 8, key=key)  # noqa: E731
    sharded = eqx_lean.build_stacked(make_linear, keys, sharding=eqx_lean.fsdp(mesh))
    last_axis = lambda path, leaf: P(*([None] * (leaf.ndim - 1)), "data")  # noqa: E731
    try:  # 4 or 8 devices do not divide the weight's 6 input features
        eqx_lean.fold(sharded, jnp.zeros(6), call=lambda layer, x: x, gather=last_axis)
        results["error/indivisible"] = "no error"
    except Exception as e:
        results["error/indivisible"] = f"{type(e).__name__}: {e}"


def _memory_checks(results: dict[str, Any]) -> None:
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    import sharded_forward  # pyright: ignore[reportMissingImports]

    for axis_type in (AxisType.Explicit, AxisType.Auto):
        results[f"memory/{axis_type.name}"] = sharded_forward.forward_memory(8, axis_type)


DEFAULT_REMATS = ("none", "true")
DEFAULT_GATHER_FORMS = ("rule", "one-spec")


def _device_checks(devices: int, slow: bool) -> dict[str, Any]:
    """Every check, on `devices` forced CPU devices; `slow` adds the rest of the matrix."""
    assert len(jax.devices()) == devices
    results: dict[str, Any] = {"devices": devices, "slow": slow}
    with jax.default_matmul_precision("highest"):
        for kind in ("explicit", "auto"):
            _mlp_checks(results, devices, kind, slow)
            _attention_checks(results, devices, kind)
            _block_checks(results, devices, kind, slow)
            _tensor_parallel_checks(results, devices, kind, slow)
    _error_checks(results, devices)
    if devices == 8:
        _memory_checks(results)
    return results


# --- the tests --------------------------------------------------------------------------------

_MARKER = "EQX_LEAN_RESULTS:"


def _run_devices(devices: int, slow: bool) -> dict[str, Any]:
    repo = str(Path(eqx_lean.__file__).resolve().parents[1])
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    env["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("JAX_PLATFORMS", None)
    command = [sys.executable, __file__, "devices", str(devices), *(["--slow"] if slow else [])]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARKER)]
    assert lines, f"no results printed; stdout ended with:\n{proc.stdout[-2000:]}"
    return json.loads(lines[-1][len(_MARKER) :])


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((8, False), id="8-devices"),
        pytest.param((4, True), id="4-devices-full", marks=pytest.mark.slow),
        pytest.param((8, True), id="8-devices-full", marks=pytest.mark.slow),
    ],
)
def sharded(request) -> dict[str, Any]:
    """The checks' results: by default a part of them on 8 devices, with `-m slow` all of them
    on 4 and on 8 devices (about a minute of CPU time each)."""
    devices, slow = request.param
    results = _run_devices(devices, slow)
    # The tests decide what to skip from these: they must be the run asked for.
    assert (results.get("devices"), results.get("slow")) == (devices, slow), results
    return results


KINDS = ["explicit", "auto"]


def _result(sharded: dict[str, Any], key: str, *, default: bool = True) -> Any:
    """The worker's result `key`, which must be there. A case outside the default run's part
    of the matrix (`default=False`) is skipped by a default run: the test decides, from the
    same constants the worker reads, never from a missing result."""
    if not (default or sharded["slow"]):
        pytest.skip(f"{key}: part of the full matrix, run with `-m slow`")
    assert key in sharded, f"the worker gave no result {key!r}"
    return sharded[key]


@pytest.mark.parametrize("kind", KINDS)
def test_make_mesh_default_is_explicit_and_auto_is_auto(sharded, kind):
    expected = ["Explicit"] if kind == "explicit" else ["Auto"]
    assert _result(sharded, f"{kind}/axis-types") == expected


@pytest.mark.parametrize("remat", list(REMATS))
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_mlp_fold_matches_unsharded_loop(sharded, kind, remat):
    """Outputs and gradients within 1e-5; gradients sharded as the stack is."""
    key = f"{kind}/mlp/fold/{remat}"
    assert _result(sharded, key, default=remat in DEFAULT_REMATS) == []


@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_mlp_fold_eagerly(sharded, kind):
    assert _result(sharded, f"{kind}/mlp/eager-forward") == []
    assert _result(sharded, f"{kind}/mlp/eager") == []


@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_attention_scan_with_kv_cache(sharded, kind):
    assert _result(sharded, f"{kind}/attention/scan") == []


@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_bfloat16_block_with_data_parallel_batch(sharded, kind):
    assert _result(sharded, f"{kind}/block/data-parallel") == []
    output_sharding = _result(sharded, f"{kind}/block/output-sharding")
    if kind == "explicit":  # with Auto axes, where the output lands is XLA's choice
        assert output_sharding == "P('data', None, None)"


@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_and_data_parallel_on_different_axes(sharded, kind):
    # The worker runs it in the full matrix only (`_block_checks` with `slow`).
    assert _result(sharded, f"{kind}/block/data-and-fsdp-axes", default=False) == []


@pytest.mark.parametrize("kind", KINDS)
def test_gather_false_keeps_tensor_parallel_shards(sharded, kind):
    assert _result(sharded, f"{kind}/tp/keep") == []
    assert _result(sharded, f"{kind}/tp/keep-all-gathers") == 0


GATHER_FORMS = ["rule", "prefix-specs", "prefix-named", "one-spec", "one-named"]


@pytest.mark.parametrize("form", GATHER_FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_gather_to_a_user_spec(sharded, kind, form):
    """fsdp over "data" and tensor parallel over "model", gathered over "data" only (or all)."""
    default = form in DEFAULT_GATHER_FORMS
    assert _result(sharded, f"{kind}/tp/gather-{form}", default=default) == []
    received = _result(sharded, f"{kind}/tp/gather-{form}/received")
    if kind == "explicit":
        if form.startswith("one-"):
            assert received == ["P(None, None)"]
        else:
            assert received == ["P('model', None)", "P(None, 'model')"]


def test_error_gather_spec_not_dividing_a_leaf(sharded):
    message = _result(sharded, "error/indivisible")
    assert message.startswith("ValueError: `gather`: leaf .weight of shape (8, 6)"), message
    assert "not divisible" in message, message


def test_forward_memory_is_a_shard_plus_a_few_layers(sharded):
    """Per device: stack / devices + 3 layers + 4 MiB of arguments, outputs and temporaries."""
    if sharded["devices"] != 8:
        pytest.skip("measured on 8 devices")
    for axis_type in ("Explicit", "Auto"):
        m = _result(sharded, f"memory/{axis_type}")
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


def _main(argv: list[str]) -> None:
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    results = _device_checks(int(argv[1]), slow="--slow" in argv)
    print(_MARKER + json.dumps(results), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])


def test_the_gather_barrier_is_lowered_for_cpu_only():
    # Its reason (a relayout of the whole stack) was measured on XLA:CPU only. One device is
    # enough: a layer sharded on a one-device axis is still gathered to its replicated spec.
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

    # scan's own barrier is one; the gather adds one, on CPU only.
    assert barriers(False, "cpu") + 1 == barriers(True, "cpu")
    assert barriers(True, "cuda") == barriers(False, "cuda") == 0
