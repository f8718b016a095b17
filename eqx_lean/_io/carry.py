"""Carrying over: the entries of an existing destination a save copies into its new directory.

A save lists its destination before any work (`list_destination`, through `directory.plan`,
which refuses what it cannot carry), copies what it carries once its own files are written,
then lists the destination again just before the swap and brings its copy up to date
(`Carrier.update`), again and again until a listing finds nothing new: what another process
writes into the destination while the save runs (a trainer's `trainer_state.json`) is in the
new checkpoint.

What a listing does with each entry of the destination:

- a top-level name the save **owns** (see `owned`) is skipped, but only as a regular file or a
  link to one: any other kind of entry there would be deleted with the old checkpoint, so it
  is refused;
- any other **weight file** (`is_weight_file`: another `*.safetensors`, a pickle, an index of
  other weights, ...), here or in a subdirectory, is refused, copied or left out, as
  `other_weights` says: dropping it would lose it and copying it would duplicate it;
- **everything else** (tokenizer, generation config, README, subdirectories) is carried over:
  each file is copied (a reflink where the filesystem offers one), never linked, so that
  nothing outside the destination can change; a symbolic link to a file is copied as the file
  it points to; a link to a directory, or one that points nowhere, is recreated as the same
  link.
"""

import errno
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, NamedTuple

from . import fs
from .owned import Owner, describe_kind
from .safetensors import INDEX_SUFFIX


OtherWeights = Literal["refuse", "keep", "drop"]

# Files that hold weights or pickled state (and indexes of such files): never carried over
# silently. Pickles are never read by eqx_lean, only copied or dropped when asked.
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".pkl",
    ".pickle",
    ".gguf",
    ".ggml",
    ".h5",
    ".msgpack",
    ".npy",
    ".npz",
    ".onnx",
)


def is_weight_file(name: str) -> bool:
    """Whether a file of this name holds weights (or indexes them) by its suffix."""
    return name.lower().removesuffix(INDEX_SUFFIX).endswith(WEIGHT_SUFFIXES)


class Entry(NamedTuple):
    """One entry a save carries over."""

    relative: str  # inside the destination, "/"-separated
    kind: Literal["dir", "file", "link"]
    mode: int  # permission bits (of the directory, or of the file copied)
    link: str = ""  # the text of a link recreated as it is
    # The file copied as (device, inode, size, mtime): a change of any means new content. Empty
    # for a copy taken while the file changed, which is never up to date.
    version: tuple[int, ...] = ()


def _version(info: os.stat_result) -> tuple[int, ...]:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


class Listing(NamedTuple):
    """What a save does with each entry of an existing destination, as one listing found it."""

    mode: int  # the destination's permission bits
    carried: dict[str, Entry]  # by relative path; each directory before its contents
    owned_modes: dict[str, int]  # permission bits of the owned regular files, by name
    misowned: list[str]  # entries under an owned name that are not regular files
    others: list[str]  # weight files not owned, with `other_weights="refuse"`
    problems: list[str]  # entries the save must copy or delete but cannot


