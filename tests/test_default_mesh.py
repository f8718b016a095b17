"""JAX's default mesh: the HF decoder, LoRA, QLoRA and `fold` on Explicit mesh axes (what
`jax.make_mesh` gives), on Auto axes and on meshes mixing both, with batch-sharded inputs, the
mesh passed as shardings or set with `jax.set_mesh`, in one process and in two.

The oracle is the same computation on one device, without a mesh (float32: the losses within
1e-6), or on Auto axes, where XLA chooses every sharding (bfloat16: within 2^-8 of the largest
element, the rounding of one bfloat16 product summed in another order).
"""

import contextlib
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import TINY_DECODER, ProcessJob, free_port, print_results
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import eqx_lean
from eqx_lean import hf, lora


# Every test here shards over the eight forced CPU devices (on a GPU machine too).
pytestmark = pytest.mark.cpu_mesh


# Qwen2's shape: q/k/v biases and a head tied to the embedding, so that a bias, a norm's weight
# and the vocabulary rows are all split by `fsdp` beside a batch split over the same axis.
CONFIG = hf.DecoderConfig(
    **dict(
        TINY_DECODER,
        model_type="qwen2",
        attention_bias=True,
        tie_word_embeddings=True,
        dtype="float32",
    )
)
BATCH, SEQ, STEPS = 8, 16, 2
TARGETS = ("q_proj", "v_proj", "down_proj")
E, A = AxisType.Explicit, AxisType.Auto


def _ids() -> np.ndarray:
    shape, vocab = (BATCH, SEQ), CONFIG.vocab_size
    return np.asarray(jax.random.randint(jax.random.key(3), shape, 0, vocab, jnp.int32))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("default_mesh") / "base"
    model = hf.init(CONFIG, key=jax.random.key(0), norm_std=0.1)
    # Biases start at zero (HF's init): make them count.
    bias = model.layers.self_attn.q_proj.bias
    assert bias is not None
    model = eqx.tree_at(
        lambda m: m.layers.self_attn.q_proj.bias,
        model,
        0.1 * jax.random.normal(jax.random.key(5), bias.shape),
    )
    hf.save_hf(model, path)
    return path


def _mesh(kind: str) -> Mesh:
    if kind == "explicit":
        return jax.make_mesh((8,), ("data",))  # JAX's default: Explicit axes
    if kind == "auto":
        return jax.make_mesh((8,), ("data",), axis_types=(A,))
    if kind == "mixed":  # the batch's axis Explicit, the other Auto
        return jax.make_mesh((4, 2), ("data", "model"), axis_types=(E, A))
    assert kind == "mixed_auto_data"
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(A, E))


def _context(mesh: Mesh | None, set_mesh: bool) -> Any:
    return jax.set_mesh(mesh) if set_mesh and mesh is not None else contextlib.nullcontext()


def lora_losses(
    path: Path, mesh: Mesh | None, *, set_mesh: bool = False, **load: Any
) -> list[float]:
    """The losses of `STEPS` LoRA steps of the checkpoint at `path`, loaded with `fsdp(mesh)`
    (unsharded without a mesh), on the ids split by rows over the mesh's "data" axis. Also run
    by each of the two processes of `test_two_processes_give_the_one_device_losses`."""
    with _context(mesh, set_mesh):
        model = hf.load_hf(path, sharding=None if mesh is None else eqx_lean.fsdp(mesh), **load)
        model = lora.add_lora(
            model, lora.LoraConfig(r=4, target_modules=TARGETS), key=jax.random.key(1)
        )
        adapters, frozen = eqx.partition(model, lora.lora_filter(model))
        optimizer = hf.adamw(1e-3)
        opt_state = optimizer.init(adapters)
        step = hf.make_lora_step(optimizer, remat=True)
        ids = _ids()
        if mesh is None:
            placed = jnp.asarray(ids)
        else:
            rows = NamedSharding(mesh, P("data", None))
            placed = jax.make_array_from_callback(ids.shape, rows, lambda index: ids[index])
        losses = []
        for _ in range(STEPS):
            adapters, opt_state, loss = step(frozen, adapters, opt_state, placed, None)
            losses.append(float(loss))
        # The adapters' update kept their placement (sharded as the base's dims, or replicated).
        for leaf in jax.tree.leaves(adapters):
            assert mesh is None or leaf.sharding.mesh == mesh
        return losses


