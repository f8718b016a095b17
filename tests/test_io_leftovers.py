"""What saves leave beside their target (`eqx_lean._io.leftovers`), and saves racing each other.

Each save holds a lock on its `.<name>.tmp-<token>` directory from its creation to its end:
`eqx_lean.remove_leftovers` deletes only those nobody holds (a killed save's, in a real
subprocess) and never a running save's (one paused in a subprocess), a save warns about dead
ones, and an old checkpoint left aside without an atomic exchange is renamed back. First saves
racing in real processes each end with exactly one saver's complete checkpoint.
"""

import fcntl
import json
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import subprocess_env
from test_io_save import (
    assert_tensors_equal,
    leftovers,
    read_checkpoint,
    save,
    stacked,
    tensors_of,
)

import eqx_lean
from eqx_lean import Leftovers
from eqx_lean.internal import directory, fs


REPO = Path(__file__).resolve().parent.parent
CHILDREN = REPO / "tests" / "save_children.py"
ENV = subprocess_env()


def child(*arguments: str, **kwargs) -> subprocess.Popen:
    command = [sys.executable, str(CHILDREN), *arguments]
    return subprocess.Popen(command, env=ENV, text=True, **kwargs)


def dead_save_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    messages = [str(w.message) for w in caught]
    return [m for m in messages if "leftovers of saves of it that died" in m]


# --------------------------------------------------------------------------------------------
# Killed and running saves


@pytest.mark.quick
def test_a_killed_save_s_directory_is_warned_about_then_removed(tmp_path):
    ckpt = tmp_path / "ckpt"
    save(ckpt)
    killed = child("die", str(ckpt), stderr=subprocess.PIPE)
    _, stderr = killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL, stderr
    (left,) = leftovers(ckpt)
    assert (tmp_path / left / "model.safetensors").exists()  # killed once its weights were written
    with pytest.warns(UserWarning, match=rf"{left}.*`eqx_lean.remove_leftovers\('{ckpt}'\)`"):
        save(ckpt)
    assert leftovers(ckpt) == [left]  # a save warns; it deletes nothing it does not own
    result = eqx_lean.remove_leftovers(ckpt)
    assert result == Leftovers(removed=[tmp_path / left], restored=None, skipped_locked=[])
    assert leftovers(ckpt) == []
    assert_tensors_equal(read_checkpoint(ckpt), tensors_of(stacked(2, 1)))


