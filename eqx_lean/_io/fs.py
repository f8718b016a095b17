"""Every filesystem change a save makes, in one place, with a hook before and after each.

This is internal API: `eqx_lean._io.directory`, `.carry` and `.leftovers` are its only callers,
and the tests use the hooks for fault injection. A save (and `eqx_lean.remove_leftovers`)
changes the filesystem only through these operations, each one step:

| `op` | what it changes |
| --- | --- |
| `mkdir` | creates one directory |
| `create` | creates one new, empty file (`O_EXCL`: never an existing one, never through a link) |
| `write` | writes one buffer into a file being created |
| `chmod` | sets the permission bits of a file being created, or of a directory |
| `fsync` | flushes a created file's data and metadata to its device |
| `copy` | copies one file's content (a reflink where the filesystem can), mode and times |
| `symlink` | creates one symbolic link |
| `fsync_dir` | flushes a directory's entries to its device |
| `rename` | renames one directory entry |
| `exchange` | swaps two directories atomically (Linux `renameat2(RENAME_EXCHANGE)`) |
| `unlink` | deletes one file or symbolic link |
| `remove` | deletes a directory tree |

`HOOKS` is a list of callables `hook(when, op, paths)`, called with `when` either `"before"`
or `"after"`, `op` from the table, and `paths` (strings) the entries the operation changes.
A hook that raises aborts the save there (as a failing operation would); a hook that kills the
process is a crash at exactly that point. `hooked(hook)` installs one for a `with` block. Python's
audit hooks (`sys.addaudithook`) would not do: they see neither `os.fsync` nor a ctypes call.
"""

import contextlib
import ctypes
import errno
import fcntl
import functools
import os
import platform
import shutil
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple


Hook = Callable[[str, str, tuple[str, ...]], None]

# Test seam: the kill sweeps (tests/save_children.py, save_faults.py) append hooks here; other
# tests and tests/workers/slow_save.py add them with `hooked`.
HOOKS: list[Hook] = []
"""Called before and after every operation of this module: `hook(when, op, paths)`, with `op`
one of mkdir, create, write, chmod, fsync, copy, symlink, fsync_dir, rename, exchange, unlink,
remove."""


@contextlib.contextmanager
def hooked(hook: Hook) -> Iterator[None]:
    """Calls `hook` before and after every operation within the block."""
    HOOKS.append(hook)
    try:
        yield
    finally:
        HOOKS.remove(hook)


def _notify(when: str, op: str, *paths: Any) -> None:
    for hook in list(HOOKS):
        hook(when, op, tuple(os.fspath(p) for p in paths))


@contextlib.contextmanager
def _step(op: str, *paths: Any) -> Iterator[None]:
    _notify("before", op, *paths)
    yield
    _notify("after", op, *paths)


def path_argument(path: object, argument: str = "path") -> str:
    """The text of a path argument given by the user (`str` or `os.PathLike`).

    Anything else (`bytes` above all) is refused with a message saying what to pass, rather
    than failing deep inside `pathlib` with a bare `TypeError`.
    """
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    if isinstance(text, str):
        return text
    got = f"{type(path).__name__} {_short(path)}"
    if text is not path:
        got += f", whose path is {type(text).__name__} {_short(text)}"
    raise TypeError(
        f"`{argument}` must be a `str` or an `os.PathLike` such as `pathlib.Path`; got {got}. "
        "(For a bytes path, pass `os.fsdecode(path)`.) Nothing was written."
    )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:150] + "...(cut)"


# --- directories --------------------------------------------------------------------------------


def mkdir(path: Path, mode: int) -> None:
    """Creates the directory `path` with `mode` (less the umask, as `mkdir(2)` does)."""
    with _step("mkdir", path):
        os.mkdir(path, mode)


def chmod(path: Path, mode: int) -> None:
    """Sets the permission bits of the directory `path` (never a symbolic link)."""
    with _step("chmod", path):
        os.chmod(path, mode)


def fsync_dir(path: Path) -> None:
    """Flushes the entries of the directory `path` (a rename or creation in it) to its device."""
    with _step("fsync_dir", path):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def symlink(target: str, path: Path) -> None:
    """Creates the symbolic link `path` whose text is `target`."""
    with _step("symlink", path):
        os.symlink(target, path)


def _make_removable(path: Path) -> None:
    """Gives the owner full access to every directory under `path`, so that it can be deleted.

    A directory without write permission cannot have its entries removed, even by its owner.
    """
    if path.is_symlink() or not path.is_dir():
        return
    for root, dirs, _ in os.walk(path):
        for directory in [root, *(os.path.join(root, d) for d in dirs)]:
            try:
                info = os.lstat(directory)
                if stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_IRWXU != stat.S_IRWXU:
                    os.chmod(directory, stat.S_IMODE(info.st_mode) | stat.S_IRWXU)
            except FileNotFoundError:  # deleted meanwhile, see `remove`
                continue


