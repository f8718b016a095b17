"""File-backed loads (`load_tensors(..., file_backed=True)`, `eqx_lean/_io/file_backed.py`) and
the layout of saved files that makes them possible (each stack consecutive in one file).

The oracle for values is the ordinary load (copies); that an array is the file's own pages is
checked against `/proc/self/maps`, the kernel's list of what each address range maps."""

import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from harness import mesh_of
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_lean


L = 4
NAMES = {"w": "model.layers.{i}.w", "b": "model.layers.{i}.b", "emb": "model.embed.weight"}


def model(dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.standard_normal((L, 64, 32)), dtype),
        "b": jnp.asarray(rng.standard_normal((L, 32)), dtype),
        "emb": jnp.asarray(rng.standard_normal((100, 32)), dtype),
    }


def like_of(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def header(file: Path) -> dict:
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        entries = json.loads(f.read(length))
    entries.pop("__metadata__", None)
    return {
        name: (8 + length + e["data_offsets"][0], 8 + length + e["data_offsets"][1])
        for name, e in entries.items()
    }


def mapped_file(address: int) -> str | None:
    """The file `address` belongs to in this process's memory maps (`None`: anonymous)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, stop = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < stop:
            return fields[5] if len(fields) == 6 and fields[5].startswith("/") else None
    return None


linux_only = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")


def test_saved_stacks_are_consecutive_aligned_and_in_one_file_when_they_fit(tmp_path):
    tree = model()
    # The embedding (6400 bytes) and the stack of w (16384) do not fit in one file together:
    # written in order, w's third layer would end the first file. The stack starts a new file
    # rather than straddle two.
    eqx_lean.save_tensors(tmp_path / "ckpt", tree, NAMES, max_shard_bytes=20_000)
    files = sorted((tmp_path / "ckpt").glob("*.safetensors"))
    assert len(files) == 2
    offsets = {name: (file, span) for file in files for name, span in header(file).items()}
    for leaf in ("w", "b"):
        spans = [offsets[NAMES[leaf].format(i=i)] for i in range(L)]
        assert len({file for file, _ in spans}) == 1, leaf
        for (_, previous), (_, span) in zip(spans, spans[1:], strict=False):
            assert span[0] == previous[1], leaf
    for _, (start, _) in offsets.values():
        assert start % 64 == 0


def test_a_stack_larger_than_a_file_is_still_cut(tmp_path):
    tree = model()
    eqx_lean.save_tensors(tmp_path / "ckpt", tree, NAMES, max_shard_bytes=2 * 64 * 32 * 2)
    files = sorted((tmp_path / "ckpt").glob("*.safetensors"))
    assert len(files) > 2
    loaded = eqx_lean.load_tensors(tmp_path / "ckpt", like_of(tree), NAMES)
    assert all(jax.tree.leaves(jax.tree.map(jnp.array_equal, loaded, tree)))


@linux_only
@pytest.mark.parametrize("layers", [None, range(1, 3)])
def test_file_backed_leaves_equal_the_copied_ones_and_are_the_files_pages(tmp_path, layers):
    tree = model()
    path = tmp_path / "ckpt"
    eqx_lean.save_tensors(path, tree, NAMES)
    count = L if layers is None else len(layers)
    like = like_of(tree) | {
        k: jax.ShapeDtypeStruct((count, *tree[k].shape[1:]), tree[k].dtype) for k in ("w", "b")
    }
    kwargs = {"layers": layers, "strict": layers is None}
    copied = eqx_lean.load_tensors(path, like, NAMES, **kwargs)
    mapped = eqx_lean.load_tensors(path, like, NAMES, file_backed=True, **kwargs)
    for name in NAMES:
        np.testing.assert_array_equal(np.asarray(mapped[name]), np.asarray(copied[name]))
        assert mapped_file(mapped[name].unsafe_buffer_pointer()) == str(
            path / "model.safetensors"
        ), name
        assert mapped_file(copied[name].unsafe_buffer_pointer()) is None, name
    expected = tree["w"] if layers is None else tree["w"][1:3]
    np.testing.assert_array_equal(np.asarray(mapped["w"]), np.asarray(expected))


@linux_only
def test_file_backed_arrays_outlive_the_checkpoint_and_a_donation_leaves_the_file_alone(
    tmp_path,
):
    tree = model(jnp.float32)
    path = tmp_path / "ckpt"
    eqx_lean.save_tensors(path, tree, NAMES)
    before = (path / "model.safetensors").read_bytes()
    with eqx_lean.open_checkpoint(path) as checkpoint:
        mapped = eqx_lean.load_tensors(checkpoint, like_of(tree), NAMES, file_backed=True)
    # The checkpoint's descriptors are closed; the arrays keep their maps.
    np.testing.assert_array_equal(np.asarray(mapped["w"]), np.asarray(tree["w"]))
    doubled = jax.jit(lambda w: w * 2, donate_argnums=0)(mapped["w"])
    np.testing.assert_array_equal(np.asarray(doubled), np.asarray(tree["w"]) * 2)
    assert (path / "model.safetensors").read_bytes() == before
    again = eqx_lean.load_tensors(path, like_of(tree), NAMES)
    np.testing.assert_array_equal(np.asarray(again["w"]), np.asarray(tree["w"]))


@linux_only
def test_a_save_over_the_checkpoint_leaves_file_backed_arrays_as_they_were(tmp_path):
    old, new = model(seed=0), model(seed=1)
    path = tmp_path / "ckpt"
    eqx_lean.save_tensors(path, old, NAMES)
    mapped = eqx_lean.load_tensors(path, like_of(old), NAMES, file_backed=True)
    eqx_lean.save_tensors(path, new, NAMES)
    for name in NAMES:
        np.testing.assert_array_equal(np.asarray(mapped[name]), np.asarray(old[name]))
    again = eqx_lean.load_tensors(path, like_of(new), NAMES, file_backed=True)
    for name in NAMES:
        np.testing.assert_array_equal(np.asarray(again[name]), np.asarray(new[name]))


@linux_only
def test_a_scalar_leaf_beside_a_stack_is_mapped_too(tmp_path):
    tree = {"w": model()["w"], "scale": jnp.asarray(0.5, jnp.bfloat16)}
    names = {"w": NAMES["w"], "scale": "model.scale"}
    path = tmp_path / "ckpt"
    eqx_lean.save_tensors(path, tree, names)
    mapped = eqx_lean.load_tensors(path, like_of(tree), names, file_backed=True)
    assert mapped["scale"].shape == ()
    assert float(mapped["scale"]) == 0.5
    assert mapped_file(mapped["scale"].unsafe_buffer_pointer()) == str(path / "model.safetensors")
    np.testing.assert_array_equal(np.asarray(mapped["w"]), np.asarray(tree["w"]))


def test_file_backed_refuses_what_it_cannot_map_naming_the_leaf(tmp_path):
    tree = model()
    # Written layer by layer and 8-byte aligned, as `safetensors` and `transformers` write.
    hf = tmp_path / "hf"
    hf.mkdir()
    tensors = {"model.embed.weight": np.asarray(tree["emb"].astype(jnp.float32))[:, :31]}
    for i in range(L):
        tensors[f"model.layers.{i}.w"] = np.asarray(tree["w"][i].astype(jnp.float32))
        tensors[f"model.layers.{i}.b"] = np.asarray(tree["b"][i].astype(jnp.float32))
    safetensors.numpy.save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    stacked = {k: NAMES[k] for k in ("w", "b")}
    like = {k: jax.ShapeDtypeStruct(tree[k].shape, jnp.float32) for k in ("w", "b")}
    with pytest.raises(
        ValueError, match=r"cannot map leaf \['b'\]: its layers 0 and 1 are not next to each other"
    ):
        eqx_lean.load_stacked(hf, like, stacked, file_backed=True, strict=False)

    ours = tmp_path / "ours"
    eqx_lean.save_tensors(ours, tree, NAMES)
    with pytest.raises(
        ValueError,
        match=r"leaf \['b'\]: the checkpoint stores it as bfloat16 .* Load it as bfloat16",
    ):
        eqx_lean.load_tensors(ours, like_of(tree), NAMES, dtype=jnp.float32, file_backed=True)
    with pytest.raises(
        ValueError, match=r"leaf \['b'\]: its layers 0 and 2 are not next to each other"
    ):
        eqx_lean.load_tensors(
            ours,
            like_of(tree)
            | {
                "w": jax.ShapeDtypeStruct((2, 64, 32), jnp.bfloat16),
                "b": jax.ShapeDtypeStruct((2, 32), jnp.bfloat16),
            },
            NAMES,
            layers=range(0, 4, 2),
            strict=False,
            file_backed=True,
        )
    transposed = NAMES | {"w": eqx_lean.TensorName("model.layers.{i}.w", (1, 0))}
    with pytest.raises(ValueError, match=r"leaf \['w'\]: its tensor is stored transposed"):
        eqx_lean.load_tensors(
            ours,
            like_of(tree) | {"w": jax.ShapeDtypeStruct((L, 32, 64), jnp.bfloat16)},
            transposed,
            file_backed=True,
        )
    with pytest.raises(TypeError, match="`file_backed` must be True or False"):
        eqx_lean.load_tensors(ours, like_of(tree), NAMES, file_backed="yes")  # pyright: ignore
    with pytest.raises(ValueError, match="pass one of the two"):
        eqx_lean.load_tensors(ours, like_of(tree), NAMES, file_backed=True, quantize="int8")


def test_a_misaligned_tensor_is_refused_with_its_offset(tmp_path):
    # One tensor alone in a file written by `safetensors`, whose header is padded to 8 bytes:
    # this header puts the data at an offset that is not a multiple of 64.
    for pad in range(1, 64):
        name = "model.embed.weight" + "x" * pad
        path = tmp_path / f"pad{pad}.safetensors"
        safetensors.numpy.save_file({name: np.zeros((4, 16), np.float32)}, path)
        start = header(path)[name][0]
        if start % 64:
            break
    else:
        pytest.fail("every header length gave 64-byte aligned data")
    like = {"emb": jax.ShapeDtypeStruct((4, 16), jnp.float32)}
    with pytest.raises(ValueError, match=rf"\['emb'\]: its data starts at byte {start} "):
        eqx_lean.load_tensors(path, like, {"emb": name}, file_backed=True)


@pytest.mark.cpu_mesh
def test_file_backed_refuses_leaves_spread_over_devices(tmp_path):
    path = tmp_path / "ckpt"
    eqx_lean.save_tensors(path, {"w": jnp.ones((4, 8, 8), jnp.float32)}, {"w": "l.{i}.w"})
    like = {"w": jax.ShapeDtypeStruct((4, 8, 8), jnp.float32)}
    spread = NamedSharding(mesh_of((8,), ("d",)), P("d"))
    with pytest.raises(ValueError, match=r"leaf \['w'\]: its sharding spreads it over 8"):
        eqx_lean.load_stacked(path, like, {"w": "l.{i}.w"}, sharding=spread, file_backed=True)
    # A mesh of one device is no spread: the load goes through, onto that mesh.
    one = NamedSharding(mesh_of((1,), ("d",)), P())
    out: dict[str, jax.Array] = eqx_lean.load_stacked(  # pyright: ignore[reportAssignmentType]
        path, like, {"w": "l.{i}.w"}, sharding=one, file_backed=True
    )
    assert float(out["w"].sum()) == 4 * 64
    assert out["w"].sharding.is_equivalent_to(NamedSharding(one.mesh, P()), 3)
    sharding = out["w"].sharding
    assert isinstance(sharding, NamedSharding) and sharding.mesh == one.mesh, sharding