def list_destination(
    destination: Path, owns: Owner, other_weights: OtherWeights, mounts: set[str]
) -> Listing | None:
    """Lists the directory `destination` (links resolved), or returns `None` if it is missing.

    **Arguments:**

    - `destination`: the directory a save replaces.
    - `owns`: the save's `owned.Owner`.
    - `other_weights`: as for `save_stacked`.
    - `mounts`: the mount points (`directory._mount_points()`), never carried.
    """
    try:
        destination_info = os.stat(destination)
    except (FileNotFoundError, NotADirectoryError):
        return None
    listing = Listing(stat.S_IMODE(destination_info.st_mode), {}, {}, [], [], [])

    def add(entry: Entry) -> None:
        listing.carried[entry.relative] = entry

    def scan(directory: Path, prefix: str) -> None:
        for dir_entry in sorted(os.scandir(directory), key=lambda e: e.name):
            try:
                classify(dir_entry, prefix)
            except (FileNotFoundError, NotADirectoryError):
                if os.path.lexists(dir_entry.path):
                    raise
                # Deleted (or renamed) while being listed: it is not in this listing.

    def classify(dir_entry: os.DirEntry, prefix: str) -> None:
        relative = prefix + dir_entry.name
        source = Path(dir_entry.path)
        info = dir_entry.stat(follow_symlinks=False)
        owner = None if prefix else owns(dir_entry.name)
        if owner is not None:
            _check_owned(source, info, owner, listing)
            return
        if stat.S_ISLNK(info.st_mode):
            try:
                info = os.stat(source)
            except OSError:  # points nowhere (or in a loop): nothing to copy
                add(Entry(relative, "link", 0, os.readlink(source)))
                return
            if stat.S_ISDIR(info.st_mode):  # outside data, maybe large: keep the link
                add(Entry(relative, "link", 0, os.readlink(source)))
                return
        mode = stat.S_IMODE(info.st_mode)
        if stat.S_ISDIR(info.st_mode):
            if info.st_dev != destination_info.st_dev or os.fspath(source) in mounts:
                # Its files would be copied, then deleted with the old checkpoint.
                listing.problems.append(f"{relative}/ (a mount point, another filesystem's data)")
            elif _denied(source, os.R_OK | os.X_OK) or (
                _denied(source, os.W_OK) and info.st_uid != os.geteuid()
            ):
                listing.problems.append(f"{relative}/ (a directory this user cannot read or clear)")
            else:
                add(Entry(relative, "dir", mode))
                scan(source, relative + "/")
        elif stat.S_ISREG(info.st_mode):
            if is_weight_file(dir_entry.name) and other_weights != "keep":
                if other_weights == "refuse":
                    listing.others.append(relative)
            elif _denied(source, os.R_OK):
                listing.problems.append(f"{relative} (a file this user cannot read)")
            else:
                add(Entry(relative, "file", mode, version=_version(info)))
        else:
            listing.problems.append(f"{relative} (neither a file, a directory nor a link)")

    try:
        scan(destination, "")
    except (FileNotFoundError, NotADirectoryError):  # the whole destination went away meanwhile
        if not os.path.isdir(destination):
            return None
        raise
    return listing


def _denied(path: Path, mode: int) -> bool:
    """Whether this user lacks `mode` access to `path` (not merely: `path` is gone)."""
    if os.access(path, mode):
        return False
    if not os.path.lexists(path):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(path))
    return True


def _check_owned(source: Path, info: os.stat_result, owner: str, listing: Listing) -> None:
    """Keeps the mode of an owned regular file; notes an owned name held by anything else."""
    if stat.S_ISREG(info.st_mode):  # keep its mode for the new file
        listing.owned_modes[source.name] = stat.S_IMODE(info.st_mode)
        return
    what = describe_kind(info.st_mode)
    if stat.S_ISLNK(info.st_mode):
        try:
            followed = os.stat(source).st_mode
        except OSError:
            what = "a symbolic link that points nowhere"
        else:
            if stat.S_ISREG(followed):
                return  # the link is dropped, the file it points to is left alone
            what = f"a symbolic link to {describe_kind(followed)}"
    listing.misowned.append(f"{source.name!r} ({what}), the name of {owner}")


def refuse(destination: Path, listing: Listing, stage: str) -> None:
    """Raises if `listing` holds anything the save must not drop, copy or delete.

    **Arguments:**

    - `destination`: the directory listed.
    - `listing`: from `list_destination`.
    - `stage`: how the message ends: "Nothing was written." before any work, or what became
        of the save during it.
    """
    if listing.misowned:
        raise ValueError(
            f"{destination} holds {_listed(listing.misowned)}. A save writes its own regular file "
            "under that name and deletes the old entry with the old checkpoint, so it would "
            "delete this one and all it holds. An entry under a name the save writes must be a "
            "regular file (or a symbolic link to one): move or rename it, or give the save "
            "another name. " + stage
        )
    if listing.others:
        raise ValueError(
            f"{destination} holds weight files that this save does not own: "
            f"{_listed([repr(o) for o in listing.others])}. A save replaces the whole "
            "directory, so it would either lose them or copy them. Pass "
            '`other_weights="keep"` to copy them into the new checkpoint, or '
            '`other_weights="drop"` to leave them out (they are deleted with the old '
            "checkpoint). " + stage
        )
    if listing.problems:
        raise PermissionError(
            errno.EACCES,
            f"a save of {destination} must copy (or later delete) every entry it does not own, but "
            f"cannot: {'; '.join(listing.problems[:5])}. Fix or move them. "
            + stage.removesuffix("."),
            os.fspath(destination),
        )


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - 5} more" if len(items) > 5 else ""
    return ", ".join(items[:5]) + more