@pytest.fixture(scope="module")
def one_device_losses(checkpoint: Path) -> list[float]:
    return lora_losses(checkpoint, None)


@pytest.mark.parametrize(
    ("kind", "set_mesh"),
    [
        ("explicit", False),
        ("explicit", True),
        ("auto", False),
        pytest.param("auto", True, marks=pytest.mark.slow),  # Auto axes worked before
    ],
    ids=["explicit-mesh_passed", "explicit-set_mesh", "auto-mesh_passed", "auto-set_mesh"],
)
def test_lora_step_gives_the_one_device_losses(checkpoint, one_device_losses, kind, set_mesh):
    """The blocker of issue 39: `load_hf(sharding=fsdp(mesh))` then `make_lora_step` on ids
    sharded `P("data", None)` failed at the embedding lookup on Explicit axes."""
    found = lora_losses(checkpoint, _mesh(kind), set_mesh=set_mesh)
    np.testing.assert_allclose(found, one_device_losses, rtol=0, atol=1e-6)
    assert found[1] < found[0]  # the step trains


# --- two jax.distributed processes, four CPU devices each ------------------------------------


@pytest.fixture(scope="module")
def two_processes(checkpoint: Path) -> list[Any]:
    port = free_port()
    commands = [[sys.executable, __file__, str(port), str(i), str(checkpoint)] for i in range(2)]
    return ProcessJob(commands, devices=4, timeout=240).results()


def test_two_processes_give_the_one_device_losses(two_processes, one_device_losses):
    """One 8-device mesh over two controllers (`jax.make_mesh`'s default axes), the mesh
    passed and set with `jax.set_mesh`: each process computes the same losses as one device."""
    assert sorted(out["process"] for out in two_processes) == [0, 1]
    for out in two_processes:
        assert out["devices"] == 8
        for found in (out["mesh_passed"], out["set_mesh"]):
            np.testing.assert_allclose(found, one_device_losses, rtol=0, atol=1e-6)


def _two_process_main(port: str, process_id: str, path: str) -> None:
    """One of the two processes: `python tests/test_default_mesh.py PORT PROCESS_ID PATH`."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=int(process_id),
        local_device_ids=list(range(4)),
    )
    mesh = jax.make_mesh((8,), ("data",))
    results = {
        "process": jax.process_index(),
        "devices": len(jax.devices()),
        "mesh_passed": lora_losses(Path(path), mesh),
        "set_mesh": lora_losses(Path(path), mesh, set_mesh=True),
    }
    jax.distributed.shutdown()
    print_results(results)


# --- a user's own model: bfloat16 base, its own linear type -----------------------------------


class Dense(eqx.Module):
    """A user's own `[out, in]` linear layer, adapted with `add_lora(..., types=(Dense,))`."""

    weight: jax.Array
    bias: jax.Array | None = None

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.weight.T


class Block(eqx.Module):
    up: Dense
    down: Dense

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jax.nn.gelu(self.up(x)))


def make_block(key: jax.Array) -> Block:
    k_up, k_down = jax.random.split(key)
    return Block(
        Dense(0.1 * jax.random.normal(k_up, (64, 32))),
        Dense(0.1 * jax.random.normal(k_down, (32, 64))),
    )


