"""A checkpoint opened whole (`eqx_lean.open_checkpoint`): a save landing at any point of the
open gives exactly one checkpoint, and the load-side messages name what must be true.

The race with a saver in another process is `test_io_race.py`; here a real save is made to
land at chosen points of the open, so that each path of the retry runs deterministically."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import subprocess_env

import eqx_lean
from eqx_lean.internal import OPEN_RETRIES, snapshot


LIKE = {"x": jax.ShapeDtypeStruct((4, 8, 8), jnp.float32)}
NAMES = {"x": "layers.{i}.x"}


def _save(path: Path, value: float, shard_bytes: int = 300, config: str = "") -> None:
    """A 4-layer checkpoint whose every value is `value`; 300-byte shards give 4 files."""
    model = {"x": jnp.full((4, 8, 8), value, jnp.float32)}
    files = {"config.json": config.encode()} if config else None
    eqx_lean.save_tensors(path, model, NAMES, max_shard_bytes=shard_bytes, files=files)


def _values(model) -> set[float]:
    return set(np.unique(np.asarray(model["x"])).tolist())


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class _SaveOnce:
    """Wraps a method of `snapshot._Opener` so that a real save lands just before (or after)
    its first call (or every call)."""

    def __init__(self, monkeypatch, name, path, value, after=False, always=False):
        self.wrapped = getattr(snapshot._Opener, name)
        self.path, self.value, self.after, self.always, self.saves = path, value, after, always, 0
        monkeypatch.setattr(snapshot._Opener, name, self)

    def __get__(self, opener, owner):
        return lambda *args: self(opener, *args)

    def _save(self):
        if self.always or self.saves == 0:
            self.saves += 1
            # Fewer shards than before: a mix of the two would show.
            _save(self.path, self.value + self.saves, shard_bytes=700)

    def __call__(self, opener, *args):
        if not self.after:
            self._save()
        result = self.wrapped(opener, *args)
        if self.after:
            self._save()
        return result


@pytest.mark.parametrize(
    "where, after",
    [
        ("directory", True),  # the directory is open: its index is gone, its listing empty
        ("weight_file", False),  # the index is read: its first shard is gone (ENOENT)
        ("live", False),  # every file is open, nothing read: the path is another directory
    ],
)
def test_a_save_during_the_open_gives_the_new_checkpoint_whole(tmp_path, monkeypatch, where, after):
    path = tmp_path / "checkpoint"
    _save(path, 1.0)
    tries = []
    opener_init = snapshot._Opener.__init__
    monkeypatch.setattr(
        snapshot._Opener, "__init__", lambda self, r: (tries.append(1), opener_init(self, r))[1]
    )
    injected = _SaveOnce(monkeypatch, where, path, 1.0, after=after)
    before = _open_fds()
    loaded = eqx_lean.load_tensors(path, LIKE, NAMES)
    assert injected.saves == 1
    assert _values(loaded) == {2.0}  # the new checkpoint, whole
    assert len(tries) == 2  # noticed, and opened again
    assert _open_fds() == before


def test_a_checkpoint_replaced_at_every_try_is_an_error(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint"
    _save(path, 1.0)
    injected = _SaveOnce(monkeypatch, "weight_file", path, 1.0, always=True)
    before = _open_fds()
    with pytest.raises(
        eqx_lean.CheckpointReplacedError,
        match=r"A save replaced the checkpoint .* during the load, each of the 4 times it was "
        r"opened\. It was read whole each time \(never a mix",
    ):
        eqx_lean.load_tensors(path, LIKE, NAMES)
    assert injected.saves == 1 + OPEN_RETRIES
    assert _open_fds() == before


def test_an_open_checkpoint_reads_one_save_while_later_saves_land(tmp_path):
    path = tmp_path / "checkpoint"
    _save(path, 1.0, config='{"version": 1}')
    with eqx_lean.open_checkpoint(path, files=["config.json", "tokenizer.json"]) as checkpoint:
        _save(path, 2.0, shard_bytes=700, config='{"version": 2}')
        assert checkpoint.file("config.json") == b'{"version": 1}'
        assert checkpoint.file("tokenizer.json") is None  # no such file
        assert _values(eqx_lean.load_tensors(checkpoint, LIKE, NAMES)) == {1.0}
        assert _values(eqx_lean.load_stacked(checkpoint, LIKE, NAMES)) == {1.0}
        assert eqx_lean.checkpoint_tensors(checkpoint)["layers.3.x"].shape == (8, 8)
        with pytest.raises(KeyError, match=r"`name` must be one of the files opened with the"):
            checkpoint.file("generation_config.json")
        assert "4 files" in repr(checkpoint) and "open" in repr(checkpoint)
    assert checkpoint.closed
    with pytest.raises(ValueError, match=r"`path` is a closed checkpoint \(4 files in .*\); read"):
        eqx_lean.load_tensors(checkpoint, LIKE, NAMES)
    already_open: Any = checkpoint
    with pytest.raises(TypeError, match="`path` is already an open checkpoint"):
        eqx_lean.open_checkpoint(already_open)
    assert _values(eqx_lean.load_tensors(path, LIKE, NAMES)) == {2.0}


@pytest.mark.parametrize(
    "files, error, message",
    [
        ("config.json", TypeError, r"`files` must be a list of file names, such as"),
        (["sub/config.json"], ValueError, r"`files` must name files in the checkpoint's dir"),
    ],
)
def test_open_checkpoint_checks_files(tmp_path, files, error, message):
    _save(tmp_path / "c", 1.0)
    with pytest.raises(error, match=message):
        eqx_lean.open_checkpoint(tmp_path / "c", files=files)


def test_more_files_than_the_open_file_limit_is_its_own_error(tmp_path):
    path = tmp_path / "checkpoint"
    _save(path, 1.0, shard_bytes=256)  # 4 shards of one layer each
    code = f"""
