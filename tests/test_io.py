import functools
import inspect
import json
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from harness import arrays, assert_bitwise_equal, bits, keys_of, mesh_of, subprocess_env
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors import safe_open

import eqx_lean
from eqx_lean.internal import chunks, io_load


REPO = Path(__file__).resolve().parent.parent


class Block(eqx.Module):
    attn: eqx.nn.Linear
    mlp: eqx.nn.Linear
    norm: jax.Array
    position: jax.Array

    def __init__(self, *, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.attn = eqx.nn.Linear(8, 8, use_bias=False, key=k1)
        self.mlp = eqx.nn.Linear(8, 12, key=k2)
        self.norm = 1 + jax.random.normal(k3, (8,))
        self.position = jax.random.randint(k4, (3,), 0, 100)


HF_BLOCK = {
    ".attn.weight": "model.layers.{i}.self_attn.q_proj.weight",
    ".mlp.weight": "model.layers.{i}.mlp.up_proj.weight",
    ".mlp.bias": "model.layers.{i}.mlp.up_proj.bias",
    ".norm": "model.layers.{i}.input_layernorm.weight",
    ".position": "model.layers.{i}.position",
}


def hf_names(path, leaf):
    return HF_BLOCK[jax.tree_util.keystr(path)]


def make_block(key):
    return Block(key=key)


def keep_norm_f32(path, leaf):
    return jnp.float32 if jax.tree_util.keystr(path) == ".norm" else jnp.bfloat16


def random_like(tree, dtype, seed):
    """Random arrays shaped like `tree`'s leaves, floating ones cast to `dtype` (or a rule)."""
    rng = np.random.default_rng(seed)

    def random_leaf(path, x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(rng.integers(0, 100, x.shape, dtype=x.dtype))
        target = dtype(path, x) if inspect.isfunction(dtype) else dtype
        return jnp.asarray(rng.standard_normal(x.shape, dtype=np.float32).astype(target))

    return jax.tree_util.tree_map_with_path(random_leaf, tree)


def abstract(tree):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, tree
    )


@functools.cache
def build(num_layers, dtype, seed=0):
    """A stacked Block of random values and its abstract twin (never mutated by the tests)."""
    keys = keys_of(num_layers)
    stacked = random_like(eqx.filter_eval_shape(eqx.filter_vmap(make_block), keys), dtype, seed)
    return stacked, abstract(stacked)


def write_header_file(path, header: dict, data: bytes, header_len=None):
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    length = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + raw + data)


# --------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, keep_norm_f32])
def test_round_trip_is_bitwise_exact(dtype, tmp_path):
    stacked, like = build(4, dtype)
    eqx_lean.save_stacked(tmp_path / "ckpt", stacked, hf_names)
    loaded = eqx_lean.load_stacked(tmp_path / "ckpt", like, hf_names)
    assert_bitwise_equal(loaded, stacked)
    assert type(loaded) is Block


def test_round_trip_into_the_abstract_twin_of_build_stacked(tmp_path):
    # The abstract target as the docs suggest building it.
    keys = keys_of(3, 3)
    like = eqx.filter_eval_shape(eqx_lean.build_stacked, make_block, keys, keep_norm_f32)
    stacked = random_like(like, keep_norm_f32, seed=3)
    eqx_lean.save_stacked(tmp_path / "ckpt", stacked, hf_names)
    loaded = eqx_lean.load_stacked(tmp_path / "ckpt", like, hf_names)
    assert_bitwise_equal(loaded, stacked)
    assert type(loaded) is Block


def test_round_trip_through_several_files_with_index(tmp_path):
    stacked, like = build(5, keep_norm_f32)
    eqx_lean.save_stacked(tmp_path / "ckpt", stacked, hf_names, max_shard_bytes=300)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "model.safetensors.index.json" in files
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert_bitwise_equal(eqx_lean.load_stacked(tmp_path / "ckpt", like, hf_names), stacked)


@pytest.mark.quick
def test_saved_files_are_read_by_safetensors_itself(tmp_path):
    stacked, _ = build(3, keep_norm_f32)
    eqx_lean.save_stacked(tmp_path / "ckpt", stacked, hf_names, max_shard_bytes=400)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    expected = {HF_BLOCK[k].format(i=i) for k in HF_BLOCK for i in range(3)}
    assert set(index["weight_map"]) == expected
    leaves = {
        ".attn.weight": stacked.attn.weight,
        ".mlp.weight": stacked.mlp.weight,
        ".mlp.bias": stacked.mlp.bias,
        ".norm": stacked.norm,
        ".position": stacked.position,
    }
    seen = set()
    for file in set(index["weight_map"].values()):
        tensors = safetensors.numpy.load_file(tmp_path / "ckpt" / file)
        with safe_open(tmp_path / "ckpt" / file, "numpy") as f:
            assert f.metadata() == {"format": "pt"}
        for name, value in tensors.items():
            assert index["weight_map"][name] == file
            key, layer = next(
                (k, i) for k in HF_BLOCK for i in range(3) if HF_BLOCK[k].format(i=i) == name
            )
            reference = np.asarray(leaves[key][layer])
            assert value.dtype == reference.dtype
            np.testing.assert_array_equal(bits(value), bits(reference))
            seen.add(name)
    assert seen == expected
    assert index["metadata"]["total_size"] == sum(x.nbytes for x in arrays(stacked))


