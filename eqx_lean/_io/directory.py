"""A checkpoint directory as one unit: built complete beside its destination, flushed, swapped in.

A save never changes a file of the old checkpoint: it writes a new directory
`.<name>.tmp-<token>` beside the destination (`leftovers`), fills it with its own files
(`owned`), then with copies of everything else the destination holds (`carry`), lists the
destination again until its copy is up to date, flushes it, and swaps it with the destination
in one atomic step (`renameat2(RENAME_EXCHANGE)`); only then does it delete the old checkpoint,
which the swap has moved to the temporary name. Every change goes through `eqx_lean._io.fs`.

Two saves may race: each swaps its own complete directory in, and the last swap wins. When the
destination did not exist when a save began but does when it swaps (another first save got
there first), the save treats it as any existing destination: it carries over what that
directory holds beyond the names it owns, and exchanges with it, so the outcome is that of the
two saves run one after the other.
"""

import contextlib
import errno
import os
import stat
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

from . import carry, fs, leftovers
from .carry import OtherWeights
from .owned import Owner


# Listings of the destination after its first copy, at most, before a save swaps: each copies
# what appeared or changed since the last one. A file appended to without pause never settles.
RELISTS = 5
# Swaps tried, at most, when the destination is made, replaced or deleted just before one. Each
# try lost means another process changed the destination meanwhile (another save swapped, say),
# so saves as a whole go on; a save racing more than this many others fails, saying so.
SWAP_TRIES = 8
# Seconds a save waits, at most, for an exclusive lock on the directory it will swap out to go
# (a leftover probe's, held a moment) before it goes on without its own.
LOCK_WAIT = 5.0


def _warn(message: str) -> None:
    """Warns, pointing at the first caller outside eqx_lean (the user's save call)."""
    package = os.path.dirname(os.path.dirname(__file__)) + os.sep
    level, frame = 1, sys._getframe(0)
    while frame is not None and frame.f_code.co_filename.startswith(package):
        level += 1
        frame = frame.f_back
    warnings.warn(message, UserWarning, stacklevel=level)


# --- the destination ----------------------------------------------------------------------------