import os, resource, jax, jax.numpy as jnp, eqx_lean
like = {{"x": jax.ShapeDtypeStruct((4, 8, 8), jnp.float32)}}
jax.devices()
held = len(os.listdir("/proc/self/fd"))
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (held + 3, hard))
try:
    eqx_lean.load_tensors({str(path)!r}, like, {{"x": "layers.{{i}}.x"}})
except OSError as e:
    print("ERROR", e)
"""
    env = subprocess_env()
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert "ERROR" in result.stdout, result.stderr[-2000:]
    assert "opens all of its files at once" in result.stdout
    assert "open-file limit" in result.stdout and "ulimit -n" in result.stdout


def test_an_index_entry_that_is_a_directory_is_named(tmp_path):
    (tmp_path / "sub.safetensors").mkdir()
    index = {"weight_map": {"a": "sub.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError,
        match=r"model.safetensors.index.json names sub.safetensors, but the entry .* must be a "
        r"regular file \(or a link to one\), but it is a directory\.",
    ):
        eqx_lean.checkpoint_tensors(tmp_path)


def test_a_fifo_among_the_weights_is_refused_without_waiting_for_a_writer(tmp_path):
    _save(tmp_path / "c", 1.0, shard_bytes=2**20)
    os.mkfifo(tmp_path / "c" / "zz.safetensors")
    with pytest.raises(ValueError, match=r"zz.safetensors must be a regular file .* it is a FIFO"):
        eqx_lean.checkpoint_tensors(tmp_path / "c")
    os.mkfifo(tmp_path / "c" / "config.json")
    (tmp_path / "c" / "zz.safetensors").unlink()
    with pytest.raises(ValueError, match=r"`files` .*config.json must be a regular file"):
        eqx_lean.open_checkpoint(tmp_path / "c", files=["config.json"])


def test_a_header_naming_a_tensor_twice_is_named(tmp_path):
    def entry(begin: int) -> str:
        return f'{{"dtype":"F32","shape":[4],"data_offsets":[{begin},{begin + 16}]}}'

    header = f'{{"a":{entry(0)},"a":{entry(16)}}}'.encode()
    header += b" " * (-len(header) % 8)
    file = tmp_path / "dup.safetensors"
    file.write_bytes(struct.pack("<Q", len(header)) + header + bytes(32))
    with pytest.raises(ValueError, match=r"dup.safetensors .* its header gives 'a' twice in one"):
        eqx_lean.checkpoint_tensors(file)


@pytest.mark.parametrize("strict", [None, 0, 1, "yes"])
def test_strict_must_be_a_bool(tmp_path, strict):
    _save(tmp_path / "c", 1.0)
    with pytest.raises(TypeError, match=r"`strict` must be True .* or False; got "):
        eqx_lean.load_tensors(tmp_path / "c", LIKE, NAMES, strict=strict)


@pytest.mark.parametrize("path", [b"checkpoint", [b"a.safetensors"]])
def test_a_bytes_path_is_named(path: Any):
    with pytest.raises(TypeError, match=r"`path` must be a"):
        eqx_lean.checkpoint_tensors(path)
    if not isinstance(path, list):
        with pytest.raises(TypeError, match=r"os.fsdecode\(path\)"):
            eqx_lean.checkpoint_tensors(path)


@pytest.mark.parametrize("transpose", [(1.5, 0), (True, False), "10", (0, 0)])
def test_a_transpose_must_be_integer_axes(transpose: Any):
    with pytest.raises(ValueError, match=r"must be a permutation of the axes 0..n-1 given as int"):
        eqx_lean.TensorName("w", transpose=transpose)
    numpy_axes: Any = (np.int64(1), 0)
    assert eqx_lean.TensorName("w", transpose=numpy_axes).transpose == (1, 0)


def test_an_empty_directory_is_refused_as_having_no_weights_not_as_replaced(tmp_path):
    # An empty listing is also what a directory a save deleted gives; only a directory no
    # longer at `path` is opened again (`test_a_save_during_the_open_...[directory-True]`).
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"the directory .*empty has no model.safetensors.index"):
        eqx_lean.checkpoint_tensors(tmp_path / "empty")
