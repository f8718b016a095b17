"""`eqx_lean._io.fs`: the one module through which a save changes the filesystem."""

import ctypes
import errno
import os
import platform
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from eqx_lean.internal import fs


@pytest.fixture
def calls():
    """Every hook call during the test, as (when, op, first path's name)."""
    seen: list[tuple[str, str, str]] = []
    with fs.hooked(lambda when, op, paths: seen.append((when, op, os.path.basename(paths[0])))):
        yield seen


def test_write_file_creates_writes_and_flushes_each_a_step(tmp_path, calls):
    data = np.arange(1000, dtype=np.float32)
    fs.write_file(tmp_path / "f", [b"head", data, memoryview(b"tail")], mode=0o640)
    assert (tmp_path / "f").read_bytes() == b"head" + data.tobytes() + b"tail"
    assert stat.S_IMODE(os.stat(tmp_path / "f").st_mode) == 0o640
    ops = ["create", "write", "write", "write", "chmod", "fsync"]
    assert calls == [(w, op, "f") for op in ops for w in ("before", "after")]


def test_write_file_gives_new_files_the_umask_mode(tmp_path):
    previous = os.umask(0o027)
    try:
        fs.write_file(tmp_path / "f", [b"x"])
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "f").st_mode) == 0o640


def test_write_file_never_writes_an_existing_file_or_through_a_link(tmp_path):
    (tmp_path / "old").write_bytes(b"old")
    os.symlink("old", tmp_path / "link")
    for name in ("old", "link"):
        with pytest.raises(FileExistsError):
            fs.write_file(tmp_path / name, [b"new"])
    assert (tmp_path / "old").read_bytes() == b"old"


def test_a_raising_hook_stops_the_operation_and_is_removed(tmp_path):
    def refuse(when, op, paths):
        if when == "before":
            raise RuntimeError(f"no {op}")

    with pytest.raises(RuntimeError, match="no mkdir"), fs.hooked(refuse):
        fs.mkdir(tmp_path / "d", 0o755)
    assert not (tmp_path / "d").exists()
    assert fs.HOOKS == []
    fs.mkdir(tmp_path / "d", 0o755)
    assert (tmp_path / "d").is_dir()


def test_copy_file_copies_content_mode_and_times_never_a_link(tmp_path, calls):
    source = tmp_path / "source"
    source.write_bytes(os.urandom(3 << 20))
    os.chmod(source, 0o604)
    os.utime(source, ns=(1_000_000_000, 2_000_000_000))
    os.symlink("source", tmp_path / "link")
    how = fs.copy_file(tmp_path / "link", tmp_path / "copy").how  # the link is followed
    assert how in ("reflink", "kernel", "read")
    copy = os.stat(tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == source.read_bytes()
    assert stat.S_ISREG(os.lstat(tmp_path / "copy").st_mode)
    assert copy.st_ino != os.stat(source).st_ino and copy.st_nlink == 1
    assert stat.S_IMODE(copy.st_mode) == 0o604 and copy.st_mtime_ns == 2_000_000_000
    assert calls == [(w, op, "copy") for op in ("copy", "fsync") for w in ("before", "after")]
    fs.copy_file(source, tmp_path / "private", mode=0o600)
    assert stat.S_IMODE(os.stat(tmp_path / "private").st_mode) == 0o600
    previous = os.umask(0o027)
    try:
        fs.copy_file(source, tmp_path / "new", mode="new")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o640
    with pytest.raises(FileExistsError):
        fs.copy_file(source, tmp_path / "copy")
    with pytest.raises(ValueError, match="must be a regular file"):
        fs.copy_file(tmp_path, tmp_path / "dir-copy")


def test_copy_file_falls_back_to_reading_and_writing(tmp_path, monkeypatch):
    source = tmp_path / "source"
    source.write_bytes(os.urandom((1 << 24) + 12345))  # more than one read

    def unsupported(*args):
        raise OSError(errno.EXDEV, "across filesystems")

    monkeypatch.setattr(fs.fcntl, "ioctl", unsupported)
    monkeypatch.setattr(fs.os, "copy_file_range", unsupported)
    assert fs.copy_file(source, tmp_path / "copy").how == "read"
    assert (tmp_path / "copy").read_bytes() == source.read_bytes()
    monkeypatch.delattr(fs.os, "copy_file_range")
    assert fs.copy_file(source, tmp_path / "again").how == "read"
    assert (tmp_path / "again").read_bytes() == source.read_bytes()


def make_dirs(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "which").write_text(name)
    return tmp_path / "a", tmp_path / "b"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_exchange_swaps_two_directories_atomically(tmp_path, calls):
    a, b = make_dirs(tmp_path)
    assert fs.exchange(a, b)
    assert (a / "which").read_text() == "b" and (b / "which").read_text() == "a"
    assert calls == [("before", "exchange", "a"), ("after", "exchange", "a")]
    with pytest.raises(FileNotFoundError):
        fs.exchange(a, tmp_path / "missing")


def test_exchange_reports_where_it_is_not_supported(tmp_path, monkeypatch, calls):
    a, b = make_dirs(tmp_path)
    monkeypatch.setattr(fs, "_renameat2", lambda: None)
    assert not fs.exchange(a, b)
    assert (a / "which").read_text() == "a"
    assert calls == [("before", "exchange", "a")]

    def no_flags(a, b, flags):  # a filesystem without RENAME_EXCHANGE
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(fs, "_renameat2", lambda: no_flags)
    assert not fs.exchange(a, b)
    assert (a / "which").read_text() == "a"


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.machine() not in fs._SYSCALL_RENAMEAT2,
    reason="the system call number is known for Linux on a few architectures",
)
def test_renameat2_through_the_system_call_without_a_libc_wrapper(tmp_path, monkeypatch):
    real = ctypes.CDLL(None, use_errno=True)

    class OldLibc:  # glibc before 2.28 has no `renameat2`
        syscall = real.syscall

    monkeypatch.setattr(fs.ctypes, "CDLL", lambda *args, **kwargs: OldLibc())
    fs._renameat2.cache_clear()
    try:
        a, b = make_dirs(tmp_path)
        assert fs.exchange(a, b)
        assert (a / "which").read_text() == "b"
        with pytest.raises(FileExistsError):
            fs.rename(a, b)
    finally:
        fs._renameat2.cache_clear()


