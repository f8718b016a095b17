"""What saves leave beside their destination, how a live save's is told from a dead one's, and
`remove_leftovers`.

A save builds its new checkpoint in `.<name>.tmp-<token>` beside the destination `<name>` and, where
no atomic exchange exists, moves the old one aside to `.<name>.old-<token>` for a moment. It
holds a shared `flock` on its new directory from its creation to the save's end (and on the
old one from before its last listing of it), so a leftover on which an exclusive lock is granted
was left by a save that died. The kernel releases the locks of a killed process.
"""

import os
import re
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

from . import fs


_TOKEN = re.compile(r"(?P<kind>tmp|old)-[0-9a-f]{8}")


def _prefix(destination: Path) -> str:
    # A file name is at most 255 bytes; keep room for the prefix and the token.
    return f".{destination.name[:200]}."


def leftover_name(destination: Path, kind: str) -> Path:
    """A fresh `.<name>.<kind>-<token>` beside `destination` (`kind` is "tmp" or "old")."""
    token = os.urandom(4).hex()
    return destination.parent / f"{_prefix(destination)}{kind}-{token}"


def leftovers_of(destination: Path) -> list[Path]:
    """The directories beside `destination` named as its saves' leftovers, live saves' included."""
    prefix = _prefix(destination)
    try:
        entries = os.scandir(destination.parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    with entries:
        return sorted(
            Path(e.path)
            for e in entries
            if e.name.startswith(prefix)
            and _TOKEN.fullmatch(e.name[len(prefix) :])
            and e.is_dir(follow_symlinks=False)
        )


def make_locked_dir(destination: Path, mode: int, locks: ExitStack, made: list[Path]) -> Path:
    """Creates a save's new directory `.<name>.tmp-<token>` beside `destination`, with `mode`, and
    locks it until `locks` closes; appends each name to `made` before creating it (so that the
    caller can delete it if this fails)."""
    for _ in range(3):
        made.append(leftover_name(destination, "tmp"))
        fs.mkdir(made[-1], mode)
        fd = fs.lock(made[-1], shared=True)
        if fd is not None:
            locks.callback(os.close, fd)
            return made[-1]
        # Another process locked it between its creation and our lock: `remove_leftovers`,
        # which deletes it, or another save probing for dead saves' leftovers. Nothing is in
        # it yet: delete it (whichever of us comes second finds it gone) and start again.
        fs.remove(made.pop())
    raise RuntimeError(
        f"a save of {destination} could not lock its new directory beside it: three times, another "
        "process (`eqx_lean.remove_leftovers`?) took it first. Nothing was written."
    )


def unlocked(destination: Path) -> list[Path]:
    """The leftovers of `destination`'s saves that no process holds: left by saves that died.

    Empty ones are passed over: a save creates its directory empty and locks it at once, and
    taking the lock in between would make it start again; a dead save's empty one costs
    nothing (and `remove_leftovers` deletes it).
    """
    found = []
    for leftover in leftovers_of(destination):
        try:
            with os.scandir(leftover) as entries:
                if next(entries, None) is None:
                    continue
            fd = fs.lock(leftover)
        except OSError:  # say, another user's, unreadable: this save cannot tell; it is no error
            continue
        if fd is not None:
            os.close(fd)
            found.append(leftover)
    return found


class Leftovers(NamedTuple):
    """What [`eqx_lean.remove_leftovers`][] did."""

    removed: list[Path]
    """The leftover directories it deleted."""
    restored: Path | None
    """The `.<name>.old-<token>` directory it renamed back to `path`, if any."""
    skipped_locked: list[Path]
    """Leftovers it left alone because a running save holds them."""


def remove_leftovers(path: str | os.PathLike) -> Leftovers:
    """Deletes what killed saves of `path` left beside it, and restores the old checkpoint if a
    save died while it lay aside.

    A save builds the new checkpoint in `.<name>.tmp-<token>` beside `path` and holds a lock
    on it until it ends; a save killed meanwhile leaves it behind (and, where no atomic
    exchange exists, may leave the old checkpoint in `.<name>.old-<token>` with `path`
    missing). A save that finds such leftovers warns, naming this function.

    - A `.<name>.tmp-*` directory is deleted if no running save holds it (the lock is tried
      without waiting): it is never the checkpoint at `path`.
    - A `.<name>.old-*` directory is renamed back to `path` if `path` is missing (it is then
      the only copy of the old checkpoint; with several, the one moved aside last), and is
      deleted otherwise.
    - Leftovers a running save holds are left alone, and listed in `skipped_locked`.

    It is safe to call while saves to `path` run. A symbolic link `path` is followed, as a save
    follows it.

    **Arguments:**

    - `path`: the checkpoint directory (a `str` or `os.PathLike`), as given to
        [`eqx_lean.save_stacked`][]. It need not exist.

    **Returns:**

    A `Leftovers` named tuple: `removed` (a list of the `Path`s deleted), `restored` (the
    `Path` of the directory renamed back to `path`, or `None`) and `skipped_locked` (a list
    of the `Path`s held by running saves).
    """
    destination = Path(os.path.realpath(fs.path_argument(path)))
    removed: list[Path] = []
    skipped: list[Path] = []
    restored: Path | None = None
    found = leftovers_of(destination)
    olds = [p for p in found if p.name[len(_prefix(destination)) :].startswith("old-")]
    tmps = [p for p in found if p not in olds]
    olds.sort(key=_moved_at, reverse=True)  # the last one moved aside first
    for leftover in tmps + olds:
        fd = fs.lock(leftover)
        if fd is None:
            if os.path.lexists(leftover):  # else deleted meanwhile, by another cleaner
                skipped.append(leftover)
            continue
        try:
            if leftover in olds and restored is None and not os.path.lexists(destination):
                try:
                    fs.rename(leftover, destination)
                    restored = leftover
                    continue
                except FileExistsError:
                    pass  # a save made `path` meanwhile: this is an older checkpoint
            fs.remove(leftover)
            removed.append(leftover)
        finally:
            os.close(fd)
    return Leftovers(removed, restored, skipped)


def _moved_at(path: Path) -> int:
    try:
        return os.lstat(path).st_ctime_ns  # a rename sets it
    except FileNotFoundError:
        return 0