def test_single_file_has_no_index(tmp_path):
    stacked, _ = build(2, jnp.bfloat16)
    eqx_lean.save_stacked(tmp_path / "ckpt", stacked, hf_names, metadata={"note": "x"})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["model.safetensors"]
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "numpy") as f:
        assert f.metadata() == {"format": "pt", "note": "x"}
        assert len(list(f.keys())) == 2 * len(HF_BLOCK)


def test_saved_tensors_start_64_byte_aligned(tmp_path):
    # Aligned tensors are used in place from the page cache when loading on CPU.
    stacked = {"odd": jnp.zeros((3, 5), jnp.bfloat16), "w": jnp.ones((3, 32, 4), jnp.float32)}
    eqx_lean.save_stacked(tmp_path / "ckpt", stacked, {"odd": "odd.{i}", "w": "w.{i}"})
    raw = (tmp_path / "ckpt" / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    starts = {
        n: 8 + length + e["data_offsets"][0] for n, e in header.items() if n != "__metadata__"
    }
    assert all(starts[f"w.{i}"] % 64 == 0 for i in range(3)), starts
    loaded = safetensors.numpy.load_file(tmp_path / "ckpt" / "model.safetensors")
    assert sorted(loaded) == sorted(starts)


def test_load_from_files_written_by_safetensors_casts_and_transposes(tmp_path, getkey):
    rng = np.random.default_rng(0)
    num_layers = 3
    q = rng.standard_normal((num_layers, 8, 8), dtype=np.float32)
    up = rng.standard_normal((num_layers, 12, 8), dtype=np.float32)
    bias = rng.standard_normal((num_layers, 12), dtype=np.float32)
    norm = rng.standard_normal((num_layers, 8), dtype=np.float32).astype(np.float16)
    position = rng.integers(0, 100, (num_layers, 3), dtype=np.int32)
    # The up-projection is stored as [in, out], the transpose of eqx.nn.Linear's layout.
    first = {f"model.layers.{i}.self_attn.q_proj.weight": q[i] for i in range(num_layers)}
    first |= {f"model.layers.{i}.mlp.up_proj.weight": up[i].T.copy() for i in range(num_layers)}
    second = {f"model.layers.{i}.mlp.up_proj.bias": bias[i] for i in range(num_layers)}
    second |= {f"model.layers.{i}.input_layernorm.weight": norm[i] for i in range(num_layers)}
    second |= {f"model.layers.{i}.position": position[i] for i in range(num_layers)}
    safetensors.numpy.save_file(first, tmp_path / "a.safetensors")
    safetensors.numpy.save_file(second, tmp_path / "b.safetensors")
    index = {
        "weight_map": {n: "a.safetensors" for n in first} | {n: "b.safetensors" for n in second}
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))

    names: dict[str, str | eqx_lean.TensorName] = dict(HF_BLOCK)
    names[".mlp.weight"] = eqx_lean.TensorName(HF_BLOCK[".mlp.weight"], transpose=(1, 0))
    _, like = build(num_layers, keep_norm_f32)
    loaded = eqx_lean.load_stacked(tmp_path, like, lambda p, _: names[jax.tree_util.keystr(p)])

    bf16 = ml_dtypes.bfloat16
    expected = {
        "q": q.astype(bf16),
        "up": up.astype(bf16),
        "bias": bias.astype(bf16),
        "norm": norm.astype(np.float32),
        "position": position,
    }
    found = {
        "q": loaded.attn.weight,
        "up": loaded.mlp.weight,
        "bias": loaded.mlp.bias,
        "norm": loaded.norm,
        "position": loaded.position,
    }
    for key, value in expected.items():
        assert found[key].dtype == value.dtype, key
        np.testing.assert_array_equal(bits(found[key]), bits(value))