def _unless_gone(function: Any, path: str, error: Any) -> None:
    if not isinstance(error, FileNotFoundError):
        raise error


def remove(path: Path) -> None:
    """Deletes the directory tree `path` (read-only directories in it included).

    Entries that vanish meanwhile are no error: a save and `remove_leftovers` may both be
    deleting one old checkpoint, the save when it could not lock it.
    """
    with _step("remove", path):
        _make_removable(path)
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=_unless_gone)
        else:
            shutil.rmtree(path, onerror=lambda f, p, info: _unless_gone(f, p, info[1]))


def unlink(path: Path) -> None:
    """Deletes the file or symbolic link `path` (never what a link points to)."""
    with _step("unlink", path):
        os.unlink(path)


def lock(path: Path, *, shared: bool = False) -> int | None:
    """Takes a `flock` on the directory `path` without waiting.

    A save holds a shared one on each directory it will delete or swap in, from the moment it
    makes or finds it to the save's end; several saves can hold the same directory. A probe
    for dead saves' leftovers (`leftovers.unlocked`, `eqx_lean.remove_leftovers`) takes an
    exclusive one, which no directory a running save holds grants.

    **Arguments:**

    - `path`: the directory.
    - `shared`: a shared lock (a save's) instead of an exclusive one (a probe's).

    **Returns:**

    The open descriptor holding the lock (closing it releases the lock), or `None` when a lock
    of another open file description conflicts, or `path` is missing or no directory (a link
    is not followed).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        if error.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    # The name may have been removed, or given to another directory, while we opened it.
    try:
        current = os.lstat(path)
    except FileNotFoundError:
        current = None
    opened = os.fstat(fd)
    if current is None or (current.st_dev, current.st_ino) != (opened.st_dev, opened.st_ino):
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def swapping_in(parent: Path) -> Iterator[None]:
    """Holds an exclusive `flock` on the directory `parent` for the block, waiting for it.

    Saves of checkpoints in `parent` hold it while they check what they will swap out and swap,
    so no other save's swap comes between the two. The block takes microseconds. Where
    `parent` cannot be opened (a directory this user may write to but not read), the block
    runs without it.
    """
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


# --- files --------------------------------------------------------------------------------------

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


def write_file(path: Path, chunks: Iterable[Any], mode: int | None = None) -> None:
    """Creates the new file `path`, writes `chunks` (buffers) into it and flushes it to disk.

    **Arguments:**

    - `path`: a file that must not exist yet.
    - `chunks`: buffers (`bytes`, contiguous numpy arrays, ...), each one `write` step; a
        generator may compute each when it is needed.
    - `mode`: its permission bits; `None` means what any new file gets, `0o666` less the umask.
    """
    with _step("create", path):
        fd = os.open(path, _NEW_FILE, 0o666)
    try:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            with _step("write", path):
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
        if mode is not None:
            with _step("chmod", path):
                os.fchmod(fd, mode)
        with _step("fsync", path):
            os.fsync(fd)
    finally:
        os.close(fd)


FICLONE = 0x40049409  # _IOW(0x94, 9, int): Linux's reflink ioctl (Btrfs, XFS, bcachefs, ...)


def _copy_data(source: int, target: int) -> str:
    """Copies an open file's content into another; returns how (`reflink`, `kernel`, `read`)."""
    try:
        # Test seam: tests/test_fs.py makes `fcntl.ioctl` and `os.copy_file_range` fail (and
        # removes the latter) to take the plain read.
        fcntl.ioctl(target, FICLONE, source)
        return "reflink"
    except OSError:
        pass  # not supported here (ext4, tmpfs, across filesystems): copy instead
    copied = 0
    if hasattr(os, "copy_file_range"):
        try:
            # In the kernel, without a round trip through user memory; some filesystems (NFS,
            # XFS, Btrfs) share extents here too.
            while count := os.copy_file_range(source, target, 1 << 30):
                copied += count
            return "kernel"
        except OSError as e:
            if copied or e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
    while data := os.read(source, 1 << 24):
        view = memoryview(data)
        while view:
            view = view[os.write(target, view) :]
    return "read"


class Copied(NamedTuple):
    how: str  # "reflink", "kernel" (`copy_file_range`) or "read"
    source: os.stat_result | None  # `source` as copied; None if it changed while being copied


