"""Saving (`eqx_lean._io.save`, `eqx_lean._io.directory`): a checkpoint directory is one unit.

What a save owns, carries over and refuses; the destinations it refuses; modes; links; the
notes of a failed save; and the fault-injection suite: saves killed (SIGKILL) before and after
every filesystem operation, and at spread delays, over plain, hard-linked, symbolically linked
and Hugging-Face-cache destinations, each leaving exactly the old or exactly the new checkpoint.
"""

import hashlib
import json
import os
import pickle
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from harness import TINY_DECODER, bits, mesh_of, subprocess_env
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_lean
from eqx_lean.internal import directory, fs, is_mount_point


REPO = Path(__file__).resolve().parent.parent
FAULTS = REPO / "tests" / "save_faults.py"

NAMES = {
    "attn": "model.layers.{i}.self_attn.q_proj.weight",
    "mlp": "model.layers.{i}.mlp.up_proj.weight",
    "bias": "model.layers.{i}.mlp.up_proj.bias",
    "norm": "model.layers.{i}.input_layernorm.weight",
    "position": "model.layers.{i}.position",
}


def stacked(num_layers: int, seed: int, width: int = 8, dtype: Any = np.float32) -> dict:
    """Random stacked leaves as numpy arrays (saving them runs no JAX computation)."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.standard_normal((num_layers, *shape), dtype=np.float32).astype(dtype)

    return {
        "attn": normal(width, width),
        "mlp": normal(width + 4, width),
        "bias": normal(width + 4),
        "norm": normal(width),
        "position": rng.integers(0, 100, (num_layers, 3), dtype=np.int32),
    }


def tensors_of(tree: dict, names: dict = NAMES) -> dict[str, np.ndarray]:
    """The checkpoint's expected contents, by hand: one tensor per layer and leaf."""
    return {names[k].format(i=i): np.asarray(v[i]) for k, v in tree.items() for i in range(len(v))}