class Model(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: Block
    norm: jax.Array
    head: eqx.nn.Linear

    def __init__(self, num_layers, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(37, 8, key=k1)
        self.blocks = eqx.filter_vmap(make_block)(jax.random.split(k2, num_layers))
        self.norm = jnp.ones(8)
        self.head = eqx.nn.Linear(8, 37, use_bias=False, key=k3)


def random_model(num_layers):
    like = eqx.filter_eval_shape(Model, num_layers, key=jax.random.key(1))
    return random_like(like, jnp.float32, 1)


HF_MODEL = {
    ".embed.weight": "model.embed_tokens.weight",
    ".norm": "model.norm.weight",
    ".head.weight": "lm_head.weight",
} | {".blocks" + k: v for k, v in HF_BLOCK.items()}


def hf_model_names(path, leaf):
    return HF_MODEL[jax.tree_util.keystr(path)]


def test_whole_model_with_plain_tensors_round_trips(tmp_path, monkeypatch):
    # Tiny pieces force plain tensors to be copied in several pieces, the last one shorter.
    monkeypatch.setattr(io_load, "_CHUNK_BYTES", 5 * 8 * 4)
    model = random_model(3)
    eqx_lean.save_tensors(tmp_path / "ckpt", model, hf_model_names, max_shard_bytes=2000)
    like = eqx.filter_eval_shape(Model, 3, key=jax.random.key(1))
    loaded = eqx_lean.load_tensors(tmp_path / "ckpt", like, hf_model_names, dtype=jnp.bfloat16)
    reference = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        eqx.filter(model, eqx.is_array),
    )
    assert_bitwise_equal(loaded, reference)
    expected = {v.format(i=i) for v in HF_MODEL.values() for i in range(3)}
    written = set()
    for file in (tmp_path / "ckpt").glob("*.safetensors"):
        written |= set(safetensors.numpy.load_file(file))
    assert written == expected


def test_names_as_a_pytree_built_with_tree_at(tmp_path):
    stacked, like = build(2, jnp.float32)
    names = eqx.tree_at(
        lambda b: (b.attn.weight, b.mlp.weight, b.mlp.bias, b.norm, b.position),
        like,
        (
            "layers.{i}.q",
            eqx_lean.TensorName("layers.{i}.up", transpose=(1, 0)),
            "layers.{i}.up_bias",
            "layers.{i}.norm",
            "layers.{i}.position",
        ),
    )
    eqx_lean.save_stacked(tmp_path / "ckpt", stacked, names)
    stored = safetensors.numpy.load_file(tmp_path / "ckpt" / "model.safetensors")
    assert stored["layers.1.up"].shape == (8, 12)
    np.testing.assert_array_equal(stored["layers.1.up"], np.asarray(stacked.mlp.weight[1]).T)
    assert_bitwise_equal(eqx_lean.load_stacked(tmp_path / "ckpt", like, names), stacked)


def test_a_names_function_that_raises_names_the_leaf_and_the_path_convention(tmp_path):
    """`load_stacked`/`save_stacked` give `names` one layer's paths, `load_tensors`/
    `save_tensors` the whole model's: a map written for one, used with the other, fails with a
    message naming the leaf, the function and the convention, its KeyError the cause."""
    stacked, like = build(2, jnp.float32)
    eqx_lean.save_stacked(tmp_path / "blocks", stacked, hf_names)
    with pytest.raises(KeyError) as caught:
        eqx_lean.load_stacked(tmp_path / "blocks", like, hf_model_names)
    message = str(caught.value)
    assert message.startswith(
        "The `names` function of load_stacked raised KeyError: '.attn.weight' for leaf "
        ".attn.weight (float32[2, 8, 8]). load_stacked gives it paths relative to `like`, the "
        "stacked layers: one layer's paths"
    ), message
    assert "does not serve load_tensors/save_tensors (the whole model's paths)" in message
    assert "'Paths in rules and name functions' in docs/getting-started.md" in message
    assert isinstance(caught.value.__cause__, KeyError)
    with pytest.raises(KeyError, match="`names` function of save_stacked raised KeyError"):
        eqx_lean.save_stacked(tmp_path / "other", stacked, hf_model_names)

    model = random_model(2)
    with pytest.raises(KeyError, match=r"save_tensors raised KeyError: '\.embed\.weight'.*`tree`"):
        eqx_lean.save_tensors(tmp_path / "model", model, hf_names)
    eqx_lean.save_tensors(tmp_path / "model", model, hf_model_names)
    like_model = eqx.filter_eval_shape(Model, 2, key=jax.random.key(1))
    with pytest.raises(KeyError) as caught:
        eqx_lean.load_tensors(tmp_path / "model", like_model, hf_names)
    assert "load_tensors gives it paths relative to `like`, the whole model, such as " in str(
        caught.value
    )

    def not_a_key_error(path, leaf):
        raise RuntimeError("the map is broken")

    with pytest.raises(RuntimeError, match="load_stacked raised RuntimeError: the map is broken"):
        eqx_lean.load_stacked(tmp_path / "blocks", like, not_a_key_error)


def test_leaf_named_none_is_kept_from_like_and_not_saved(tmp_path):
    stacked, like = build(2, jnp.float32)

    def names(path, leaf):
        return None if jax.tree_util.keystr(path) == ".position" else hf_names(path, leaf)

    eqx_lean.save_stacked(tmp_path / "ckpt", stacked, names)
    assert not any(
        "position" in n
        for n in safetensors.numpy.load_file(tmp_path / "ckpt" / "model.safetensors")
    )
    like = eqx.tree_at(lambda b: b.position, like, stacked.position)
    loaded = eqx_lean.load_stacked(tmp_path / "ckpt", like, names)
    assert loaded.position is stacked.position
    assert_bitwise_equal(loaded, stacked)


def test_loading_never_touches_the_arrays_of_like(tmp_path):
    stacked, _ = build(3, jnp.bfloat16)
    eqx_lean.save_stacked(tmp_path / "ckpt", stacked, hf_names)
    like, _ = build(3, jnp.bfloat16, seed=7)
    before = [np.asarray(x).copy() for x in arrays(like)]
    loaded = eqx_lean.load_stacked(tmp_path / "ckpt", like, hf_names)
    assert_bitwise_equal(loaded, stacked)
    for x, old in zip(arrays(like), before, strict=True):
        assert not x.is_deleted()
        np.testing.assert_array_equal(bits(x), bits(old))
    for x, y in zip(arrays(loaded), arrays(like), strict=True):
        assert x is not y


def test_save_replaces_weights_and_keeps_other_files(tmp_path):
    old, like = build(4, jnp.float32, seed=0)
    new, _ = build(4, jnp.float32, seed=1)
    eqx_lean.save_stacked(tmp_path / "ckpt", old, hf_names, max_shard_bytes=300)
    (tmp_path / "ckpt" / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "ckpt" / "tokenizer").mkdir()
    (tmp_path / "ckpt" / "tokenizer" / "vocab.txt").write_text("a b c")
    eqx_lean.save_stacked(tmp_path / "ckpt", new, hf_names)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer",
    ]
    assert (tmp_path / "ckpt" / "config.json").read_text() == '{"hidden_size": 8}'
    assert (tmp_path / "ckpt" / "tokenizer" / "vocab.txt").read_text() == "a b c"
    assert_bitwise_equal(eqx_lean.load_stacked(tmp_path / "ckpt", like, hf_names), new)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary left behind