@pytest.mark.parametrize("atomic", [True, False])
def test_rename_never_replaces(tmp_path, monkeypatch, atomic):
    if not atomic:
        monkeypatch.setattr(fs, "_renameat2", lambda: None)
    a, b = make_dirs(tmp_path)
    with pytest.raises(FileExistsError):
        fs.rename(a, b)
    assert (b / "which").read_text() == "b"
    fs.rename(a, tmp_path / "c")
    assert (tmp_path / "c" / "which").read_text() == "a" and not a.exists()


def test_remove_deletes_read_only_and_unreadable_directories(tmp_path, calls):
    tree = tmp_path / "tree"
    (tree / "ro" / "deep").mkdir(parents=True)
    (tree / "ro" / "deep" / "f").write_text("x")
    (tree / "closed").mkdir()
    (tree / "closed" / "g").write_text("y")
    os.symlink("/", tree / "root-link")  # removed as a link, never followed
    os.chmod(tree / "ro" / "deep", 0o555)
    os.chmod(tree / "ro", 0o555)
    os.chmod(tree / "closed", 0o000)
    fs.remove(tree)
    assert not tree.exists()
    assert calls == [("before", "remove", "tree"), ("after", "remove", "tree")]


def test_directory_operations_are_steps(tmp_path, calls):
    fs.mkdir(tmp_path / "d", 0o700)
    fs.symlink("d", tmp_path / "l")
    fs.chmod(tmp_path / "d", 0o750)
    fs.fsync_dir(tmp_path / "d")
    assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o750
    assert os.readlink(tmp_path / "l") == "d"
    ops = [("mkdir", "d"), ("symlink", "l"), ("chmod", "d"), ("fsync_dir", "d")]
    assert calls == [(w, op, name) for op, name in ops for w in ("before", "after")]


def test_copy_file_reports_a_source_written_to_while_copied(tmp_path):
    source = tmp_path / "source"
    source.write_bytes(b"first")
    settled = fs.copy_file(source, tmp_path / "copy").source
    assert settled is not None and settled.st_size == 5

    def append(when, op, paths):
        if (when, op) == ("before", "copy"):
            with open(source, "ab") as f:
                f.write(b" and more")

    with fs.hooked(append):
        assert fs.copy_file(source, tmp_path / "torn").source is None


def test_copy_file_refuses_a_fifo_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match="must be a regular file"):
        fs.copy_file(tmp_path / "fifo", tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_lock_is_exclusive_never_waits_and_follows_no_link(tmp_path):
    (tmp_path / "d").mkdir()
    os.symlink("d", tmp_path / "link")
    (tmp_path / "file").write_text("")
    fd = fs.lock(tmp_path / "d")
    assert fd is not None
    try:
        assert fs.lock(tmp_path / "d") is None  # another open file description: refused
    finally:
        os.close(fd)
    again = fs.lock(tmp_path / "d")
    assert again is not None
    os.close(again)
    for name in ("link", "file", "missing"):
        assert fs.lock(tmp_path / name) is None, name


def test_unlink_and_remove_are_steps_and_remove_accepts_a_vanished_tree(tmp_path, calls):
    (tmp_path / "f").write_text("x")
    os.symlink("f", tmp_path / "l")
    fs.unlink(tmp_path / "l")
    assert (tmp_path / "f").exists() and not os.path.lexists(tmp_path / "l")
    fs.remove(tmp_path / "gone")  # deleted meanwhile by another cleaner: no error
    assert calls == [
        (w, op, n) for op, n in [("unlink", "l"), ("remove", "gone")] for w in ("before", "after")
    ]


@pytest.mark.parametrize("path", [b"ckpt", 3, None])
def test_path_argument_refuses_what_is_not_a_str_or_path(path):
    with pytest.raises(TypeError, match=r"`path` must be a `str` or an `os.PathLike`.*got"):
        fs.path_argument(path)


def test_path_argument_refuses_a_path_like_of_bytes():
    class BytesPath:
        def __fspath__(self):
            return b"ckpt"

    with pytest.raises(TypeError, match=r"got BytesPath .*whose path is bytes b'ckpt'.*fsdecode"):
        fs.path_argument(BytesPath())
    assert fs.path_argument(Path("a") / "b") == "a/b"