def _unchanged(before: os.stat_result, after: os.stat_result) -> bool:
    keys = ("st_ino", "st_size", "st_mtime_ns", "st_ctime_ns")
    return all(getattr(before, k) == getattr(after, k) for k in keys)


def copy_file(source: Path, path: Path, mode: int | Literal["source", "new"] = "source") -> Copied:
    """Copies the regular file `source` (links followed) to the new file `path`, and flushes it.

    The copy never shares storage that a later write could change through (no hard link, no
    symbolic link): a reflink, where the filesystem offers one, is copy-on-write.

    **Arguments:**

    - `source`: the file to copy; a symbolic link is followed.
    - `path`: a file that must not exist yet.
    - `mode`: its permission bits: `"source"` keeps `source`'s, `"new"` gives what any new file
        gets (`0o666` less the umask), or the bits themselves. Access and modification times
        are kept.

    **Returns:**

    A `Copied`: how the content was copied, `"reflink"`, `"kernel"` (`copy_file_range`) or
    `"read"`, and the `fstat` of `source` taken before copying, or `None` if `fstat` differs
    after copying (another process wrote to it meanwhile: the copy may be torn).
    """
    # Non-blocking, so that a FIFO put here meanwhile is refused below rather than waited on.
    source_fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        info = os.fstat(source_fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{source} must be a regular file to be copied into a checkpoint.")
        with _step("copy", path):
            # Readable by this user alone until its mode is set, unless it gets a new file's.
            fd = os.open(path, _NEW_FILE, 0o666 if mode == "new" else 0o600)
            try:
                how = _copy_data(source_fd, fd)
                if mode != "new":
                    os.fchmod(fd, stat.S_IMODE(info.st_mode) if mode == "source" else mode)
                os.utime(fd, ns=(info.st_atime_ns, info.st_mtime_ns))
            except BaseException:
                os.close(fd)
                raise
        settled = _unchanged(info, os.fstat(source_fd))
        try:
            with _step("fsync", path):
                os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        os.close(source_fd)
    return Copied(how, info if settled else None)


# --- renames ------------------------------------------------------------------------------------

_AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
# `renameat2`'s system call number, for a C library without the wrapper (glibc < 2.28).
_SYSCALL_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "riscv64": 276, "ppc64le": 357, "s390x": 347}


# Test seam: tests/test_fs.py, test_io_leftovers.py and save_faults.py replace it with
# `lambda: None` (no exchange here); tests/test_fs.py gives it an old libc through `ctypes.CDLL`.
@functools.cache
def _renameat2() -> Callable[[bytes, bytes, int], int] | None:
    """Linux's `renameat2(AT_FDCWD, a, AT_FDCWD, b, flags)` through ctypes; `None` elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    wrapper = getattr(libc, "renameat2", None)
    if wrapper is not None:
        wrapper.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
        wrapper.argtypes += [ctypes.c_uint]
        wrapper.restype = ctypes.c_int
        return lambda a, b, flags: wrapper(_AT_FDCWD, a, _AT_FDCWD, b, flags)
    number = _SYSCALL_RENAMEAT2.get(platform.machine())
    syscall = getattr(libc, "syscall", None)
    if number is None or syscall is None:
        return None
    syscall.restype = ctypes.c_long
    return lambda a, b, flags: syscall(
        ctypes.c_long(number),
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(a),
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(b),
        ctypes.c_uint(flags),
    )


def _rename2(a: Path, b: Path, flags: int) -> bool:
    """`renameat2` with `flags`; False where the system or filesystem does not support them."""
    call = _renameat2()
    if call is None:
        return False
    if call(os.fsencode(a), os.fsencode(b), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False  # an old kernel, or a filesystem without these flags
    raise OSError(code, os.strerror(code), os.fspath(a), None, os.fspath(b))


def exchange(a: Path, b: Path) -> bool:
    """Swaps the directories `a` and `b` in one atomic step.

    **Returns:**

    True once swapped; False (having changed nothing) where the system or the filesystem
    cannot swap atomically (not Linux, a kernel before 3.15, some network filesystems). The
    `before` hook is called either way, the `after` hook only once swapped.
    """
    _notify("before", "exchange", a, b)
    if not _rename2(a, b, RENAME_EXCHANGE):
        return False
    _notify("after", "exchange", a, b)
    return True


def rename(a: Path, b: Path) -> None:
    """Renames `a` to `b`, failing with `FileExistsError` if `b` exists (atomically where
    `renameat2(RENAME_NOREPLACE)` is supported, else checked just before)."""
    with _step("rename", a, b):
        if not _rename2(a, b, RENAME_NOREPLACE):
            if os.path.lexists(b):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(b))
            os.rename(a, b)