def test_save_killed_midway_leaves_previous_checkpoint_loadable(tmp_path):
    """A save killed (SIGKILL) after its third write, in a child process
    (`tests/workers/slow_save.py`, which saves over the checkpoint with these names and file
    size, each write slowed down)."""
    old = {"w": jnp.arange(6 * 16, dtype=jnp.float32).reshape(6, 4, 4)}
    names = {"w": "layers.{i}.w"}
    eqx_lean.save_stacked(tmp_path / "ckpt", old, names, max_shard_bytes=64)
    child = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "workers" / "slow_save.py"), str(tmp_path / "ckpt")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(),
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line == b"writing\n", line + child.stderr.read() if child.stderr else line
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    # The kill landed mid-save: a partial temporary checkpoint exists beside the old one.
    temporaries = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-")]
    assert len(temporaries) == 1 and any(temporaries[0].iterdir())
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), old)
    assert_bitwise_equal(eqx_lean.load_stacked(tmp_path / "ckpt", like, names), old)
    # And the next save goes through, saying that the dead save's directory lies beside it.
    with pytest.warns(UserWarning, match=r"leftovers of saves of it that died .*\.ckpt\.tmp-"):
        eqx_lean.save_stacked(tmp_path / "ckpt", {"w": old["w"] + 1}, names)
    assert_bitwise_equal(eqx_lean.load_stacked(tmp_path / "ckpt", like, names), {"w": old["w"] + 1})


# --------------------------------------------------------------------------------------------
# Sharding (the suite's 8 CPU devices)


# A checkpoint of 4 layers of three leaves (one stored transposed) and a plain embedding, its
# target, and shardings of it over a 2 x 4 mesh of axes "a" and "b".
SHARDED_NAMES = {
    "w": "l.{i}.w",
    "v": "l.{i}.v",
    "t": eqx_lean.TensorName("l.{i}.t", transpose=(1, 0)),
    "emb": "embed",
}
SHARDED_LIKE = {
    "w": jax.ShapeDtypeStruct((4, 8, 12), jnp.bfloat16),
    "v": jax.ShapeDtypeStruct((4, 8), jnp.float32),
    "t": jax.ShapeDtypeStruct((4, 8, 12), jnp.float32),
    "emb": jax.ShapeDtypeStruct((16, 8), jnp.float32),
}
# `sharding=`: per layer for the stacked leaves (the layer axis replicated), whole for `emb`.
PER_LAYER_SPECS = {"w": P("a", "b"), "v": P("b"), "t": P("b", "a"), "emb": P("b", None)}
# The shardings the loaded arrays carry: the stacked leaves' layer axis replicated.
STACKED_SPECS = {
    "w": P(None, "a", "b"),
    "v": P(None, "b"),
    "t": P(None, "b", "a"),
    "emb": P("b", None),
}
# The slice of each stored tensor that one device holds (`t` is stored as [12, 8] per layer).
PER_DEVICE_SHAPES = {"l.{i}.w": (4, 3), "l.{i}.v": (2,), "l.{i}.t": (2, 6), "embed": (4, 8)}


class ShardedCheckpoint(NamedTuple):
    path: Path  # one safetensors file
    tensors: dict[str, np.ndarray]  # what it holds, by name
    reference: dict[str, np.ndarray]  # SHARDED_LIKE's leaves, as loading must fill them
    mesh: Mesh  # 2 x 4 devices, axes "a" and "b"

    def shardings(self, specs: dict[str, P]) -> dict[str, NamedSharding]:
        return {k: NamedSharding(self.mesh, spec) for k, spec in specs.items()}


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory) -> ShardedCheckpoint:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 8, 12), dtype=np.float32)
    v = rng.standard_normal((4, 8), dtype=np.float32)
    t = rng.standard_normal((4, 8, 12), dtype=np.float32)
    emb = rng.standard_normal((16, 8), dtype=np.float32)
    tensors = {"embed": emb}
    for i in range(4):
        tensors |= {f"l.{i}.w": w[i], f"l.{i}.v": v[i], f"l.{i}.t": t[i].T.copy()}
    path = tmp_path_factory.mktemp("sharded") / "m.safetensors"
    safetensors.numpy.save_file(tensors, path)
    reference = {"w": w.astype(ml_dtypes.bfloat16), "v": v, "t": t, "emb": emb}
    return ShardedCheckpoint(path, tensors, reference, mesh_of((2, 4), ("a", "b")))