# Test seam: tests/test_io_save.py adds mount points to it.
def _mount_points() -> set[str]:
    """The mount points listed in `/proc/self/mountinfo` (bind mounts included)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    points = set()
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4:  # mountinfo escapes space, tab, newline and backslash as octal
            points.add(fields[4].encode("latin-1", "surrogateescape").decode("unicode_escape"))
    return points


def is_mount_point(path: Path) -> bool:
    return os.path.ismount(path) or os.fspath(path) in _mount_points()


def _refuse(path: object, reason: str) -> ValueError:
    return ValueError(
        f"`path` must be a checkpoint directory that a save can replace, but {path!r} {reason} "
        "Nothing was written."
    )


def resolve_destination(path: str | os.PathLike) -> tuple[Path, os.stat_result | None]:
    """The directory a save replaces (a symbolic link is followed; the link itself is kept),
    and its `stat`; refuses, before any work, a directory that cannot be replaced."""
    given = fs.path_argument(path)
    if given in ("", "."):
        raise _refuse(
            given,
            "is the current working directory, which a save cannot replace (it replaces the "
            "whole directory). Name the checkpoint directory, such as 'checkpoint'.",
        )
    if os.path.islink(given) and not os.path.exists(given):
        raise _refuse(
            given,
            f"is a symbolic link to {os.readlink(given)!r}, which does not exist. Create that "
            "directory or remove the link.",
        )
    destination = Path(os.path.realpath(given))
    if destination.parent == destination or is_mount_point(destination):
        raise _refuse(
            given,
            f"is {destination}, a mount point: it cannot be replaced by another directory. Save "
            "into a directory inside it.",
        )
    cwd = Path(os.getcwd())
    if destination == cwd or destination in cwd.parents:
        raise _refuse(
            given,
            f"is {destination}, which holds the current working directory, so it cannot be "
            "replaced. Change directory first or save elsewhere.",
        )
    try:
        info = os.stat(destination)
    except (FileNotFoundError, NotADirectoryError):
        info = None
    if info is not None and not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"`path` must be a directory (or not exist yet); {given} is a file.")
    if info is not None:
        mode = stat.S_IMODE(info.st_mode)
        if not mode & stat.S_IWUSR:
            raise PermissionError(
                errno.EACCES,
                f"`path` must be a writable directory, but {given} has no owner write "
                f"permission (mode {mode:04o}), which marks it as protected: a save would delete "
                "its files. Make it writable (`chmod u+w`) to replace it. Nothing was written",
                given,
            )
        if not os.access(destination, os.R_OK | os.W_OK | os.X_OK):
            raise PermissionError(
                errno.EACCES,
                f"`path` must be a directory this user can read and write, but {given} (mode "
                f"{mode:04o}, owner uid {info.st_uid}) is not. Nothing was written",
                given,
            )
    ancestor = destination.parent
    while not os.path.lexists(ancestor):
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(
            f"`path` must be a directory (or not exist yet) in a directory, but {ancestor}, on "
            f"the way to {given}, is a file. Nothing was written."
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise PermissionError(
            errno.EACCES,
            f"a save of {given} must create its new directory in {ancestor}, but this user "
            "cannot write there. Nothing was written",
            os.fspath(ancestor),
        )
    return destination, info


class SavePlan(NamedTuple):
    """What `plan` found: the checkpoint directory a save replaces, as it was, and what becomes of
    its entries (carried over, or owned and rewritten with their old modes)."""

    path: Path  # the directory replaced (links resolved)
    identity: tuple[int, int] | None  # its (device, inode) when planned; None if missing
    mode: int  # its permission bits, which the new directory gets
    carried: dict[str, carry.Entry]
    owned_modes: dict[str, int]  # permission bits of the old files the save owns, by name
    owns: Owner
    other_weights: OtherWeights

    @property
    def exists(self) -> bool:
        return self.identity is not None


def plan(path: str | os.PathLike, owns: Owner, other_weights: OtherWeights) -> SavePlan:
    """Checks `path` and sorts the entries of an existing destination into owned, carried over
    and refused (see `carry`), before anything is written; warns about leftovers of saves that
    died.

    **Arguments:**

    - `path`: the checkpoint directory.
    - `owns`: what makes a top-level name one of the save's own files (`owned.owner`).
    - `other_weights`: what to do with weight files it does not own: `"refuse"` (raise, naming
        them), `"keep"` (copy them into the new checkpoint) or `"drop"` (leave them out).

    **Returns:**

    The `SavePlan`.
    """
    if other_weights not in ("refuse", "keep", "drop"):
        raise ValueError(
            f'`other_weights` must be "refuse", "keep" or "drop"; got {other_weights!r}.'
        )
    destination, info = resolve_destination(path)
    listing = None
    if info is not None:
        listing = carry.list_destination(destination, owns, other_weights, _mount_points())
    if listing is not None:
        carry.refuse(destination, listing, "Nothing was written.")
    dead = leftovers.unlocked(destination)
    if dead:
        _warn(
            f"eqx_lean: beside {destination} lie leftovers of saves of it that died (no running "
            f"save holds them): {', '.join(p.name for p in dead)}. They are not the "
            f"checkpoint; `eqx_lean.remove_leftovers({os.fspath(destination)!r})` deletes them, "
            "or renames an old checkpoint back where the directory is missing."
        )
    if info is None or listing is None:
        return SavePlan(destination, None, 0o777, {}, {}, owns, other_weights)
    identity = (info.st_dev, info.st_ino)
    return SavePlan(
        destination,
        identity,
        listing.mode,
        listing.carried,
        listing.owned_modes,
        owns,
        other_weights,
    )


# --- building and swapping ----------------------------------------------------------------------


def _make_parents(destination: Path) -> None:
    missing = []
    parent = destination.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for directory in reversed(missing):
        try:
            fs.mkdir(directory, 0o777)
        except FileExistsError:  # made meanwhile by another save
            continue
        fs.fsync_dir(directory.parent)


def _identity(path: Path | None) -> tuple[int, int] | None:
    if path is None:
        return None
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def replace(planned: SavePlan, write_owned: Callable[[Path, Mapping[str, int]], None]) -> None:
    """Writes the new checkpoint beside `planned.path` and swaps it into place atomically.

    **Arguments:**

    - `planned`: from `plan`.
    - `write_owned`: writes the save's own files into the directory it is given (with
        `fs.write_file` or `fs.copy_file`), each given the mode of the old file of that name
        when the mapping holds one.

    If anything fails before the swap, the partial new directory is deleted and the error gets
    notes saying that `planned.path` still holds the old checkpoint (and where a leftover lies,
    if deleting failed too). Once swapped, the save has succeeded: failing to delete the old
    checkpoint is a warning naming where it lies.
    """
    path = planned.path
    aside = leftovers.leftover_name(path, "old")  # used only without an atomic exchange
    made: list[Path] = []
    new_identity = None
    with contextlib.ExitStack() as locks:  # released once the save ends
        try:
            _make_parents(path)
            mode = 0o700 if planned.exists else 0o777
            new = leftovers.make_locked_dir(path, mode, locks, made)
            new_identity = _identity(new)
            write_owned(new, planned.owned_modes)
            carrier = carry.Carrier(path, new)
            carrier.update(planned.carried)
            old = _swap(planned, carrier, aside, locks)
        except BaseException as error:
            _explain(error, planned, (made[-1] if made else None, new_identity), aside)
            raise
        _after_swap(path, old)


def _settle(planned: SavePlan, carrier: carry.Carrier) -> carry.Listing | None:
    """Lists the destination again and brings the copy up to date, until a listing finds nothing
    new (`RELISTS` listings at most); returns the last listing (`None` if the destination is
    missing).

    A weight file that appears while the save runs is copied even with
    `other_weights="refuse"`: it is too late to ask, and losing it is worse than copying it.
    """
    policy = "keep" if planned.other_weights == "refuse" else planned.other_weights
    changed: list[str] = []
    listing = None
    for _ in range(RELISTS):
        listing = carry.list_destination(planned.path, planned.owns, policy, _mount_points())
        if listing is None:
            return None  # deleted meanwhile: what was copied from it stays in the new one
        carry.refuse(
            planned.path, listing, "It appeared while the save ran, which stopped before the swap."
        )
        changed = carrier.update(listing.carried)
        if not changed:
            return listing
    _warn(
        f"eqx_lean: {', '.join(changed[:5])} in {planned.path} kept changing while the save "
        f"copied them ({RELISTS + 1} copies); the new checkpoint holds the last copy, which a "
        "write under way may have torn."
    )
    return listing


# Test seam: tests/test_io_leftovers.py wraps it to run another save just after the first lock.
def _lock_occupant(path: Path, locks: contextlib.ExitStack) -> tuple[int, int] | None:
    """Takes a shared lock, held until the save ends, on the directory at `path`, so that once
    swapped out it is never taken for a dead save's leftover.

    Other saves may hold it too (shared locks do not exclude each other). Only a probe for
    leftovers (a moment) or a foreign process holds an exclusive one: after `LOCK_WAIT`
    seconds the save goes on without the lock, which costs at most a warning about a leftover
    that is not one.

    **Returns:**

    The identity (device, inode) of the directory it dealt with; `None` if `path` is missing.
    """
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fd = fs.lock(path, shared=True)
        except OSError:
            return _identity(path)
        if fd is not None:  # `fs.lock` checked that `path` still names what it locked
            locks.callback(os.close, fd)
            locked = os.fstat(fd)
            return locked.st_dev, locked.st_ino
        if not os.path.lexists(path):
            return None
        if time.monotonic() > deadline:
            return _identity(path)
        time.sleep(0.005)  # a probe's exclusive lock, or another directory took the name


def _swap(
    planned: SavePlan, carrier: carry.Carrier, aside: Path, locks: contextlib.ExitStack
) -> Path | None:
    """Brings the copy up to date, flushes it and swaps it in; returns where the old
    checkpoint then lies (`None` if there was none).

    It swaps out only the directory it locked before its last listing: if another save
    swapped a directory in (or a first save made one) meanwhile, it locks that one and lists
    again, so it carries over what that one holds, and never leaves a directory it swapped out
    unlocked for a third save to take for a dead save's. The check and the swap happen under
    an exclusive lock on the parent directory, which every save takes for them, so no other
    save's swap comes between the two.
    """
    path, new = planned.path, carrier.new
    for _ in range(SWAP_TRIES):
        occupant = _lock_occupant(path, locks)  # before the last listing, as a wait may be
        listing = _settle(planned, carrier)
        mode = listing.mode if listing is not None else planned.mode if planned.exists else None
        carrier.finish(mode)
        try:
            # Saves in this directory check and swap one at a time: no other save's swap can
            # come between this save's check and its swap.
            with fs.swapping_in(path.parent):
                if _identity(path) != occupant:
                    continue  # replaced, made or deleted since it was locked: again
                if listing is None:
                    fs.rename(new, path)
                    return None
                if fs.exchange(new, path):
                    _hold_swapped_out(new, occupant, locks)
                    return new
                _swap_by_renames(new, path, aside)
                _hold_swapped_out(aside, occupant, locks)
                return aside
        except FileExistsError:
            if listing is not None or not os.path.lexists(path):
                raise
            # Made since the identity check by a process that is no save (saves swap under the
            # parent's lock): lock it, list it, then swap with it (the last swap wins).
        except FileNotFoundError:
            if listing is None or os.path.lexists(path) or os.path.lexists(aside):
                raise
            # Deleted since the identity check (by a process that is no save): rename into
            # place instead.
    raise RuntimeError(
        f"a save of {path} could not swap its new checkpoint in: {SWAP_TRIES} times, another "
        "process created, replaced or deleted it between the save's last listing of it and "
        "its swap."
    )


def _hold_swapped_out(old: Path, occupant: tuple[int, int] | None, locks: contextlib.ExitStack):
    """Locks what the swap moved to `old` if it is not the directory locked before the swap.

    Saves swap one at a time (`fs.swapping_in`), so that happens only when a process that is
    no eqx_lean save replaced the destination between the identity check and the swap (or where
    the parent directory could not be locked). Locking it at once keeps the window in which it
    lies unlocked at `old` to that of two system calls.
    """
    if _identity(old) != occupant:
        _lock_occupant(old, locks)


def _explain(
    error: BaseException,
    planned: SavePlan,
    built: tuple[Path | None, tuple[int, int] | None],
    aside: Path,
) -> None:
    """Adds to `error` what became of the old and the new checkpoint (`built`: the new
    directory and its identity, once made)."""
    path = planned.path
    new, new_identity = built
    now = _identity(path)
    if new is not None and now is not None and now == new_identity:
        # Swapped, then failed (in a hook).
        old = aside if aside.exists() else new if new.exists() else None
        where = f"; the old one lies in {old}, which is safe to delete" if old else ""
        error.add_note(f"eqx_lean: the new checkpoint is in place in {path}{where}.")
    elif now is None and aside.exists():
        error.add_note(
            f"eqx_lean: {path} is missing: the old checkpoint lies in {aside}; rename it back "
            f"to {path} (`eqx_lean.remove_leftovers` does). The new one lies in {new}."
        )
    else:
        _failed_before_swap(error, planned, new)


def _failed_before_swap(error: BaseException, planned: SavePlan, new: Path | None) -> None:
    """Deletes the partial new checkpoint, and adds to `error` what became of everything."""
    now = _identity(planned.path)
    if planned.exists and now == planned.identity:
        state = f"{planned.path} still holds the old checkpoint, unchanged."
    elif not planned.exists and now is None:
        state = f"{planned.path} did not exist before, and the save put nothing there."
    else:
        state = f"{planned.path} holds what another process put there; this save changed nothing."
    error.add_note(f"eqx_lean: the save failed before the new checkpoint was in place: {state}")
    if new is None or not new.exists():
        return
    try:
        fs.remove(new)
        error.add_note(f"The partial new checkpoint ({new}) was deleted.")
    except BaseException as cleanup_error:  # e.g. the filesystem went read-only
        error.add_note(
            f"The partial new checkpoint lies in {new} ({cleanup_error!r}): it is not the "
            "checkpoint and nothing reads it, so it is safe to delete now."
        )


def _swap_by_renames(new: Path, path: Path, aside: Path) -> None:
    """Replaces `path` by `new` with two renames, where no atomic exchange exists.

    Between the two, `path` does not exist and the old checkpoint is `aside`. If the second
    rename fails, the first is undone.
    """
    fs.rename(path, aside)
    try:
        fs.rename(new, path)
    except BaseException:
        if _identity(path) is None:
            try:
                fs.rename(aside, path)
            except BaseException:
                pass  # the caller's note says where the old checkpoint lies
        raise


def _after_swap(path: Path, old: Path | None) -> None:
    try:
        fs.fsync_dir(path.parent)
        if old is not None:
            fs.remove(old)
    except Exception as error:
        where = ""
        if old is not None and os.path.lexists(old):
            where = f" The old checkpoint lies in {old}: delete it, nothing reads it."
        _warn(
            f"eqx_lean: the new checkpoint is in place in {path}, but finishing the save "
            f"failed ({error!r}).{where}"
        )
    except BaseException as error:
        where = ""
        if old is not None and os.path.lexists(old):
            where = f" The old one lies in {old}, which is safe to delete."
        error.add_note(f"eqx_lean: the new checkpoint is in place in {path}.{where}")
        raise