def user_model_gradient(mesh: Mesh, set_mesh: bool) -> list[np.ndarray]:
    """The adapters' gradient of a bfloat16 stack built with `fsdp(mesh)`, on a batch split
    over "data"."""
    with _context(mesh, set_mesh):
        keys = jax.random.split(jax.random.key(0), 4)
        stack = eqx_lean.build_stacked(make_block, keys, jnp.bfloat16, eqx_lean.fsdp(mesh))
        config = lora.LoraConfig(r=4, target_modules=("up", "down"))
        model = lora.add_lora(stack, config, key=jax.random.key(1), types=(Dense,))
        # Nonzero B, so that every adapter matrix gets a gradient.
        model = eqx.tree_at(
            lambda m: (m.up.lora_B, m.down.lora_B),
            model,
            (jnp.full_like(model.up.lora_B, 0.05), jnp.full_like(model.down.lora_B, -0.05)),
        )
        x = jax.random.normal(jax.random.key(2), (16, 32), jnp.bfloat16)
        x = jax.device_put(x, NamedSharding(mesh, P("data")))
        adapters, frozen = eqx.partition(model, lora.lora_filter(model))

        def loss(adapters: Any, frozen: Any, x: jax.Array) -> jax.Array:
            y = eqx_lean.fold(eqx.combine(adapters, frozen), x, remat=True)
            return jnp.sum(y.astype(jnp.float32) ** 2)

        grads = eqx.filter_jit(jax.grad(loss))(adapters, frozen, x)
        for g, a in zip(jax.tree.leaves(grads), jax.tree.leaves(adapters), strict=True):
            assert g.sharding.is_equivalent_to(a.sharding, a.ndim)  # sharded as the adapter
        return [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)]


@pytest.fixture(scope="module")
def auto_gradient() -> list[np.ndarray]:
    return user_model_gradient(_mesh("auto"), set_mesh=False)


@pytest.mark.parametrize("set_mesh", [False, True], ids=["mesh_passed", "set_mesh"])
def test_bfloat16_lora_gradient_of_a_user_model_on_explicit_axes(auto_gradient, set_mesh):
    """The other blocker: the bfloat16 product's backward contracted the batch-sharded axes
    without an `out_sharding` (`ShardingTypeError`)."""
    found = user_model_gradient(_mesh("explicit"), set_mesh)
    assert len(found) == len(auto_gradient) == 4
    for g, expected in zip(found, auto_gradient, strict=True):
        assert np.abs(expected).max() > 0
        assert np.abs(g - expected).max() <= 2**-8 * np.abs(expected).max()


# --- generation, full fine-tuning and QLoRA on every kind of mesh -----------------------------


@pytest.mark.parametrize(
    ("kind", "set_mesh"),
    [("explicit", False), pytest.param("mixed", True, marks=pytest.mark.slow)],
)
def test_generate_from_a_sharded_prompt(checkpoint, kind, set_mesh):
    """The cache follows the prompt's batch sharding; the tokens are the one-device ones."""
    ids = _ids()[:, :4]
    expected = np.asarray(hf.generate(hf.load_hf(checkpoint), jnp.asarray(ids), 3))
    mesh = _mesh(kind)
    with _context(mesh, set_mesh):
        model = hf.load_hf(checkpoint, sharding=eqx_lean.fsdp(mesh))
        prompt = jax.device_put(ids, NamedSharding(mesh, P("data", None)))
        found = hf.generate(model, prompt, 3)
    np.testing.assert_array_equal(np.asarray(found), expected)


def test_kv_cache_placed_as_asked():
    config = CONFIG
    sharding = NamedSharding(_mesh("explicit"), P(None, "data"))
    cache = hf.KVCache.empty(config, BATCH, 5, jnp.float32, out_sharding=sharding)
    assert cache.keys.sharding == cache.values.sharding == sharding
    assert cache.slot_positions.sharding.is_fully_replicated
    assert np.all(np.asarray(cache.slot_positions) == -1)