@pytest.mark.parametrize("host_writes", [True, False], ids=["host_writes", "compiled_writes"])
@pytest.mark.cpu_mesh
def test_sharded_load_on_8_devices_equals_unsharded(
    sharded_checkpoint, host_writes, monkeypatch, tmp_path
):
    """Host writes (CPU's default) and the compiled chunk writes that other platforms use place
    every leaf in its sharding with the unsharded load's values, each device reading only its
    own slice; saving the sharded arrays writes the tensors that were loaded."""
    path, tensors, reference, _ = sharded_checkpoint
    reads = []
    host_slice = io_load._host_slice

    def recording_host_slice(stored, name, index):
        value = host_slice(stored, name, index)
        reads.append((name.name, value.shape))
        return value

    monkeypatch.setattr(io_load, "_host_slice", recording_host_slice)
    monkeypatch.setattr(io_load, "_CHUNK_BYTES", 2 * 8 * 4)  # compiled writes: a row per call
    unsharded = eqx_lean.load_tensors(path, SHARDED_LIKE, SHARDED_NAMES)
    monkeypatch.setattr(chunks, "HOST_WRITES", host_writes)
    reads.clear()
    shardings = sharded_checkpoint.shardings(PER_LAYER_SPECS)
    sharded: dict[str, jax.Array] = eqx_lean.load_tensors(  # pyright: ignore[reportAssignmentType]
        path, SHARDED_LIKE, SHARDED_NAMES, sharding=shardings
    )
    expected_shardings = sharded_checkpoint.shardings(STACKED_SPECS)
    for k, array in sharded.items():
        assert array.sharding.is_equivalent_to(expected_shardings[k], array.ndim), k
        assert array.dtype == reference[k].dtype, k
        np.testing.assert_array_equal(np.asarray(array), np.asarray(unsharded[k]))
        np.testing.assert_array_equal(np.asarray(array), reference[k])
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), reference[k][shard.index])
    # Each device reads only its own slice of each layer (or of a plain tensor); the compiled
    # writes read it in chunks: the embedding's 4-row shard one row at a time.
    assert reads
    for name, shape in reads:
        shard = PER_DEVICE_SHAPES[name]
        if host_writes:
            assert shape == shard, (name, shape)
        else:
            assert shape[1:] == shard[1:] and 1 <= shape[0] <= shard[0], (name, shape)
    if not host_writes:
        assert {shape for name, shape in reads if name == "embed"} == {(1, 8)}

    # Saving sharded arrays writes the same tensors (w was cast to bfloat16 on loading).
    eqx_lean.save_tensors(tmp_path / "resaved", sharded, SHARDED_NAMES, max_shard_bytes=999)
    resaved = {}
    for f in sorted((tmp_path / "resaved").glob("*.safetensors")):
        resaved |= safetensors.numpy.load_file(f)
    assert sorted(resaved) == sorted(tensors)
    for name, value in tensors.items():
        expected = value.astype(ml_dtypes.bfloat16) if name.endswith(".w") else value
        assert resaved[name].dtype == expected.dtype, name
        np.testing.assert_array_equal(resaved[name], expected)


@pytest.mark.cpu_mesh
def test_like_may_carry_the_stacked_sharding_with_the_layer_axis_replicated(sharded_checkpoint):
    """The ShapeDtypeStructs of `like` may carry shardings, as Orbax targets do: that of the
    stacked leaf, whose layer axis must be replicated (one that shards it is refused, naming
    `layer_axis=`)."""
    path, _, reference, mesh = sharded_checkpoint
    expected_shardings = sharded_checkpoint.shardings(STACKED_SPECS)
    like_sharded = {
        k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=expected_shardings[k])
        for k, s in SHARDED_LIKE.items()
    }
    again = eqx_lean.load_tensors(path, like_sharded, SHARDED_NAMES)
    for k, array in again.items():
        assert array.sharding.is_equivalent_to(expected_shardings[k], array.ndim), k
        np.testing.assert_array_equal(np.asarray(array), reference[k])
    layer_sharded = dict(
        like_sharded,
        v=jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=NamedSharding(mesh, P("a", "b"))),
    )
    with pytest.raises(ValueError) as caught:
        eqx_lean.load_tensors(path, layer_sharded, SHARDED_NAMES)
    assert "leaf ['v'] carries the stacked sharding" in str(caught.value), caught.value
    assert "layer_axis=" in str(caught.value), caught.value


@pytest.mark.cpu_mesh
def test_the_layer_axis_is_sharded_only_when_asked_for_by_layer_axis(sharded_checkpoint):
    path, _, reference, mesh = sharded_checkpoint
    by_stage = eqx_lean.load_tensors(
        path, SHARDED_LIKE, SHARDED_NAMES, sharding=P("b"), mesh=mesh, layer_axis="a"
    )
    for k in ("w", "v", "t"):
        assert by_stage[k].sharding.spec == P("a", "b"), (k, by_stage[k].sharding)
        np.testing.assert_array_equal(np.asarray(by_stage[k]), reference[k])
    assert by_stage["emb"].sharding.spec == P("b"), by_stage["emb"].sharding


