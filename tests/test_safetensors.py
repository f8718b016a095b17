"""The safetensors format and checkpoint layout (`eqx_lean/_io/safetensors.py`): index entries
that escape the checkpoint directory, the Hugging Face cache layout, header length messages.

(The other format checks, older, are in `tests/test_io.py`.)"""

import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import eqx_lean
from eqx_lean.internal import INDEX_FILE, WEIGHTS_FILE, index_name, safetensors_format


X = {"x": jax.ShapeDtypeStruct((2,), jnp.float32)}


def write_checkpoint(directory, index_entry):
    directory.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file({"x": np.arange(2, dtype=np.float32)}, directory / "a.safetensors")
    index = {"weight_map": {"x": index_entry}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_index_file_names_follow_hugging_face_and_peft():
    assert (WEIGHTS_FILE, INDEX_FILE) == (
        "model.safetensors",
        "model.safetensors.index.json",
    )
    assert index_name("adapter_model.safetensors") == "adapter_model.safetensors.index.json"


@pytest.mark.parametrize(
    "entry",
    ["/tmp/elsewhere/a.safetensors", "../outside/a.safetensors", "..", "sub/a.safetensors", 3],
)
def test_index_entries_that_leave_the_directory_are_refused(tmp_path, entry):
    # The target exists outside the checkpoint, so only the entry's form can refuse it.
    outside = tmp_path / "outside"
    outside.mkdir()
    safetensors.numpy.save_file({"x": np.ones(2, np.float32)}, outside / "a.safetensors")
    write_checkpoint(tmp_path / "ckpt", entry)
    with pytest.raises(ValueError, match="index entries must be plain file names") as info:
        eqx_lean.load_tensors(tmp_path / "ckpt", X, {"x": "x"})
    message = str(info.value)
    assert repr(entry) in message and "tensor 'x'" in message
    assert str(tmp_path / "ckpt" / "model.safetensors.index.json") in message
    with pytest.raises(ValueError, match="index entries must be plain file names"):
        eqx_lean.checkpoint_tensors(tmp_path / "ckpt")


def test_absolute_index_entry_to_an_existing_file_is_refused(tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    safetensors.numpy.save_file({"x": np.ones(2, np.float32)}, outside)
    write_checkpoint(tmp_path / "ckpt", str(outside))
    with pytest.raises(ValueError, match=f"names {str(outside)!r} as the file of tensor 'x'"):
        eqx_lean.load_tensors(tmp_path / "ckpt", X, {"x": "x"})


def test_hugging_face_cache_layout_with_symlinked_files_loads(tmp_path):
    """`snapshots/<rev>/` holds symbolic links into `blobs/`, as `huggingface_hub` lays out its
    cache: the index and the shards are links whose targets lie outside the snapshot."""
    blobs = tmp_path / "models--org--name" / "blobs"
    snapshot = tmp_path / "models--org--name" / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    values = {
        "a.safetensors": {"x": np.arange(4, dtype=np.float32)},
        "b.safetensors": {"y": np.arange(6, dtype=np.int32).reshape(2, 3)},
    }
    weight_map = {}
    for k, (file, tensors) in enumerate(values.items()):
        safetensors.numpy.save_file(tensors, blobs / f"blob{k}")
        os.symlink(f"../../blobs/blob{k}", snapshot / file)
        weight_map |= {name: file for name in tensors}
    (blobs / "index").write_text(json.dumps({"weight_map": weight_map}))
    os.symlink("../../blobs/index", snapshot / "model.safetensors.index.json")
    like = {
        "x": jax.ShapeDtypeStruct((4,), jnp.float32),
        "y": jax.ShapeDtypeStruct((2, 3), jnp.int32),
    }
    loaded = eqx_lean.load_tensors(snapshot, like, {"x": "x", "y": "y"})
    np.testing.assert_array_equal(np.asarray(loaded["x"]), values["a.safetensors"]["x"])
    np.testing.assert_array_equal(np.asarray(loaded["y"]), values["b.safetensors"]["y"])
    assert {k: v.shape for k, v in eqx_lean.checkpoint_tensors(snapshot).items()} == {
        "x": (4,),
        "y": (2, 3),
    }


def test_header_length_equal_to_the_file_size_says_what_follows(tmp_path):
    file = tmp_path / "bad.safetensors"
    raw = json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    body = raw + b"\0" * 8
    size = 8 + len(body)
    file.write_bytes(struct.pack("<Q", size) + body)
    with pytest.raises(ValueError) as info:
        eqx_lean.load_tensors(file, X, {"x": "x"})
    message = str(info.value)
    assert str(file) in message
    assert (
        f"its header length field says {size} bytes, but only {size - 8} bytes follow the 8-byte "
        f"length field (the file holds {size} bytes in all)"
    ) in message


def test_header_longer_than_the_format_allows_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_format, "_MAX_HEADER_BYTES", 16)
    file = tmp_path / "big.safetensors"
    raw = json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    raw += b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)
    with pytest.raises(
        ValueError, match=rf"{len(raw)} bytes, more than the 16 bytes a safetensors"
    ):
        eqx_lean.load_tensors(file, X, {"x": "x"})


def test_checkpoint_tensors_lists_names_shapes_and_stored_dtypes(tmp_path):
    tensors = {"b": np.zeros((2, 3), np.float16), "a": np.zeros(4, np.int64)}
    safetensors.numpy.save_file(tensors, tmp_path / "m.safetensors")
    listed = eqx_lean.checkpoint_tensors(tmp_path / "m.safetensors")
    assert {k: (v.shape, v.dtype) for k, v in listed.items()} == {
        "b": ((2, 3), np.float16),
        "a": ((4,), np.int64),
    }
    (tmp_path / "m.safetensors").write_bytes(b"\1\0")
    with pytest.raises(ValueError, match=r"m\.safetensors is not a valid safetensors file"):
        eqx_lean.checkpoint_tensors(tmp_path / "m.safetensors")
