"""What a save deletes and what it keeps (`eqx_lean._io.owned`, `eqx_lean._io.carry`).

A save owns a name only as a regular file (or a link to one): a directory, FIFO, socket or link
to a directory under a name it writes is refused before any work. What other processes write
into the target while the save runs is in the new checkpoint: the save lists the target again
just before the swap until nothing is new. And the messages for `files=` values that are not
regular files and for `bytes` paths.
"""

import os
import shutil
import socket
import stat
import warnings
from pathlib import Path

import numpy as np
import pytest
from test_io_save import (
    NAMES,
    assert_tensors_equal,
    leftovers,
    no_change,
    old as old,
    read_checkpoint,
    save,
    snapshot,
    stacked,
    tensors_of,
)

import eqx_lean
from eqx_lean.internal import RELISTS, fs


OWNED = "must be a regular file \\(or a symbolic link to one\\)"


# --------------------------------------------------------------------------------------------
# A save owns a name only as a regular file


def test_a_files_key_naming_a_subdirectory_is_refused_even_with_keep(old):
    """The issue's case: `files={"extra": ...}` used to delete the subdirectory `extra/`, and a
    `pytorch_model.bin` in it, with the old checkpoint, whatever `other_weights` said."""
    ckpt, _ = old
    (ckpt / "extra" / "pytorch_model.bin").write_bytes(b"someone's weights")
    with (
        no_change(ckpt.parent),
        pytest.raises(
            ValueError,
            match=rf"holds 'extra' \(a directory\), the name of `files\['extra'\]`.*{OWNED}.*"
            "Nothing was written",
        ),
    ):
        save(ckpt, files={"extra": b"{}"}, other_weights="keep")


@pytest.mark.parametrize("name", ["adapter.safetensors", "adapter-00001-of-00002.safetensors"])
def test_a_weights_name_naming_a_subdirectory_is_refused(old, name):
    ckpt, _ = old
    (ckpt / name).mkdir()
    (ckpt / name / "pytorch_model.bin").write_bytes(b"someone's weights")
    with (
        no_change(ckpt.parent),
        pytest.raises(
            ValueError,
            match=rf"holds '{name}' \(a directory\), the name of "
            r"`weights_name='adapter.safetensors'` \(its weight files and index\).*"
            rf"{OWNED}.*Nothing was written",
        ),
    ):
        save(ckpt, weights_name="adapter.safetensors", other_weights="keep")