def test_a_running_save_s_directory_is_never_removed(tmp_path):
    """A save paused (in another process) once its weights are written holds its directory:
    `remove_leftovers` leaves it alone, and a save meanwhile does not warn about it."""
    ckpt = tmp_path / "ckpt"
    save(ckpt)
    paused = child("pause", str(ckpt), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert paused.stdin is not None and paused.stdout is not None
    try:
        line = paused.stdout.readline()
        assert line.startswith("paused "), line
        held = Path(line.split(" ", 1)[1].strip())
        assert eqx_lean.remove_leftovers(ckpt).skipped_locked == [held]
        assert held.is_dir() and (held / "model.safetensors").exists()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            save(ckpt, stacked(3, 9))
        assert dead_save_warnings(caught) == []
        paused.stdin.write("go on\n")
        paused.stdin.flush()
        assert paused.stdout.readline() == "saved\n"
    finally:
        paused.kill()
        paused.wait(timeout=60)
    assert leftovers(ckpt) == []
    assert json.loads((ckpt / "saver.json").read_text()) == {"saver": 2}  # the last swap won


def test_a_save_holds_its_directory_from_creation_to_its_end(tmp_path):
    """Its new directory while it builds it, and the old checkpoint, once swapped out under
    the new directory's name, until it is deleted."""
    ckpt = tmp_path / "ckpt"
    save(ckpt)
    seen = []

    def check(when, op, paths):
        inside = os.path.basename(os.path.dirname(paths[0])).startswith(".ckpt.tmp-")
        if inside or (when, op) == ("before", "remove"):  # building it; deleting the old one
            held = Path(paths[0] if op == "remove" else os.path.dirname(paths[0]))
            seen.append((op, eqx_lean.remove_leftovers(ckpt).skipped_locked == [held]))

    with fs.hooked(check):
        save(ckpt)
    assert ("remove", True) in seen and all(held for _, held in seen), seen
    assert leftovers(ckpt) == []


def test_a_save_whose_new_directory_is_taken_by_remove_leftovers_starts_again(tmp_path):
    """`remove_leftovers` may lock a save's new directory between its creation and the save's
    own lock: it deletes it (empty), and the save makes another."""
    ckpt = tmp_path / "ckpt"
    save(ckpt)
    removed = []

    def cleaner(when, op, paths):
        if (when, op) == ("after", "mkdir") and not removed:
            removed.append(eqx_lean.remove_leftovers(ckpt).removed)

    with fs.hooked(cleaner):
        save(ckpt, stacked(3, 2))
    assert len(removed[0]) == 1 and removed[0][0].name.startswith(".ckpt.tmp-")
    assert_tensors_equal(read_checkpoint(ckpt), tensors_of(stacked(3, 2)))
    assert leftovers(ckpt) == []


def held_when_swapped_out(ckpt: Path) -> tuple[list[bool], Callable]:
    """A hook recording, at each exchange a save makes, whether a probe for dead saves finds
    the directory just swapped out (now under the save's temporary name) held by a save."""
    seen = []

    def check(when, op, paths):
        if (when, op) == ("after", "exchange"):
            swapped_out = Path(paths[0])
            seen.append(eqx_lean.remove_leftovers(ckpt).skipped_locked == [swapped_out])

    return seen, check


def test_a_checkpoint_made_after_a_save_s_lock_is_locked_before_it_is_swapped_out(
    tmp_path, monkeypatch
):
    """A first save finds the path missing when it locks what it will swap out; before it
    lists the path, another process's first save puts a checkpoint there and ends. The save
    must lock that checkpoint (and list it) before it swaps it out: else, swapped out, it would
    lie unlocked under the save's temporary name, and a probe would take it for a dead save's
    directory (and `remove_leftovers` delete it).

    The seam `directory._lock_occupant` is wrapped to run the other save, in a subprocess,
    just after this save's first lock attempt."""
    ckpt = tmp_path / "ckpt"
    real = directory._lock_occupant
    other_saves = []

    def then_another_save(path, locks):
        occupant = real(path, locks)
        if not other_saves:
            other_saves.append(
                subprocess.run(
                    [sys.executable, str(CHILDREN), "save", str(ckpt), "7"],
                    env=ENV,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
            )
        return occupant

    monkeypatch.setattr(directory, "_lock_occupant", then_another_save)
    seen, check = held_when_swapped_out(ckpt)
    with fs.hooked(check), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save(ckpt, stacked(3, 4))
    assert other_saves[0].returncode == 0, other_saves[0].stderr
    assert seen == [True]  # one exchange, with the other save's checkpoint, held
    assert dead_save_warnings(caught) == []
    assert leftovers(ckpt) == []
    assert_tensors_equal(read_checkpoint(ckpt), tensors_of(stacked(3, 4)))  # the last swap won
    assert json.loads((ckpt / "saver.json").read_text()) == {"saver": 7}  # carried over


def test_a_save_locks_what_it_swaps_out_while_another_save_holds_it(tmp_path):
    """Another save holding the current checkpoint (here: this process, with a save's shared
    lock) neither delays a save nor stops it from holding that checkpoint itself until it has
    deleted it: once the other lets go, a probe must still find it held."""
    ckpt = tmp_path / "ckpt"
    save(ckpt)
    other = fs.lock(ckpt, shared=True)
    assert other is not None
    seen = []

    def let_go_then_check(when, op, paths):
        if (when, op) == ("after", "exchange"):
            os.close(other)
            seen.append(eqx_lean.remove_leftovers(ckpt).skipped_locked == [Path(paths[0])])

    with fs.hooked(let_go_then_check):
        save(ckpt, stacked(2, 5))
    assert seen == [True]
    assert leftovers(ckpt) == []
    assert_tensors_equal(read_checkpoint(ckpt), tensors_of(stacked(2, 5)))


@pytest.mark.parametrize("first", [True, False], ids=["first-save", "replacing"])
def test_a_save_checks_and_swaps_under_a_lock_on_the_parent_directory(tmp_path, first):
    """Saves of checkpoints in one directory check what they swap out and swap one at a time:
    at the swap, the parent directory is locked, so no other save's swap can come between
    this save's check and its swap."""
    ckpt = tmp_path / "ckpt"
    if not first:
        save(ckpt)
    held = []

    def probe(when, op, paths):
        if when == "before" and op in ("rename", "exchange") and Path(paths[1]) == ckpt:
            fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)
            finally:
                os.close(fd)

    with fs.hooked(probe):
        save(ckpt, stacked(2, 6))
    assert held == [True]
    assert_tensors_equal(read_checkpoint(ckpt), tensors_of(stacked(2, 6)))


# --------------------------------------------------------------------------------------------
# An old checkpoint left aside (no atomic exchange)


def left_aside(tmp_path, monkeypatch) -> Path:
    """A save without `renameat2` that failed between its two renames: the target is missing,
    the old checkpoint lies in `.ckpt.old-*`, the new one in `.ckpt.tmp-*`."""
    ckpt = tmp_path / "ckpt"
    save(ckpt, stacked(2, 7))
    monkeypatch.setattr(fs, "_renameat2", lambda: None)

    def fail(when, op, paths):
        if (when, op) == ("after", "rename"):
            raise KeyboardInterrupt

    with fs.hooked(fail), pytest.raises(KeyboardInterrupt) as e:
        save(ckpt)
    assert "is missing: the old checkpoint lies in" in "\n".join(e.value.__notes__)
    assert not ckpt.exists()
    return ckpt


def test_an_old_checkpoint_left_aside_is_renamed_back(tmp_path, monkeypatch):
    ckpt = left_aside(tmp_path, monkeypatch)
    old_copy, new_copy = [tmp_path / n for n in leftovers(ckpt)]
    assert old_copy.name.startswith(".ckpt.old-") and new_copy.name.startswith(".ckpt.tmp-")
    result = eqx_lean.remove_leftovers(str(ckpt))
    assert result.restored == old_copy and result.removed == [new_copy]
    assert leftovers(ckpt) == []
    assert_tensors_equal(read_checkpoint(ckpt), tensors_of(stacked(2, 7)))


def test_an_old_checkpoint_left_aside_is_deleted_once_the_path_exists(tmp_path, monkeypatch):
    ckpt = left_aside(tmp_path, monkeypatch)
    with pytest.warns(UserWarning, match=r"\.ckpt\.old-.*\.ckpt\.tmp-"):
        save(ckpt, stacked(3, 8))  # a first save now
    result = eqx_lean.remove_leftovers(ckpt)
    assert result.restored is None and len(result.removed) == 2
    assert leftovers(ckpt) == []
    assert_tensors_equal(read_checkpoint(ckpt), tensors_of(stacked(3, 8)))


def test_remove_leftovers_touches_nothing_else(tmp_path):
    ckpt = tmp_path / "ckpt"
    save(ckpt)
    os.symlink("ckpt", tmp_path / "latest")
    for name in (".ckpt.tmp-notatoken", ".ckpt.tmp-0123abcd0", ".other.tmp-0123abcd", "x"):
        (tmp_path / name).mkdir()
    (tmp_path / ".ckpt.old-0123abcd").write_text("a file, not a save's directory")
    os.symlink("ckpt", tmp_path / ".ckpt.tmp-89abcdef")
    (tmp_path / ".ckpt.tmp-01234567").mkdir()
    before = sorted(os.listdir(tmp_path))
    # Through the link: leftovers lie beside the directory it points to, as a save's do.
    assert eqx_lean.remove_leftovers(tmp_path / "latest").removed == [
        tmp_path / ".ckpt.tmp-01234567"
    ]
    assert sorted(os.listdir(tmp_path)) == [n for n in before if n != ".ckpt.tmp-01234567"]
    assert eqx_lean.remove_leftovers(tmp_path / "missing" / "ckpt") == ([], None, [])


def test_remove_leftovers_refuses_a_bytes_path(tmp_path):
    with pytest.raises(TypeError, match=r"`path` must be a `str` or an `os.PathLike`.*bytes"):
        eqx_lean.remove_leftovers(os.fsencode(tmp_path))  # pyright: ignore[reportArgumentType]


# --------------------------------------------------------------------------------------------
# Concurrent first saves


@pytest.mark.parametrize(
    "savers, rounds",
    [(3, 10), (6, 40)],
)
def test_concurrent_first_saves_each_end_with_one_complete_checkpoint(tmp_path, savers, rounds):
    """SAVERS processes save to a path that does not exist yet, ROUNDS rounds: in odd rounds
    all reach their swap together (all but one find the path made by the first, and exchange
    with it), in even rounds they start together. Every save succeeds (the last swap wins),
    the path holds one saver's complete checkpoint, nothing is left beside it, and no save
    takes another's directory for a dead save's."""
    racing = child(
        "race",
        str(tmp_path),
        str(savers),
        str(rounds),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stdout, stderr = racing.communicate(timeout=600)
    assert racing.returncode == 0, stderr
    reports = [json.loads(line) for line in stdout.splitlines()]
    assert len(reports) == rounds, stderr
    assert "Warning" not in stderr, stderr
    for report in reports:
        assert report["exits"] == [0] * savers, (report, stderr)
        assert report["saver"] in range(savers), report
        assert report["beside"] == [], report