class Carrier:
    """The copy, in a save's new directory, of the entries it carries over from the destination.

    **Arguments:**

    - `source`: the destination, which the entries are copied from.
    - `new`: the save's new directory.
    """

    def __init__(self, source: Path, new: Path):
        self.source = source
        self.new = new
        self.held: dict[str, Entry] = {}  # what `new` holds, as copied
        self.finished = False

    def update(self, carried: Mapping[str, Entry]) -> list[str]:
        """Makes the copy match a listing's `carried` entries: copies what is new or changed
        (by kind, inode, size, mtime or mode), deletes what the destination no longer holds.

        **Returns:**

        The relative paths it changed (none once the copy is up to date).
        """
        self._reopen()
        changed = []
        for relative in sorted(set(self.held) - set(carried), reverse=True):  # contents first
            if relative in self.held:
                self._drop(relative)
                changed.append(relative)
        for relative, entry in carried.items():
            held = self.held.get(relative)
            if held is not None and _same(held, entry):
                self.held[relative] = held._replace(mode=entry.mode)  # a directory's, set last
                continue
            if held is not None:
                self._drop(relative)
            self._copy(entry)
            changed.append(relative)
        return changed

    def _copy(self, entry: Entry) -> None:
        copy = self.new / entry.relative
        if entry.kind == "dir":
            fs.mkdir(copy, 0o700)  # its mode is set once it is complete
        elif entry.kind == "link":
            fs.symlink(entry.link, copy)
        else:
            source = self.source / entry.relative
            try:
                copied = fs.copy_file(source, copy)
            except (FileNotFoundError, ValueError):
                if _is_file(source):
                    raise
                return  # deleted or replaced since it was listed: the next listing says so
            if copied.source is None:  # written to while copied: never up to date
                entry = entry._replace(version=())
            else:
                mode = stat.S_IMODE(copied.source.st_mode)
                entry = entry._replace(mode=mode, version=_version(copied.source))
        self.held[entry.relative] = entry

    def _drop(self, relative: str) -> None:
        """Deletes an entry of the copy (a directory with its contents)."""
        entry = self.held.pop(relative)
        if entry.kind == "dir":
            fs.remove(self.new / relative)
            for inside in [r for r in self.held if r.startswith(relative + "/")]:
                del self.held[inside]
        else:
            fs.unlink(self.new / relative)

    def finish(self, mode: int | None) -> None:
        """Gives every directory its mode (the new directory itself `mode`, unless `None`) and
        flushes them, each after its contents."""
        for entry in reversed(self.held.values()):
            if entry.kind == "dir":
                fs.chmod(self.new / entry.relative, entry.mode)
                fs.fsync_dir(self.new / entry.relative)
        if mode is not None:
            fs.chmod(self.new, mode)
        fs.fsync_dir(self.new)
        self.finished = True

    def _reopen(self) -> None:
        """Gives the owner access again to the directories `finish` closed (a `0555` one)."""
        if not self.finished:
            return
        directories = [self.new / e.relative for e in self.held.values() if e.kind == "dir"]
        for path in [self.new, *directories]:
            mode = stat.S_IMODE(os.lstat(path).st_mode)
            if mode & stat.S_IRWXU != stat.S_IRWXU:
                fs.chmod(path, mode | stat.S_IRWXU)
        self.finished = False


def _is_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _same(held: Entry, listed: Entry) -> bool:
    if held.kind != listed.kind:
        return False
    if held.kind == "link":
        return held.link == listed.link
    if held.kind == "file":
        return bool(held.version) and (held.version, held.mode) == (listed.version, listed.mode)
    return True  # a directory: its contents are entries of their own