def test_full_fine_tuning_step_on_explicit_axes(checkpoint):
    """`make_train_step` (every weight trained): the one-device loss and update, every updated
    weight sharded as it was."""

    def step_of(mesh: Mesh | None) -> tuple[float, Any, Any]:
        model = hf.load_hf(checkpoint, sharding=None if mesh is None else eqx_lean.fsdp(mesh))
        # Plain SGD: the update is the gradient, scaled (Adam's first step is about the
        # gradient's sign, which rounding decides for gradients near zero).
        optimizer = optax.sgd(0.1)
        opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
        ids = jnp.asarray(_ids())
        if mesh is not None:
            ids = jax.device_put(ids, NamedSharding(mesh, P("data", None)))
        placements = [x.sharding for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
        new, _, loss = hf.make_train_step(optimizer)(model, opt_state, ids)
        return float(loss), new, placements

    expected, expected_model, _ = step_of(None)
    loss, model, placements = step_of(_mesh("explicit"))
    assert abs(loss - expected) <= 1e-6
    new_leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    for leaf, placed in zip(new_leaves, placements, strict=True):
        assert leaf.sharding.is_equivalent_to(placed, leaf.ndim)
    one_device = jax.tree.leaves(eqx.filter(expected_model, eqx.is_array))
    for leaf, one in zip(new_leaves, one_device, strict=True):
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(one), rtol=0, atol=1e-6)


def qlora_loss(path: Path, mesh: Mesh) -> float:
    """The loss of one QLoRA step (an NF4 base of a bfloat16 model) of two micro-batches of
    four rows, the adapters placed on the base's mesh."""
    model = hf.load_hf(path, sharding=eqx_lean.fsdp(mesh), quantize="nf4", dtype=jnp.bfloat16)
    config = lora.LoraConfig(r=4, target_modules=("q_proj", "down_proj"))
    model = lora.add_lora(model, config, key=jax.random.key(1))
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    for leaf in jax.tree.leaves(adapters):
        assert leaf.sharding.mesh == mesh
    optimizer = hf.adamw(1e-3)
    step = hf.make_lora_step(optimizer, grad_accum=2)
    ids = jax.device_put(_ids(), NamedSharding(mesh, P("data", None)))
    _, _, loss = step(frozen, adapters, optimizer.init(adapters), ids, None)
    return float(loss)


@pytest.fixture(scope="module")
def auto_qlora_loss(checkpoint: Path) -> float:
    return qlora_loss(checkpoint, _mesh("auto"))


@pytest.mark.parametrize(
    "kind",
    [
        "explicit",
        # The batch's axis Explicit: the explicit case's code paths (the fold test below
        # checks mixed meshes' gradients in the default tier).
        pytest.param("mixed", marks=pytest.mark.slow),
        "mixed_auto_data",  # the quantised load's writes on a mesh whose fsdp axis is Auto
    ],
)
def test_qlora_step_with_gradient_accumulation(checkpoint, auto_qlora_loss, kind):
    """Eight rows over eight devices in two micro-batches: a micro-batch cannot be split over
    the batch's axis (it is replicated), which on Explicit axes JAX cannot reshape into."""
    # bfloat16 logits, each product's sum ordered by its per-device shape: within their rounding.
    found = qlora_loss(checkpoint, _mesh(kind))
    assert abs(found - auto_qlora_loss) <= 2**-8 * abs(auto_qlora_loss)


def masked_lora_step(path: Path, mesh: Mesh | None) -> tuple[float, Any]:
    """One LoRA SGD step of two micro-batches of four rows whose prompts (0 to 14 tokens) are
    masked with -100 (51 and 20 targets), the labels sharded like the ids: the loss and the
    updated adapters."""
    model = hf.load_hf(path, sharding=None if mesh is None else eqx_lean.fsdp(mesh))
    config = lora.LoraConfig(r=4, target_modules=TARGETS)
    model = lora.add_lora(model, config, key=jax.random.key(1))
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    optimizer = optax.sgd(0.1)
    step = hf.make_lora_step(optimizer, grad_accum=2)
    ids = _ids()
    labels = ids.copy()
    for row in range(BATCH):
        labels[row, : 2 * row] = -100
    placed = [jnp.asarray(ids), jnp.asarray(labels)]
    if mesh is not None:
        rows = NamedSharding(mesh, P("data", None))
        placed = [jax.device_put(x, rows) for x in (ids, labels)]
    new, _, loss = step(frozen, adapters, optimizer.init(adapters), placed[0], None, placed[1])
    return float(loss), new


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_masked_labels_sharded_like_the_ids_in_micro_batches(checkpoint, kind):
    """`labels` cut into micro-batches as the ids are (gathered, then each micro-batch's rows
    sharded or replicated on Explicit axes): the one-device loss and update."""
    expected, expected_adapters = masked_lora_step(checkpoint, None)
    loss, adapters = masked_lora_step(checkpoint, _mesh(kind))
    assert abs(loss - expected) <= 1e-6 * abs(expected)
    for leaf, one in zip(
        jax.tree.leaves(adapters), jax.tree.leaves(expected_adapters), strict=True
    ):
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(one), rtol=0, atol=1e-6)