def read_checkpoint(path: Path, weights_name: str = "model.safetensors") -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in `path`, read by `safetensors` itself; the weight files
    must be exactly those that the index (or the single file) names."""
    index = path / (weights_name + ".index.json")
    if index.exists():
        files = set(json.loads(index.read_text())["weight_map"].values())
    else:
        files = {weights_name}
    assert {p.name for p in path.glob("*.safetensors")} == files, sorted(os.listdir(path))
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(files):
        loaded = safetensors.numpy.load_file(path / file)
        assert not set(loaded) & set(tensors)
        tensors |= loaded
    return tensors


def assert_tensors_equal(found: dict, expected: dict) -> None:
    assert sorted(found) == sorted(expected)
    for name, value in expected.items():
        assert found[name].dtype == value.dtype and found[name].shape == value.shape, name
        np.testing.assert_array_equal(bits(found[name]), bits(value), err_msg=name)


def snapshot(root: Path, exclude: tuple[str, ...] = ()) -> dict[str, tuple]:
    """Every entry under `root` (links not followed): files by content hash and mode, links by
    their text, directories by mode; `exclude` drops relative paths and what lies under them."""
    found: dict[str, tuple] = {}
    for base, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            full = os.path.join(base, name)
            relative = os.path.relpath(full, root)
            if any(relative == e or relative.startswith(e + "/") for e in exclude):
                continue
            info = os.lstat(full)
            if stat.S_ISLNK(info.st_mode):
                found[relative] = ("link", os.readlink(full))
            elif stat.S_ISDIR(info.st_mode):
                found[relative] = ("dir", stat.S_IMODE(info.st_mode))
            else:
                digest = hashlib.sha256(Path(full).read_bytes()).hexdigest()
                found[relative] = ("file", digest, stat.S_IMODE(info.st_mode))
    return found


def leftovers(destination: Path) -> list[str]:
    return sorted(p.name for p in destination.parent.glob(f".{destination.name}.*-*"))


def add_extras(ckpt: Path) -> None:
    """Small metadata a save does not own: it must carry every one of them over."""
    (ckpt / "README.md").write_text("# a model\n")
    (ckpt / "tokenizer.json").write_text('{"vocab": ["a", "b"]}')
    (ckpt / "generation_config.json").write_text('{"max_length": 9}')
    (ckpt / "extra").mkdir()
    (ckpt / "extra" / "notes.txt").write_text("kept")
    os.chmod(ckpt / "extra" / "notes.txt", 0o640)


def save(path, tree=None, **kwargs):
    eqx_lean.save_stacked(path, stacked(2, 1) if tree is None else tree, NAMES, **kwargs)


@pytest.fixture
def old(tmp_path):
    """An existing checkpoint (sharded, 4 layers) with metadata beside its weights."""
    ckpt = tmp_path / "ckpt"
    tree = stacked(4, 0)
    eqx_lean.save_stacked(ckpt, tree, NAMES, max_shard_bytes=600)
    add_extras(ckpt)
    return ckpt, tree


# --------------------------------------------------------------------------------------------
# What a save owns, carries over and refuses


def test_save_owns_its_weights_and_copies_everything_else(old):
    ckpt, _ = old
    before = snapshot(ckpt)
    inodes = {p: os.stat(ckpt / p).st_ino for p in ("README.md", "extra/notes.txt")}
    new = stacked(3, 1)
    eqx_lean.save_stacked(ckpt, new, NAMES)
    # The old shards and index are the save's own weights: replaced by one file.
    assert_tensors_equal(read_checkpoint(ckpt), tensors_of(new))
    after = snapshot(ckpt)
    carried = [p for p in before if not p.endswith((".safetensors", ".index.json"))]
    assert sorted(carried) == [
        "README.md",
        "extra",
        "extra/notes.txt",
        "generation_config.json",
        "tokenizer.json",
    ]
    for p in carried:
        assert after[p] == before[p], p  # same content and mode
    for p, inode in inodes.items():
        info = os.stat(ckpt / p)
        assert info.st_ino != inode and info.st_nlink == 1, p  # copies, never hard links
    assert sorted(after) == sorted(carried + ["model.safetensors"])
    assert leftovers(ckpt) == []


@pytest.mark.parametrize(
    "name",
    [
        "consolidated.safetensors",
        "adapter_model.safetensors",
        "pytorch_model.bin",
        "optimizer.pt",
        "pytorch_model.bin.index.json",
        "extra/rng_state.pth",
    ],
)
def test_weight_files_it_does_not_own_are_refused_kept_or_dropped(old, name):
    ckpt, tree = old
    (ckpt / name).write_bytes(b"weights of someone else")
    before = snapshot(ckpt)
    with pytest.raises(
        ValueError,
        match=rf"holds weight files that this save does not own: "
        rf"'{name}'.*other_weights=\"keep\".*Nothing was written",
    ):
        save(ckpt)
    assert snapshot(ckpt) == before and leftovers(ckpt) == []

    save(ckpt, other_weights="keep")
    assert (ckpt / name).read_bytes() == b"weights of someone else"
    assert not (ckpt / name).is_symlink() and os.stat(ckpt / name).st_nlink == 1
    save(ckpt, other_weights="drop")
    assert not (ckpt / name).exists()
    assert (ckpt / "README.md").exists()
    with pytest.raises(ValueError, match=r'`other_weights` must be "refuse", "keep" or "drop"'):
        save(ckpt, other_weights="delete")  # pyright: ignore[reportArgumentType]


def test_files_and_weights_name_write_one_directory(tmp_path):
    source = tmp_path / "tok.json"
    source.write_text('{"tok": 1}')
    ckpt = tmp_path / "adapter"
    tree = stacked(3, 2)
    files = {"adapter_config.json": b'{"r": 4}', "tokenizer.json": source}
    eqx_lean.save_stacked(
        ckpt,
        tree,
        NAMES,
        weights_name="adapter_model.safetensors",
        files=files,
        max_shard_bytes=500,
    )
    names = sorted(os.listdir(ckpt))
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 1 and shards[0] == f"adapter_model-00001-of-{len(shards):05d}.safetensors"
    assert "adapter_model.safetensors.index.json" in names
    assert_tensors_equal(read_checkpoint(ckpt, "adapter_model.safetensors"), tensors_of(tree))
    assert (ckpt / "adapter_config.json").read_bytes() == b'{"r": 4}'
    assert (ckpt / "tokenizer.json").read_text() == '{"tok": 1}'
    assert os.stat(ckpt / "tokenizer.json").st_ino != os.stat(source).st_ino
    # A given file replaces the old one of that name, and keeps its mode.
    os.chmod(ckpt / "adapter_config.json", 0o600)
    eqx_lean.save_stacked(
        ckpt,
        tree,
        NAMES,
        weights_name="adapter_model.safetensors",
        files={"adapter_config.json": b'{"r": 8}'},
    )
    assert (ckpt / "adapter_config.json").read_bytes() == b'{"r": 8}'
    assert stat.S_IMODE(os.stat(ckpt / "adapter_config.json").st_mode) == 0o600
    assert (ckpt / "tokenizer.json").read_text() == '{"tok": 1}'  # now carried over
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["adapter_model.safetensors"]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"files": {"config.json": "{}"}}, TypeError, r"`files\['config.json'\]` must be bytes"),
        ({"files": {"sub/config.json": b""}}, ValueError, r"plain file names.*'sub/config.json'"),
        ({"files": {"..": b""}}, ValueError, r"plain file names"),
        (
            {"files": {"model.safetensors": b""}},
            ValueError,
            r"save's own weight file 'model.safetensors'",
        ),
        ({"files": {"x": Path("/nonexistent/x")}}, FileNotFoundError, r"/nonexistent/x is missing"),
        ({"files": ["config.json"]}, TypeError, r"`files` must map file names"),
        ({"weights_name": "model.bin"}, ValueError, r"`weights_name` must be a plain file name"),
        ({"weights_name": "a/b.safetensors"}, ValueError, r"`weights_name` must be a plain"),
    ],
)
def test_bad_files_and_weights_names_are_refused(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        save(tmp_path / "ckpt", **kwargs)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------------
# Modes


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o2775])
def test_directory_mode_is_kept(tmp_path, mode):
    save(tmp_path / "ckpt")
    os.chmod(tmp_path / "ckpt", mode)
    save(tmp_path / "ckpt")
    assert stat.S_IMODE(os.stat(tmp_path / "ckpt").st_mode) == mode


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_given_file_to_copy_gets_a_new_file_s_mode_not_its_source_s(tmp_path, umask):
    source = tmp_path / "tok.json"
    source.write_text("{}")
    os.chmod(source, 0o600)
    previous = os.umask(umask)
    try:
        eqx_lean.save_stacked(tmp_path / "ckpt", stacked(2, 1), NAMES, files={"t.json": source})
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "ckpt" / "t.json").st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_new_files_get_what_a_normal_write_gives_old_ones_keep_their_mode(tmp_path, umask):
    previous = os.umask(umask)
    try:
        save(tmp_path / "ckpt", max_shard_bytes=400)
        (tmp_path / "normal").write_text("")
        (tmp_path / "normal_dir").mkdir()
    finally:
        os.umask(previous)
    expected = stat.S_IMODE(os.stat(tmp_path / "normal").st_mode)
    assert expected == 0o666 & ~umask
    files = sorted((tmp_path / "ckpt").iterdir())
    assert len(files) > 2
    for file in files:
        assert stat.S_IMODE(os.stat(file).st_mode) == expected, file
    # A new directory gets what `mkdir` gives.
    assert os.stat(tmp_path / "ckpt").st_mode == os.stat(tmp_path / "normal_dir").st_mode
    # The old file's mode wins where the save replaces a file of the same name.
    first = files[0].name
    assert first.startswith("model-00001-of-")
    os.chmod(files[0], 0o640)
    save(tmp_path / "ckpt", max_shard_bytes=400)
    modes = {f.name: stat.S_IMODE(os.stat(f).st_mode) for f in (tmp_path / "ckpt").iterdir()}
    assert modes.pop(first) == 0o640
    assert set(modes.values()) == {expected}


# --------------------------------------------------------------------------------------------
# Targets refused before any work


def no_change(root: Path):
    """Asserts that what is under `root` is the same after the block (nothing written)."""

    class Check:
        def __enter__(self):
            self.before = snapshot(root)

        def __exit__(self, *exc):
            assert snapshot(root) == self.before
            return False

    return Check()


@pytest.mark.parametrize("path", [".", ""])
def test_current_directory_is_refused(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.txt").write_text("x")
    with (
        no_change(tmp_path),
        pytest.raises(
            ValueError, match=rf"but {path!r} is the current working directory.*Nothing was written"
        ),
    ):
        save(path)


def test_directory_holding_the_working_directory_is_refused(old, monkeypatch):
    ckpt, _ = old
    monkeypatch.chdir(ckpt / "extra")
    with no_change(ckpt.parent), pytest.raises(ValueError, match=r"holds the current working"):
        save(ckpt)
    with pytest.raises(ValueError, match=r"holds the current working"):
        save("..")


def test_mount_points_are_refused(old, monkeypatch):
    ckpt, _ = old
    assert is_mount_point(Path("/"))
    with pytest.raises(ValueError, match=r"'/' is /, a mount point"):
        save("/")
    real = directory._mount_points
    monkeypatch.setattr(directory, "_mount_points", lambda: real() | {str(ckpt)})
    with no_change(ckpt.parent), pytest.raises(ValueError, match=rf"is {ckpt}, a mount point"):
        save(ckpt)


def test_a_mount_point_inside_the_destination_is_refused(old, monkeypatch):
    # A filesystem mounted inside the checkpoint would be copied into the new checkpoint, then
    # its files deleted with the old one.
    ckpt, _ = old
    real = directory._mount_points
    monkeypatch.setattr(directory, "_mount_points", lambda: real() | {str(ckpt / "extra")})
    with (
        no_change(ckpt.parent),
        pytest.raises(PermissionError, match=r"extra/ \(a mount point, another filesystem's"),
    ):
        save(ckpt)


def test_read_only_directory_is_refused_before_any_work(old):
    ckpt, _ = old
    os.chmod(ckpt, 0o555)
    try:
        with (
            no_change(ckpt.parent),
            pytest.raises(PermissionError, match=r"has no owner write permission \(mode 0555\)"),
        ):
            save(ckpt)
    finally:
        os.chmod(ckpt, 0o755)


def test_read_only_directory_is_refused_for_an_unprivileged_user(tmp_path):
    """The case of the issue, as a user without root's powers: a 0555 checkpoint directory in
    a writable parent. Before, the save swapped, then failed deleting, leaving the old
    checkpoint in the hidden temporary directory and the new one at mode 0755."""
    if os.geteuid() != 0:
        user = None  # already unprivileged
    else:
        try:
            user = pwd.getpwnam("nobody")
        except KeyError:
            pytest.skip("running as root, and there is no user `nobody` to run the save as")
    root = Path(tempfile.mkdtemp(prefix="eqx-lean-ro-", dir="/tmp"))  # reachable by the user
    os.chmod(root, 0o755)
    parent = root / "parent"
    try:
        parent.mkdir()
        save(parent / "ckpt")
        add_extras(parent / "ckpt")
        shutil.copytree(parent / "ckpt", parent / "secret")
        (parent / "locked").mkdir()
        save(parent / "locked" / "ckpt")
        before = snapshot(root)
        if user is not None:
            for base, dirs, files in os.walk(parent):
                for name in [base, *(os.path.join(base, n) for n in dirs + files)]:
                    os.chown(name, user.pw_uid, user.pw_gid)
            os.chown(parent / "locked", 0, 0)  # root's, 0755: not writable by the user
        else:
            os.chmod(parent / "locked", 0o555)
        os.chmod(parent / "secret" / "tokenizer.json", 0o000)
        os.chmod(parent / "ckpt", 0o555)
        # The interpreter may lie where the user cannot read it (as here, under /root): the
        # child starts as root, imports all it needs with one save, then drops privileges.
        drop = "" if user is None else f"os.setgroups([]); os.setgid({user.pw_gid}); "
        drop += "" if user is None else f"os.setuid({user.pw_uid})"
        code = f"""
            import os, numpy as np, eqx_lean
            w = {{"w": np.ones((2, 3), np.float32)}}
            eqx_lean.save_stacked({str(root / "warm-up")!r}, w, {{"w": "w.{{i}}"}})
            {drop}
            eqx_lean.save_stacked({str(parent / "writable")!r}, w, {{"w": "w.{{i}}"}})
            print("wrote as uid", os.geteuid(), flush=True)
            for name in ("ckpt", "secret", "locked/ckpt"):
                try:
                    eqx_lean.save_stacked({str(parent)!r} + "/" + name, w, {{"w": "w.{{i}}"}})
                except PermissionError as e:
                    print("refused:", e)
        """
        env = subprocess_env(HOME=str(root))
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        expected_uid = os.geteuid() if user is None else user.pw_uid
        assert f"wrote as uid {expected_uid}" in result.stdout
        refusals = result.stdout.splitlines()[1:]
        assert len(refusals) == 3, result.stdout
        assert "has no owner write permission (mode 0555)" in refusals[0]
        assert "Nothing was written" in refusals[0]
        assert "cannot: tokenizer.json (a file this user cannot read)" in refusals[1]
        assert f"must create its new directory in {parent / 'locked'}, but this user" in refusals[2]
        assert stat.S_IMODE(os.stat(parent / "ckpt").st_mode) == 0o555
        for path, mode in [("ckpt", 0o755), ("secret/tokenizer.json", 0o644), ("locked", 0o755)]:
            os.chmod(parent / path, mode)
        after = snapshot(root, exclude=("parent/writable", "warm-up"))
        assert after == before  # the old checkpoints, unchanged, and no leftover
    finally:
        for base, dirs, _ in os.walk(root):
            for d in dirs:
                os.chmod(os.path.join(base, d), 0o755)
        shutil.rmtree(root)


def test_file_and_dangling_link_destinations_are_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="`path` must be a directory"):
        save(tmp_path / "file")
    with pytest.raises(ValueError, match=r"but .*/file, on the way to .*/file/ckpt, is a file"):
        save(tmp_path / "file" / "ckpt")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    with pytest.raises(ValueError, match=r"is a symbolic link to .*nowhere', which does not"):
        save(tmp_path / "dangling")
    assert sorted(os.listdir(tmp_path)) == ["dangling", "file"]


# --------------------------------------------------------------------------------------------
# Links: nothing outside the destination changes


def test_symlinked_destination_keeps_the_link_and_replaces_what_it_points_to(old):
    ckpt, _ = old
    link = ckpt.parent / "latest"
    os.symlink("ckpt", link)
    new = stacked(3, 5)
    eqx_lean.save_stacked(link, new, NAMES)
    assert os.readlink(link) == "ckpt"
    assert_tensors_equal(read_checkpoint(ckpt), tensors_of(new))
    assert leftovers(ckpt) == [] and leftovers(link) == []


def test_hard_linked_copy_leaves_the_original_byte_identical(old):
    ckpt, _ = old
    copy = ckpt.parent / "copy"
    subprocess.run(["cp", "-al", str(ckpt), str(copy)], check=True)
    original = snapshot(ckpt)
    eqx_lean.save_stacked(copy, stacked(4, 9), NAMES, files={"config.json": b"{}"})
    assert snapshot(ckpt) == original
    for p in ("README.md", "extra/notes.txt"):
        assert os.stat(copy / p).st_nlink == 1 and os.stat(ckpt / p).st_nlink == 1


def test_links_inside_the_destination_are_copied_or_kept_as_links(tmp_path):
    ckpt = tmp_path / "ckpt"
    save(ckpt)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "vocab.txt").write_text("shared vocab")
    (tmp_path / "blob").write_text("blob")
    os.symlink("../blob", ckpt / "tokenizer.json")  # as in a Hugging Face cache snapshot
    os.symlink("../shared", ckpt / "assets")  # a directory: kept as a link
    os.symlink("../nowhere", ckpt / "dangling")  # nothing to copy: kept as a link
    outside = snapshot(tmp_path, exclude=("ckpt",))
    save(ckpt)
    assert snapshot(tmp_path, exclude=("ckpt",)) == outside
    assert not (ckpt / "tokenizer.json").is_symlink()
    assert (ckpt / "tokenizer.json").read_text() == "blob"
    assert os.readlink(ckpt / "assets") == "../shared"
    assert os.readlink(ckpt / "dangling") == "../nowhere"


# --------------------------------------------------------------------------------------------
# Messages


def test_deleted_array_names_its_leaf(tmp_path):
    tree = {k: jnp.asarray(v) for k, v in stacked(2, 0).items()}
    tree["mlp"].delete()
    with pytest.raises(ValueError, match=r"the array of leaf \['mlp'\] has been deleted"):
        eqx_lean.save_stacked(tmp_path / "ckpt", tree, NAMES)
    assert os.listdir(tmp_path) == []


def hook_steps(run) -> list[tuple[str, str, str]]:
    steps = []
    with fs.hooked(lambda when, op, paths: steps.append((when, op, paths[0]))):
        run()
    return steps


def failing_at(step: int):
    """A hook that raises an `OSError` (a full disk) at its `step`-th call."""
    count = 0

    def fail(when, op, paths):
        nonlocal count
        count += 1
        if count == step:
            raise OSError(28, f"No space left on device (injected at {when} {op})")

    return fail


def test_a_failure_at_any_step_says_what_became_of_the_checkpoint(old):
    """An error (a full disk, an interrupt) at every step of a save: before the swap the destination
    holds the old checkpoint, unchanged, the partial one is deleted and the notes say so; after,
    the new one is in place."""
    ckpt, tree = old
    before = snapshot(ckpt)
    new = stacked(3, 1)
    template = ckpt.parent / "template"
    shutil.copytree(ckpt, template, symlinks=True)
    steps = hook_steps(lambda: eqx_lean.save_stacked(ckpt, new, NAMES))
    swap = next(i for i, step in enumerate(steps) if step[:2] == ("after", "exchange"))
    after = snapshot(ckpt)
    ops = {op for _, op, _ in steps}
    assert ops == {
        "mkdir",
        "create",
        "write",
        "fsync",
        "copy",
        "chmod",
        "fsync_dir",
        "exchange",
        "remove",
    }
    for k in range(len(steps)):
        shutil.rmtree(ckpt)
        shutil.copytree(template, ckpt, symlinks=True)
        os.chmod(ckpt, stat.S_IMODE(os.stat(template).st_mode))
        fail = failing_at(k + 1)
        with warnings.catch_warnings(record=True) as caught, fs.hooked(fail):
            warnings.simplefilter("always")
            try:
                eqx_lean.save_stacked(ckpt, new, NAMES)
            except OSError as e:
                notes = "\n".join(getattr(e, "__notes__", []))
            else:
                notes = None
        where = f"step {k}: {steps[k]}"
        if k < swap:
            assert notes is not None, where
            assert f"{ckpt} still holds the old checkpoint, unchanged" in notes, (where, notes)
            made = k >= steps.index(("after", "mkdir", steps[0][2]))  # the new directory
            assert ("The partial new checkpoint" in notes and "was deleted" in notes) == made
            assert snapshot(ckpt) == before, where
            assert leftovers(ckpt) == [], where
        elif k == swap:
            assert notes is not None and f"the new checkpoint is in place in {ckpt}" in notes
            (old_copy,) = leftovers(ckpt)
            assert f"the old one lies in {ckpt.parent / old_copy}, which is safe to delete" in notes
            assert snapshot(ckpt) == after, where
            shutil.rmtree(ckpt.parent / old_copy)
        else:
            assert notes is None, where  # the save succeeded; cleaning up failed
            assert len(caught) == 1 and "the new checkpoint is in place" in str(caught[0].message)
            assert snapshot(ckpt) == after, where
            removed = k >= steps.index(("after", "remove", steps[swap][2]))
            assert len(leftovers(ckpt)) == (0 if removed else 1), where
            for old_copy in leftovers(ckpt):
                assert f"The old checkpoint lies in {ckpt.parent / old_copy}" in str(
                    caught[0].message
                ), where
                shutil.rmtree(ckpt.parent / old_copy)


# --------------------------------------------------------------------------------------------
# jax.set_mesh


@pytest.mark.cpu_mesh
def test_save_under_a_global_mesh(tmp_path):
    """`jax.set_mesh(mesh)` made the per-shard slicing refuse arrays on one of the mesh's
    devices ("jit's context mesh with device ids [0..7]")."""
    mesh = mesh_of((2, 4), ("a", "b"))
    rng = np.random.default_rng(0)
    values = {k: rng.standard_normal((4, 8, 8), dtype=np.float32) for k in "wxyz"}
    # `jax.set_mesh` as the global setter it is, undone when the block ends (this process
    # runs other tests after this one).
    with jax.set_mesh(mesh):
        tree = {
            "w": jax.device_put(values["w"], NamedSharding(mesh, P(None, "b", "a"))),
            "x": jax.device_put(values["x"], NamedSharding(mesh, P("a", "b"))),
            "y": jnp.asarray(values["y"]),  # replicated over the mesh
            "z": jax.device_put(values["z"], jax.devices()[3]),
        }
        names = {k: k + ".{i}" for k in tree}
        eqx_lean.save_tensors(tmp_path / "ckpt", tree, names)
        eqx_lean.save_stacked(tmp_path / "ckpt", tree, names)
        assert jax.sharding.get_abstract_mesh() == mesh.abstract_mesh  # left as it was
    saved = safetensors.numpy.load_file(tmp_path / "ckpt" / "model.safetensors")
    assert sorted(saved) == sorted(f"{k}.{i}" for k in tree for i in range(4))
    for k, v in values.items():
        for i in range(4):
            np.testing.assert_array_equal(saved[f"{k}.{i}"], v[i])


# --------------------------------------------------------------------------------------------
# Fault injection: saves killed at every step and at spread delays (tests/save_faults.py)


class World(NamedTuple):
    template: Path  # the whole layout; each case is a copy of it
    destination: str  # the path the save is given, relative to the layout
    real: str  # the directory it replaces

    def outside(self, root: Path) -> dict[str, tuple]:
        """Everything under `root` outside the destination, its leftovers aside."""
        parent = os.path.dirname(self.real)
        name = os.path.basename(self.real)
        spare = [os.path.join(parent, p.name) for p in (root / parent).glob(f".{name}.*-*")]
        return snapshot(root, exclude=(self.real, *spare))


def make_world(root: Path, layout: str, write_old) -> World:
    """The old checkpoint (written by `write_old(directory)`) plus metadata, laid out as
    `layout`: a plain directory (with a link to a shared directory), a `cp -al` copy of an
    original, a symbolic link to the directory, or a Hugging Face cache snapshot whose files are
    links into `blobs/`."""
    template = root / "template"
    template.mkdir(parents=True)
    if layout == "hf_cache":
        scratch = root / "scratch"
        write_old(scratch)
        add_extras(scratch)
        repo = template / "hub" / "models--org--tiny"
        snapshot_dir = repo / "snapshots" / "0123abc"
        for file in sorted(p for p in scratch.rglob("*") if p.is_file()):
            data = file.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = snapshot_dir / file.relative_to(scratch)
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(blob, link.parent), link)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abc")
        world = World(template, "hub/models--org--tiny/snapshots/0123abc", "")
        world = world._replace(real=world.destination)
    else:
        base = {"plain": "ckpt", "hardlinks": "original", "symlink": "real"}[layout]
        write_old(template / base)
        add_extras(template / base)
        if layout == "plain":
            (template / "shared").mkdir()
            (template / "shared" / "vocab.txt").write_text("shared")
            os.symlink("../shared", template / base / "assets")
            world = World(template, "ckpt", "ckpt")
        elif layout == "hardlinks":
            subprocess.run(["cp", "-al", str(template / base), str(template / "ckpt")], check=True)
            world = World(template, "ckpt", "ckpt")
        else:
            os.symlink("real", template / "link")
            world = World(template, "link", "real")
    os.chmod(template / world.real, 0o750)
    return world


def run_faults(tmp_path: Path, kind: str, world: World, model, save_kwargs: dict, **spec):
    """Runs `tests/save_faults.py`; returns the uninterrupted case and the killed ones."""
    model_file = tmp_path / "model.pickle"
    model_file.write_bytes(pickle.dumps(model))
    cases = tmp_path / "cases"
    cases.mkdir()
    spec = dict(
        kind=kind,
        model=str(model_file),
        template=str(world.template),
        destination=world.destination,
        cases=str(cases),
        save=save_kwargs,
        **{"steps": [], "delays": [], "no_exchange": False, **spec},
    )
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = subprocess_env()
    result = subprocess.run(
        [sys.executable, str(FAULTS), str(tmp_path / "spec.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr
    complete, *killed = [json.loads(line) for line in result.stdout.splitlines()]
    assert complete["outcome"] == "completed", complete
    return complete, killed


def check_new_checkpoint(
    world: World,
    destination: Path,
    expected: dict,
    config: dict | None,
    generation: dict | None = None,
):
    """The new checkpoint, checked by hand: its tensors, its config, and every carried file as
    a regular copy (a link kept only where it points to a directory or nowhere). With
    `generation`, `generation_config.json` is the save's own (`save_hf` writes it) and must
    hold that JSON object."""
    assert_tensors_equal(read_checkpoint(destination), expected)
    if config is not None:
        assert json.loads((destination / "config.json").read_text()) == config
        assert not (destination / "config.json").is_symlink()
    old = world.template / world.real
    for relative, entry in snapshot(old).items():
        name = Path(relative).name
        if name.endswith((".safetensors", ".index.json")) or relative == "config.json":
            continue
        found = destination / relative
        if entry[0] == "link" and (old / relative).is_dir():
            assert os.readlink(found) == entry[1], relative
        elif entry[0] != "dir":
            assert not found.is_symlink() and os.stat(found).st_nlink == 1, relative
            if generation is not None and relative == "generation_config.json":
                assert json.loads(found.read_text()) == generation
                continue
            assert found.read_bytes() == (old / relative).read_bytes(), relative
    assert stat.S_IMODE(os.stat(destination).st_mode) == 0o750


def sweep(
    tmp_path,
    kind,
    layout,
    write_old,
    new_model,
    save_kwargs,
    expected,
    config,
    load,
    generation=None,
    **spec,
):
    """Kills a save over `layout` as `spec` says and checks every case: a child to be killed in
    the hook died there (killed, never completed, at exactly that hook call), one killed after a
    delay may have completed first; outside the destination, every file byte-identical; the
    destination exactly the old or exactly the new checkpoint (every file, link and mode), as the
    point of the kill requires; `load(destination, state)` checks what eqx_lean loads from the
    first case of each state (the others hold the same bytes), or from every case with
    `load_every=True`."""
    world = make_world(tmp_path / "world", layout, write_old)
    server_spec = {k: v for k, v in spec.items() if k != "load_every"}
    complete, killed = run_faults(tmp_path, kind, world, new_model, save_kwargs, **server_spec)
    trace = [tuple(step[:3]) for step in complete["steps"]]
    real = Path(complete["world"]) / world.real
    check_new_checkpoint(world, real, expected, config, generation)
    states = {"old": snapshot(world.template / world.real), "new": snapshot(real)}
    outside = world.outside(world.template)
    assert world.outside(Path(complete["world"])) == outside
    load(real, "new")
    swap = next((i for i, s in enumerate(trace) if s[:2] == ("after", "exchange")), None)
    results = []
    for case in killed:
        root = Path(case["world"])
        destination = root / world.real
        where = (case["case"], case["steps"][-1:] if case["steps"] else None, case["outcome"])
        if case["kill_at"] is None:  # killed from outside after a delay: maybe after the end
            assert case["outcome"] in ("killed", "completed"), where
        else:  # killed by the hook at its `kill_at`-th call, with that many calls logged
            assert case["outcome"] == "killed", where
            assert len(case["steps"]) == case["kill_at"], where
        assert world.outside(root) == outside, where
        if world.destination != world.real:
            assert os.readlink(root / world.destination) == os.readlink(
                world.template / world.destination
            )
        state = next((s for s, snap in states.items() if snapshot(destination) == snap), None)
        if state is None and spec.get("no_exchange") and not destination.exists():
            # Between the two renames of the fallback: the old checkpoint lies aside.
            (aside,) = list(destination.parent.glob(f".{destination.name}.old-*"))
            assert snapshot(aside) == states["old"], where
            renames = [i + 1 for i, s in enumerate(trace) if s[1] == "rename"]
            assert case["kill_at"] in renames[1:3], where  # after the first, before the second
            results.append("aside")
            continue
        assert state is not None, where
        if case["kill_at"] is not None and swap is not None:
            assert state == ("new" if case["kill_at"] > swap else "old"), where
        assert len(leftovers(destination)) <= 1, where
        if state not in results or spec.get("load_every"):
            load(
                destination, state
            )  # by default one case per state: the others hold the same bytes
        results.append(state)
    return trace, killed, results


def stacked_loader(old_tree, new_tree):
    def load(destination: Path, state: str) -> None:
        tree = old_tree if state == "old" else new_tree
        like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in tree.items()}
        loaded = eqx_lean.load_stacked(destination, like, NAMES)
        for k, v in tree.items():
            np.testing.assert_array_equal(bits(np.asarray(loaded[k])), bits(v), err_msg=k)

    return load


def stacked_sweep(tmp_path, layout, steps, delay_fractions=(), width=8, layers=(4, 3), **spec):
    old_tree, new_tree = stacked(layers[0], 0, width), stacked(layers[1], 1, width)

    def write_old(path):
        eqx_lean.save_stacked(path, old_tree, NAMES, max_shard_bytes=600 * width)

    save_kwargs = {"max_shard_bytes": 10**12} if width == 8 else {"max_shard_bytes": 3 << 20}
    return sweep(
        tmp_path,
        "stacked",
        layout,
        write_old,
        (new_tree, NAMES),
        save_kwargs,
        tensors_of(new_tree),
        None,
        stacked_loader(old_tree, new_tree),
        steps=steps,
        delay_fractions=list(delay_fractions),
        **spec,
    )


@pytest.mark.parametrize("layout", ["plain", "hardlinks", "symlink"])
def test_save_stacked_killed_before_and_after_every_step(tmp_path, layout):
    """SIGKILL inside the hook before and after each filesystem operation, for every one until
    the save completes (the default suite runs the plain layout whole; for the others, every
    call but the writes, and the first and the last write)."""
    sampled = layout != "plain"
    trace, killed, results = stacked_sweep(tmp_path, layout, "sample:2" if sampled else "all")
    expected = list(range(1, len(trace) + 1))
    if sampled:  # what "sample:2" asks for, derived here from the uninterrupted save's trace
        writes = [k for k in expected if trace[k - 1][1] == "write"]
        assert len(writes) >= 2, trace
        ends = (writes[0], writes[-1])
        expected = [k for k in expected if trace[k - 1][1] != "write" or k in ends]
    assert [case["kill_at"] for case in killed] == expected
    for case in killed:  # each child died in the hook call it was to die in, not later
        assert case["outcome"] == "killed", case
        assert len(case["steps"]) == case["kill_at"], case
    # `sweep` found every case's destination exactly the old or the new checkpoint: both occur.
    assert len(results) == len(killed) and set(results) == {"old", "new"}, results


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hardlinks", "symlink"])
def test_save_stacked_killed_at_every_step_full(tmp_path, layout):
    trace, killed, _ = stacked_sweep(tmp_path, layout, "all", load_every=True)
    assert [case["kill_at"] for case in killed] == list(range(1, len(trace) + 1))


@pytest.mark.parametrize("layout", ["plain"])
def test_save_without_atomic_exchange_killed_at_every_step(tmp_path, layout):
    """Where `renameat2` is missing, two renames: between them the destination is missing and the
    old checkpoint lies in `.<name>.old-*`, as the docs say; at every other point, old or new."""
    trace, killed, results = stacked_sweep(tmp_path, layout, "all", no_exchange=True)
    assert ("before", "exchange") in [s[:2] for s in trace]  # tried, refused, then renames
    assert [s[:2] for s in trace].count(("after", "rename")) == 2
    assert results.count("aside") == 2 and len(killed) == len(trace)


# The last hook call a child logged before dying, when it died while a file was being written
# (created, partly written, or written but not yet flushed).
MID_FILE = (["after", "create"], ["before", "write"], ["after", "write"], ["before", "fsync"])


def assert_some_land_mid_file(killed: list[dict], results: list[str]) -> None:
    landed = [c["steps"][-1][:2] if c["steps"] else None for c in killed]
    assert any(step in MID_FILE for step in landed), landed
    assert "old" in results and "new" in results, (results, landed)


def test_save_stacked_killed_at_spread_delays(tmp_path):
    """Real SIGKILLs from outside at spread delays, some in the middle of a file's writing."""
    trace, killed, results = stacked_sweep(
        tmp_path, "plain", [], [*np.linspace(0.02, 1.0, 11), 3.0], width=512, layers=(6, 8)
    )
    assert_some_land_mid_file(killed, results)