def make_special(ckpt: Path, name: str, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(ckpt / name)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(os.fspath(ckpt / name))
        server.close()  # the socket file stays
    elif kind == "link to a directory":
        os.symlink("extra", ckpt / name)
    else:
        os.symlink("nowhere", ckpt / name)


@pytest.mark.parametrize(
    "kind, words",
    [
        ("fifo", "a FIFO"),
        ("socket", "a socket"),
        ("link to a directory", "a symbolic link to a directory"),
        ("dangling link", "a symbolic link that points nowhere"),
    ],
)
@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_other_kinds_of_entry_under_an_owned_name_are_refused(tmp_path, kind, words, name):
    ckpt = tmp_path / "ckpt"
    save(ckpt)
    if name == "model.safetensors":
        os.unlink(ckpt / name)
    (ckpt / "extra").mkdir()
    make_special(ckpt, name, kind)
    special = os.lstat(ckpt / name)
    before = snapshot(tmp_path, exclude=(f"ckpt/{name}",))  # reading a FIFO would wait
    with pytest.raises(ValueError, match=rf"holds '{name}' \({words}\)"):
        save(ckpt, files={"config.json": b"{}"})
    assert snapshot(tmp_path, exclude=(f"ckpt/{name}",)) == before
    assert os.lstat(ckpt / name).st_ino == special.st_ino and leftovers(ckpt) == []


def test_a_link_to_a_file_under_an_owned_name_is_dropped_never_followed(tmp_path):
    ckpt = tmp_path / "ckpt"
    save(ckpt)
    (tmp_path / "shared.json").write_text("shared")
    os.symlink("../shared.json", ckpt / "config.json")
    save(ckpt, files={"config.json": b"{}"})
    assert (tmp_path / "shared.json").read_text() == "shared"
    assert not (ckpt / "config.json").is_symlink()
    assert (ckpt / "config.json").read_bytes() == b"{}"


# --------------------------------------------------------------------------------------------
# Nothing written during a save is lost


def new_dir_of(paths: tuple[str, ...]) -> bool:
    return os.path.basename(os.path.dirname(paths[0])).startswith(".ckpt.tmp-")


def test_what_is_written_into_the_target_during_the_save_is_carried(old):
    """A trainer writes `trainer_state.json` once the weights are written, and appends to the
    README just after the save copied it, makes a directory and deletes `tokenizer.json`; a
    weight file appearing then is copied although `other_weights="refuse"` (too late to ask)."""
    ckpt, _ = old
    new = stacked(3, 1)
    copies: list[str] = []

    def trainer(when, op, paths):
        name = os.path.basename(paths[0])
        if (when, op) == ("after", "copy"):
            copies.append(name)
        if (when, op, name) == ("after", "fsync", "model.safetensors") and new_dir_of(paths):
            (ckpt / "trainer_state.json").write_text('{"step": 7}')
            (ckpt / "optimizer.pt").write_bytes(b"optimizer state")
            (ckpt / "model.safetensors").write_bytes(b"not the save's weights")  # owned
        if (when, op, name) == ("after", "copy", "README.md") and copies.count(name) == 1:
            with open(ckpt / "README.md", "a") as f:
                f.write("appended during the save\n")
            (ckpt / "logs").mkdir()
            (ckpt / "logs" / "events.txt").write_text("event")
            os.unlink(ckpt / "tokenizer.json")

    with fs.hooked(trainer):
        eqx_lean.save_stacked(ckpt, new, NAMES)
    assert_tensors_equal(read_checkpoint(ckpt), tensors_of(new))  # owned: never carried
    assert (ckpt / "trainer_state.json").read_text() == '{"step": 7}'
    assert (ckpt / "optimizer.pt").read_bytes() == b"optimizer state"
    assert (ckpt / "README.md").read_text() == "# a model\nappended during the save\n"
    assert (ckpt / "logs" / "events.txt").read_text() == "event"
    assert not (ckpt / "tokenizer.json").exists()
    assert (ckpt / "extra" / "notes.txt").read_text() == "kept"
    assert copies.count("README.md") == 2 and copies.count("notes.txt") == 1
    assert leftovers(ckpt) == []


def test_a_file_written_to_while_copied_is_copied_again(old):
    ckpt, _ = old
    sizes = []

    def writer(when, op, paths):
        if (when, op, os.path.basename(paths[0])) == ("before", "copy", "README.md"):
            sizes.append(os.stat(ckpt / "README.md").st_size)
            if len(sizes) == 1:  # between the save's `fstat` and its copy of the data
                with open(ckpt / "README.md", "a") as f:
                    f.write("more\n")

    with fs.hooked(writer):
        save(ckpt)
    assert len(sizes) == 2  # the first copy is never trusted
    assert (ckpt / "README.md").read_text() == "# a model\nmore\n"


def test_a_file_that_never_settles_is_copied_six_times_then_a_warning_names_it(old):
    ckpt, _ = old
    copies = []

    def appender(when, op, paths):
        if (when, op, os.path.basename(paths[0])) == ("before", "copy", "README.md"):
            copies.append(paths[0])
            with open(ckpt / "README.md", "a") as f:
                f.write("line\n")

    with (
        fs.hooked(appender),
        pytest.warns(UserWarning, match=r"README.md in .*ckpt kept changing.*6 copies") as caught,
    ):
        eqx_lean.save_stacked(ckpt, stacked(2, 1), NAMES)
    assert len(copies) == RELISTS + 1 == 6
    assert caught[0].filename == __file__  # the user's call, not eqx_lean's
    assert (ckpt / "README.md").read_text().startswith("# a model\nline\n")


def test_an_entry_under_an_owned_name_appearing_during_the_save_stops_it(old):
    ckpt, _ = old
    before = snapshot(ckpt)

    def intruder(when, op, paths):
        if (when, op) == ("after", "copy") and paths[0].endswith("/README.md"):
            (ckpt / "config.json").mkdir()

    with (
        fs.hooked(intruder),
        pytest.raises(ValueError, match=r"holds 'config.json' \(a directory\).*appeared") as e,
    ):
        save(ckpt, files={"config.json": b"{}"})
    os.rmdir(ckpt / "config.json")
    assert snapshot(ckpt) == before and leftovers(ckpt) == []
    assert "The partial new checkpoint" in "\n".join(e.value.__notes__)


def test_a_first_save_whose_target_appears_meanwhile_keeps_what_it_holds(tmp_path):
    """Another process makes the directory while the save writes: the save carries what it
    holds beyond the save's own names, as if it had been there from the start."""
    ckpt = tmp_path / "ckpt"
    new = stacked(2, 4)

    def maker(when, op, paths):
        if (when, op, os.path.basename(paths[0])) == ("after", "fsync", "model.safetensors"):
            ckpt.mkdir(mode=0o750)
            (ckpt / "trainer_state.json").write_text("{}")
            (ckpt / "model.safetensors").write_bytes(b"someone's")

    with fs.hooked(maker):
        eqx_lean.save_stacked(ckpt, new, NAMES)
    assert_tensors_equal(read_checkpoint(ckpt), tensors_of(new))
    assert (ckpt / "trainer_state.json").read_text() == "{}"
    assert stat.S_IMODE(os.stat(ckpt).st_mode) == 0o750
    assert leftovers(ckpt) == []


@pytest.mark.parametrize("event", ["appears", "vanishes"])
def test_a_target_made_or_deleted_just_before_the_swap(old, event):
    """Between the last listing and the swap: made (the rename finds it: exchange with it, the
    last swap wins) or deleted (the exchange finds nothing: rename into place)."""
    ckpt, _ = old
    if event == "appears":
        shutil.rmtree(ckpt)
    new = stacked(2, 5)
    swap_op = "rename" if event == "appears" else "exchange"
    done = []

    def racer(when, op, paths):
        if (when, op) == ("before", swap_op) and not done:
            done.append(op)
            if event == "appears":
                ckpt.mkdir()
                (ckpt / "model.safetensors").write_bytes(b"another save's")
                (ckpt / "other.txt").write_text("another save's file")
            else:
                shutil.rmtree(ckpt)

    with fs.hooked(racer):
        eqx_lean.save_stacked(ckpt, new, NAMES)
    assert_tensors_equal(read_checkpoint(ckpt), tensors_of(new))
    if event == "appears":
        assert sorted(os.listdir(ckpt)) == ["model.safetensors", "other.txt"]
    else:  # what it had copied from the target before it went
        assert (ckpt / "extra" / "notes.txt").read_text() == "kept"
    assert leftovers(ckpt) == []


# --------------------------------------------------------------------------------------------
# Messages


@pytest.mark.parametrize("kind", ["fifo", "/dev/null", "directory"])
def test_a_files_value_that_is_not_a_regular_file_is_named(tmp_path, kind):
    source = {"fifo": tmp_path / "pipe", "/dev/null": Path("/dev/null"), "directory": tmp_path}[
        kind
    ]
    if kind == "fifo":
        os.mkfifo(source)
    words = {"fifo": "a FIFO", "/dev/null": "a character device"}
    with pytest.raises(
        ValueError,
        match=rf"`files\['tok.json'\]` must be a regular file to copy; {source} is not a "
        rf"regular file but {words.get(kind, 'a directory')}",
    ):
        save(tmp_path / "ckpt", files={"tok.json": source})
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("fn", [eqx_lean.save_stacked, eqx_lean.save_tensors])
def test_a_bytes_path_is_refused_saying_what_to_pass(tmp_path, fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no BytesWarning either
        with pytest.raises(
            TypeError, match=r"`path` must be a `str` or an `os.PathLike`.*got bytes b'.*ckpt'"
        ):
            fn(os.fsencode(tmp_path / "ckpt"), {"w": np.ones((2, 3), np.float32)}, {"w": "w.{i}"})
    assert os.listdir(tmp_path) == []