# --- fold on meshes mixing Explicit and Auto axes ---------------------------------------------


class Layer(eqx.Module):
    weight: jax.Array
    scale: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(x @ self.weight.T) * self.scale.reshape((1,) * (x.ndim - 1) + (-1,))


def make_layer(key: jax.Array) -> Layer:
    return Layer(0.1 * jax.random.normal(key, (64, 64)), jnp.linspace(0.5, 1.5, 64))


@pytest.mark.parametrize("batched", ["vmap", "rows"])
@pytest.mark.parametrize("types", [(E, A), (A, E)], ids=["explicit_data", "auto_data"])
def test_fold_gradient_on_a_mixed_mesh_is_sharded_as_the_stack(types, batched):
    """`fsdp` over "data" of a mesh whose other axis is of the other kind: the build, and the
    gradient (through the engine's own backward loop, or through JAX's transpose of the scan
    under `vmap`) comes back sharded as the stack, with the unsharded loop's values."""
    keys = jax.random.split(jax.random.key(0), 2)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=types)
    stack = eqx_lean.build_stacked(make_layer, keys, jnp.float32, eqx_lean.fsdp(mesh))
    reference = eqx.filter_vmap(make_layer)(keys)
    x = jax.random.normal(jax.random.key(1), (8, 64))

    def loss(stack: Any, x: jax.Array) -> jax.Array:
        if batched == "vmap":
            return jnp.sum(jax.vmap(lambda row: eqx_lean.fold(stack, row, remat=True))(x))
        return jnp.sum(eqx_lean.fold(stack, x, remat=True))

    def loop_loss(stack: Any, x: jax.Array) -> jax.Array:
        for layer in eqx_lean.unstack(stack):
            x = layer(x)
        return jnp.sum(x)

    found = eqx.filter_jit(jax.grad(loss))(stack, jax.device_put(x, NamedSharding(mesh, P("data"))))
    expected = jax.jit(jax.grad(loop_loss))(reference, x)
    leaves = (jax.tree.leaves(found), jax.tree.leaves(stack), jax.tree.leaves(expected))
    for g, s, e in zip(*leaves, strict=True):
        assert g.sharding.is_equivalent_to(s.sharding, s.ndim), (g.sharding, s.sharding)
        # Float32 sums in another order: within 1e-5 of the leaf's scale (as in test_gather).
        g, e = np.asarray(g), np.asarray(e)
        assert np.abs(g - e).max() <= 1e-5 * max(1.0, np.abs(e).max())


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_build_under_set_mesh_without_sharding_is_replicated_on_it(kind):
    """`sharding=None` is JAX's default placement: under `jax.set_mesh`, replicated over the
    mesh (as `jnp.zeros` there), bitwise the `filter_vmap` stack. On Explicit axes it was an
    error: the writes were traced on the mesh, the buffers allocated off it."""
    keys = jax.random.split(jax.random.key(0), 3)
    mesh = _mesh(kind)
    with jax.set_mesh(mesh):
        built = eqx_lean.build_stacked(make_layer, keys, jnp.bfloat16)
    expected = eqx.filter_vmap(make_layer)(keys)
    for leaf, ref in zip(jax.tree.leaves(built), jax.tree.leaves(expected), strict=True):
        assert leaf.sharding.mesh == mesh and leaf.sharding.is_fully_replicated
        np.testing.assert_array_equal(
            np.asarray(leaf).view(np.uint16), np.asarray(ref.astype(jnp.bfloat16)).view(np.uint16)
        )


if __name__ == "__main__":
    _two_process_main(*sys.argv[1:])