# --- save_hf ----------------------------------------------------------------------------------


def mistral_config(**overrides):
    from eqx_lean.hf import DecoderConfig

    fields: dict[str, Any] = {**TINY_DECODER, "dtype": "float32", **overrides}
    return DecoderConfig(**fields)


def random_mistral(config, seed: int):
    """A Mistral of random numpy leaves (no JAX computation; `init` would compile for seconds)."""
    from eqx_lean.hf import abstract_model

    rng = np.random.default_rng(seed)
    like = abstract_model(config)
    return jax.tree.map(
        lambda s: (0.2 * rng.standard_normal(s.shape, dtype=np.float32)).astype(s.dtype), like
    )


def hf_sweep(tmp_path, layout, steps, delay_fractions=(), big=False, load_every=False):
    """Old: 2 float32 layers; new: 3 bfloat16 layers in several shards. A mixture (new weights
    with the old config, or the reverse) would load as the wrong model."""
    from eqx_lean.hf import load_hf, save_hf, to_hf_state_dict

    sizes = dict(vocab_size=2048, hidden_size=256, intermediate_size=768) if big else {}
    old_model = random_mistral(mistral_config(**sizes), 0)
    new_config = mistral_config(num_hidden_layers=3, dtype="bfloat16", **sizes)
    new_model = random_mistral(new_config, 1)
    config = new_config.to_hf() | {"dtype": "bfloat16"}
    models = {"old": old_model, "new": new_model}

    def load(destination: Path, state: str) -> None:
        loaded, model = load_hf(destination), models[state]
        assert loaded.config == model.config and loaded.dtype == model.dtype, state
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(model), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype, state
            np.testing.assert_array_equal(bits(np.asarray(a)), bits(b))

    return sweep(
        tmp_path,
        "hf",
        layout,
        lambda path: save_hf(old_model, path),
        new_model,
        {"max_shard_bytes": (4 << 20) if big else 40_000},
        to_hf_state_dict(new_model),
        config,
        load,
        # The old directory's generation config (`add_extras`), the new model's stop id added.
        generation={"max_length": 9, "eos_token_id": new_config.eos_token_id},
        steps=steps,
        delay_fractions=list(delay_fractions),
        load_every=load_every,
    )