@pytest.mark.cpu_mesh
def test_a_spec_covering_the_layer_axis_too_is_refused_and_says_why(sharded_checkpoint):
    """The meaning of `sharding=` before 0.2.0 (a spec of the stacked leaf, not of one layer's)."""
    path, _, _, mesh = sharded_checkpoint
    bad = dict(
        sharded_checkpoint.shardings(PER_LAYER_SPECS), v=NamedSharding(mesh, P(("a", "b"), None))
    )
    with pytest.raises(ValueError) as caught:
        eqx_lean.load_tensors(path, SHARDED_LIKE, SHARDED_NAMES, sharding=bad)
    assert "leaf ['v'] of shape (8,)" in str(caught.value), caught.value
    assert "Since eqx_lean 0.2.0 `sharding` is per layer" in str(caught.value), caught.value


def test_one_sharding_for_every_leaf(saved):
    file, like = saved
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    loaded = eqx_lean.load_stacked(file, like, hf_names, sharding=sharding)
    for x in arrays(loaded):
        assert x.sharding == sharding and x.committed
    assert_bitwise_equal(loaded, eqx_lean.load_stacked(file, like, hf_names))


@pytest.mark.cpu_mesh
def test_orbax_recipe_restores_into_a_sharded_abstract_target(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")

    def make_layer(key):
        return eqx.nn.MLP(8, 8, 16, 1, key=key)

    keys = keys_of(4)
    stacked = eqx_lean.build_stacked(make_layer, keys, jnp.bfloat16)

    with ocp.StandardCheckpointer() as checkpointer:
        # Save: the array leaves only; the static part is code, rebuilt on restore.
        checkpointer.save(str(tmp_path / "orbax"), eqx.filter(stacked, eqx.is_array))
        checkpointer.wait_until_finished()

        # Restore straight into sharded buffers described by an abstract target.
        mesh = mesh_of((2, 4), ("layers", "model"))
        abstract = eqx.filter_eval_shape(eqx_lean.build_stacked, make_layer, keys, jnp.bfloat16)

        def with_sharding(x):
            spec = P("layers", "model") if x.ndim >= 2 else P("layers")
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

        params, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
        target = jax.tree.map(with_sharding, params)
        restored = eqx.combine(checkpointer.restore(str(tmp_path / "orbax"), target), static)

    for a, b in zip(arrays(restored), arrays(stacked), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert len(a.addressable_shards) == 8
        assert a.addressable_shards[0].data.shape[0] == 2  # 4 layers over 2 devices
        np.testing.assert_array_equal(bits(a), bits(b))


# --------------------------------------------------------------------------------------------
# Errors


@pytest.fixture
def saved(tmp_path):
    stacked, like = build(4, jnp.float32)
    eqx_lean.save_stacked(tmp_path / "ckpt", stacked, hf_names)
    return tmp_path / "ckpt" / "model.safetensors", like


def test_missing_tensors_are_listed_with_a_count(saved):
    file, like = saved
    _, longer = build(7, jnp.float32)
    with pytest.raises(KeyError, match=r"15 are missing: 'model\.layers\.4\..*and 10 more"):
        eqx_lean.load_stacked(file, longer, hf_names)


def test_shape_mismatch_names_the_tensor(saved, no_allocation):
    file, like = saved
    wrong = eqx.tree_at(lambda b: b.mlp.weight, like, jax.ShapeDtypeStruct((4, 10, 8), jnp.float32))
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.mlp\.up_proj\.weight' \(for leaf \.mlp\.weight\) in .* has "
        r"shape \[12, 8\]; expected \[10, 8\]",
    ):
        eqx_lean.load_stacked(file, wrong, hf_names)


def test_dtype_mismatches_name_the_tensor(saved, no_allocation):
    file, like = saved
    as_int = eqx.tree_at(lambda b: b.norm, like, jax.ShapeDtypeStruct((4, 8), jnp.int32))
    with pytest.raises(
        ValueError, match=r"input_layernorm.weight.* has dtype float32; expected int32"
    ):
        eqx_lean.load_stacked(file, as_int, hf_names)
    as_float = eqx.tree_at(lambda b: b.position, like, jax.ShapeDtypeStruct((4, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"position.* has dtype int32; expected a floating dtype"):
        eqx_lean.load_stacked(file, as_float, hf_names)


def test_file_truncated_by_one_byte_fails_before_allocating(saved, no_allocation):
    file, like = saved
    data = file.read_bytes()
    file.write_bytes(data[:-1])
    with pytest.raises(
        ValueError, match=r"not a valid safetensors file: .* the file holds only .* \(1 missing\)"
    ):
        eqx_lean.load_stacked(file, like, hf_names)


def test_file_with_trailing_bytes_is_refused(saved, no_allocation):
    file, like = saved
    file.write_bytes(file.read_bytes() + b"\0")
    with pytest.raises(ValueError, match=r"1 unexpected trailing bytes"):
        eqx_lean.load_stacked(file, like, hf_names)


@pytest.mark.parametrize(
    "header, data, header_len, match",
    [
        (
            {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            10**12,
            "header length field says",
        ),
        (
            {"x": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "has dtype 'Q7'",
        ),
        (
            {"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            r"needs 12 bytes but its data_offsets \[0, 8\] span 8",
        ),
        (
            {"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "non-negative integers",
        ),
        (
            {
                "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "y": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
            },
            b"\0" * 12,
            None,
            "without gaps or overlaps",
        ),
        ({"x": [1, 2]}, b"", None, "is not an object"),
        ([1, 2], b"", None, "header is not a JSON object"),
    ],
)
def test_structurally_invalid_files_are_refused(
    tmp_path, no_allocation, header, data, header_len, match
):
    file = tmp_path / "bad.safetensors"
    write_header_file(file, header, data, header_len)
    like = {"x": jax.ShapeDtypeStruct((2,), jnp.float32)}
    with pytest.raises(ValueError, match=match):
        eqx_lean.load_tensors(file, like, {"x": "x"})


def test_header_that_is_not_json_is_refused(tmp_path, no_allocation):
    file = tmp_path / "bad.safetensors"
    file.write_bytes(struct.pack("<Q", 8) + b"{not json")
    with pytest.raises(ValueError, match="header is not valid UTF-8 JSON"):
        eqx_lean.load_tensors(file, {"x": jax.ShapeDtypeStruct((), jnp.float32)}, {"x": "x"})


def test_tiny_file_is_refused(tmp_path):
    file = tmp_path / "bad.safetensors"
    file.write_bytes(b"\1\0")
    with pytest.raises(ValueError, match="fewer than the 8-byte header length"):
        eqx_lean.load_tensors(file, {"x": jax.ShapeDtypeStruct((), jnp.float32)}, {"x": "x"})


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickle_checkpoints_are_refused_with_a_conversion_hint(tmp_path, name):
    (tmp_path / name).write_bytes(b"PK\x03\x04 whatever")
    like = {"x": jax.ShapeDtypeStruct((), jnp.float32)}
    for path in (tmp_path / name, tmp_path):
        with pytest.raises(
            ValueError, match=r"pickle checkpoint.*save_pretrained\(dst, safe_serialization=True\)"
        ):
            eqx_lean.load_tensors(path, like, {"x": "x"})


def test_pickle_disguised_as_safetensors_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x80\x02}q\x00." + b"\0" * 8)
    with pytest.raises(ValueError, match="pickle checkpoint"):
        eqx_lean.load_tensors(tmp_path, {"x": jax.ShapeDtypeStruct((), jnp.float32)}, {"x": "x"})


def test_directory_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no model.safetensors.index.json and no"):
        eqx_lean.load_tensors(tmp_path, {"x": jax.ShapeDtypeStruct((), jnp.float32)}, {"x": "x"})
    with pytest.raises(FileNotFoundError, match="must name existing files"):
        eqx_lean.load_tensors(tmp_path / "nope.safetensors", {}, {})
    with pytest.raises(TypeError, match="`path` must be a safetensors file"):
        eqx_lean.load_tensors(3, {}, {})  # pyright: ignore[reportArgumentType]


def test_inconsistent_index_is_refused(tmp_path):
    safetensors.numpy.save_file({"x": np.zeros(2, np.float32)}, tmp_path / "a.safetensors")
    like = {"x": jax.ShapeDtypeStruct((2,), jnp.float32)}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "b.safetensors"}}))
    with pytest.raises(ValueError, match="refers to b.safetensors, which does not exist"):
        eqx_lean.load_tensors(tmp_path, like, {"x": "x"})
    index.write_text(json.dumps({"weight_map": {"x": "a.safetensors", "y": "a.safetensors"}}))
    with pytest.raises(ValueError, match="as the file holding tensor 'y', but that file has no"):
        eqx_lean.load_tensors(tmp_path, like, {"x": "x"})
    index.write_text("[]")
    with pytest.raises(ValueError, match="must be a JSON object with a `weight_map`"):
        eqx_lean.load_tensors(tmp_path, like, {"x": "x"})


def test_tensor_stored_twice_is_refused(tmp_path):
    for f in ("a", "b"):
        safetensors.numpy.save_file({"x": np.zeros(2, np.float32)}, tmp_path / f"{f}.safetensors")
    with pytest.raises(ValueError, match="'x' is stored twice"):
        eqx_lean.load_tensors(tmp_path, {"x": jax.ShapeDtypeStruct((2,), jnp.float32)}, {"x": "x"})


def test_bad_names_are_refused(saved):
    file, like = saved
    with pytest.raises(ValueError, match=r"has none at leaf \.attn\.weight"):
        eqx_lean.load_stacked(file, like, {"attn": {"weight": "model.layers.{i}.q"}})
    with pytest.raises(
        TypeError,
        match=r"must be a str, an `eqx_lean.TensorName` or None for leaf \.attn\.weight; got int",
    ):
        eqx_lean.load_stacked(file, like, lambda p, _: 3)
    with pytest.raises(
        ValueError,
        match=r"`load_stacked` needs every name to be a template with \{i\}.*use `load_tensors`",
    ):
        eqx_lean.load_stacked(file, like, lambda p, _: "model.norm.weight")
    with pytest.raises(ValueError, match=r"`TensorName.transpose` must be a permutation"):
        eqx_lean.TensorName("x", transpose=(0, 0))
    with pytest.raises(TypeError, match=r"`TensorName.name` must be a non-empty string"):
        eqx_lean.TensorName("")
    with pytest.raises(ValueError, match=r"must permute all 2 axes .* per layer; got \(0,\)"):
        eqx_lean.load_stacked(
            file, like, lambda p, leaf: eqx_lean.TensorName(hf_names(p, leaf), transpose=(0,))
        )
    with pytest.raises(ValueError, match=r"holds only its shape there"):
        eqx_lean.load_stacked(file, like, lambda p, leaf: None)
    mixed = {
        "a": jax.ShapeDtypeStruct((2, 3), jnp.float32),
        "b": jax.ShapeDtypeStruct((4, 3), jnp.float32),
    }
    with pytest.raises(ValueError, match=r"same leading layer axis.*2 at \['a'\], 4 at \['b'\]"):
        eqx_lean.load_tensors(file, mixed, {"a": "a.{i}", "b": "b.{i}"})
    with pytest.raises(ValueError, match=r"is a scalar, so it has no layer axis"):
        eqx_lean.load_tensors(file, {"a": jax.ShapeDtypeStruct((), jnp.float32)}, {"a": "a.{i}"})


def test_bad_sharding_is_refused(saved):
    file, like = saved
    # The one resolver of `sharding=` (shared with `build_stacked`) and its messages.
    with pytest.raises(TypeError, match=r"`sharding` for leaf \.attn\.weight must be a Named"):
        eqx_lean.load_stacked(file, like, hf_names, sharding=jax.tree.map(lambda _: "x", like))
    with pytest.raises(TypeError, match=r"got <object object"):
        eqx_lean.load_stacked(file, like, hf_names, sharding=object())
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(ValueError, match=r"it does not match the layer"):
        eqx_lean.load_stacked(file, like, hf_names, sharding={"nowhere": device})


def test_bad_save_arguments_are_refused(tmp_path):
    stacked, like = build(2, jnp.float32)
    with pytest.raises(
        ValueError, match=r"leaves \.attn\.weight and \.mlp\.weight are both named 'w\.0'"
    ):
        eqx_lean.save_stacked(tmp_path / "c", stacked, lambda p, _: "w.{i}")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="`path` must be a directory"):
        eqx_lean.save_stacked(tmp_path / "file", stacked, hf_names)
    with pytest.raises(TypeError, match="has `jax.ShapeDtypeStruct` leaves"):
        eqx_lean.save_stacked(tmp_path / "c", like, hf_names)
    with pytest.raises(ValueError, match="`max_shard_bytes` must be a positive integer"):
        eqx_lean.save_stacked(tmp_path / "c", stacked, hf_names, max_shard_bytes=0)
    with pytest.raises(TypeError, match="`metadata` must map strings to strings"):
        eqx_lean.save_stacked(tmp_path / "c", stacked, hf_names, metadata={"a": 1})  # pyright: ignore
    with pytest.raises(ValueError, match="`save_stacked` needs every name to be a template"):
        eqx_lean.save_stacked(
            tmp_path / "c", stacked, lambda p, _: "plain" + jax.tree_util.keystr(p)
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("devices", [4, 8])
@pytest.mark.cpu_mesh
def test_build_and_load_give_one_meaning_to_sharding(tmp_path, devices):
    """The same `sharding=`/`mesh=` arguments, to `build_stacked` and `load_stacked`: the same
    shardings (`is_equivalent_to`) and the same values, in every form `sharding=` takes."""
    mesh = mesh_of((devices,), ("data",))

    def make(key):
        return eqx.nn.MLP(16, 8, width_size=32, depth=2, key=key)

    def names(path, _):
        return "layers.{i}" + jax.tree_util.keystr(path)

    keys = keys_of(4)
    reference = eqx_lean.build_stacked(make, keys, jnp.bfloat16)
    eqx_lean.save_stacked(tmp_path / "ckpt", reference, names)
    like = eqx.filter_eval_shape(eqx_lean.build_stacked, make, keys, jnp.bfloat16)
    prefix = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[1].weight),
        jax.tree.map(lambda _: None, make(keys[0])),
        (P("data"), P(None, "data")),
        is_leaf=lambda x: x is None,
    )
    forms = {
        "named": (NamedSharding(mesh, P("data")), None),
        "spec-and-mesh": (P("data"), mesh),
        "prefix": (prefix, mesh),
        "fsdp": (eqx_lean.fsdp(mesh), None),
    }
    for form, (sharding, m) in forms.items():
        built = eqx_lean.build_stacked(make, keys, jnp.bfloat16, sharding, mesh=m)
        loaded = eqx_lean.load_stacked(tmp_path / "ckpt", like, names, sharding=sharding, mesh=m)
        leaves = zip(
            jax.tree_util.tree_leaves_with_path(eqx.filter(built, eqx.is_array)),
            arrays(loaded),
            arrays(reference),
            strict=True,
        )
        for (path, b), got, want in leaves:
            where = (form, jax.tree_util.keystr(path))
            assert b.sharding.is_equivalent_to(got.sharding, b.ndim), (
                where,
                b.sharding,
                got.sharding,
            )
            assert b.sharding.spec[0] is None, where  # the layer axis is replicated
            np.testing.assert_array_equal(bits(b), bits(got), err_msg=str(where))
            np.testing.assert_array_equal(bits(b), bits(want), err_msg=str(where))