@pytest.mark.parametrize("layout", ["plain", "hf_cache"])
def test_save_hf_killed_before_and_after_sampled_steps(tmp_path, layout):
    """SIGKILL inside the hook before and after each filesystem operation: every call but the
    writes, and the first, a middle and the last write ("sample:3"); each child died at its
    point and left exactly the old or the new checkpoint."""
    trace, killed, results = hf_sweep(tmp_path, layout, "sample:3")
    # What "sample:3" asks for, derived here from the uninterrupted save's trace.
    every = list(range(1, len(trace) + 1))
    writes = [k for k in every if trace[k - 1][1] == "write"]
    assert len(writes) >= 3, trace
    kill_at = [case["kill_at"] for case in killed]
    assert kill_at == sorted(set(kill_at)), kill_at
    assert [k for k in kill_at if k not in writes] == [k for k in every if k not in writes]
    middles = sorted({writes[(len(writes) - 1) // 2], writes[len(writes) // 2]})  # two if even
    sampled = [k for k in kill_at if k in writes]
    allowed = [[writes[0], middle, writes[-1]] for middle in middles]
    assert sampled in allowed, f"killed at writes {sampled}, not one of {allowed} of {writes}"
    for case in killed:  # each child died in the hook call it was to die in, not later
        assert case["outcome"] == "killed", case
        assert len(case["steps"]) == case["kill_at"], case
    # `sweep` found every case's destination exactly the old or the new checkpoint: both occur.
    assert len(results) == len(killed) and set(results) == {"old", "new"}, results


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["plain", "hardlinks", "symlink", "hf_cache"])
def test_save_hf_killed_at_every_step_full(tmp_path, layout):
    trace, killed, _ = hf_sweep(tmp_path, layout, "all", load_every=True)
    assert [case["kill_at"] for case in killed] == list(range(1, len(trace) + 1))


@pytest.mark.parametrize("layout", ["plain"])
def test_save_hf_killed_at_spread_delays(tmp_path, layout):
    trace, killed, results = hf_sweep(
        tmp_path, layout, [], [*np.linspace(0.02, 1.0, 11), 3.0], big=True
    )
    assert_some_land_mid_file(killed, results)


def test_save_hf_over_a_hard_linked_copy_leaves_the_original_loading_as_before(tmp_path):
    """The issue's case: `save_hf` into a `cp -al` copy used to rewrite the original's
    `config.json` in place, through the hard link."""
    from eqx_lean.hf import load_hf, save_hf

    old_model = random_mistral(mistral_config(), 0)
    new_model = random_mistral(mistral_config(num_hidden_layers=3, dtype="bfloat16"), 1)
    save_hf(old_model, tmp_path / "base")
    subprocess.run(["cp", "-al", str(tmp_path / "base"), str(tmp_path / "copy")], check=True)
    (tmp_path / "copy" / "consolidated.safetensors").write_bytes(b"other weights")
    original = snapshot(tmp_path / "base")
    with pytest.raises(ValueError, match=r"does not own: 'consolidated.safetensors'"):
        save_hf(new_model, tmp_path / "copy")
    save_hf(new_model, tmp_path / "copy", other_weights="drop")
    assert snapshot(tmp_path / "base") == original
    for path, model in [(tmp_path / "base", old_model), (tmp_path / "copy", new_model)]:
        loaded = load_hf(path)
        assert loaded.config == model.config and loaded.dtype == model.dtype
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(model), strict=True):
            np.testing.assert_array_equal(bits(np.asarray(a)), bits(b))
    assert sorted(os.listdir(tmp_path / "copy")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


def test_concurrent_saves_never_mix(old):
    """Two threads saving different models to one path, again and again: after each round the
    directory is exactly one of the two checkpoints, with the metadata, and nothing is left."""
    import threading

    ckpt, _ = old
    trees = [stacked(3, 10), stacked(5, 11)]
    errors = []

    def run(tree):
        try:
            eqx_lean.save_stacked(ckpt, tree, NAMES, max_shard_bytes=700)
        except BaseException as e:  # reported below
            errors.append(e)

    for _ in range(8):
        threads = [threading.Thread(target=run, args=(t,)) for t in trees]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        found = read_checkpoint(ckpt)
        assert any(sorted(found) == sorted(tensors_of(t)) for t in trees)
        (tree,) = [t for t in trees if sorted(found) == sorted(tensors_of(t))]
        assert_tensors_equal(found, tensors_of(tree))
        assert (ckpt / "extra" / "notes.txt").read_text() == "kept"
        assert leftovers(ckpt) == []
