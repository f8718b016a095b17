"""A checkpoint directory as one unit: built complete beside its target, flushed, swapped in.

A save never changes a file of the old checkpoint: it writes a new directory
`.<name>.tmp-<token>` beside the target, fills it (its own files, then copies of the files it
carries over), flushes it, and swaps it with the target in one atomic step
(`renameat2(RENAME_EXCHANGE)`); only then does it delete the old checkpoint, which the swap has
moved to the temporary name. Every change goes through `eqx_lean._io.fs`.

What a save does with each entry of an existing target (`plan`):

- it **owns** its weight files (`weights_name`, its shards `<stem>-0000k-of-0000n.safetensors`
  and its index `<weights_name>.index.json`) and the files given to it: it writes them anew,
  and drops an old file of such a name;
- it **refuses** any other weight file (`is_weight_file`: another `*.safetensors`, a pickle, an
  index of other weights, ...), here or in a subdirectory: dropping it would lose it and
  copying it would duplicate it, so the caller chooses with `other_weights="keep"` or `"drop"`;
- it **carries over** everything else (tokenizer, generation config, README, subdirectories):
  each file is copied (a reflink where the filesystem offers one), never linked, so that
  nothing outside the target can change; a symbolic link to a file is copied as the file it
  points to; a link to a directory, or one that points nowhere, is recreated as the same link.
"""

import errno
import os
import stat
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal, NamedTuple

from . import fs


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
INDEX_SUFFIX = ".index.json"


def is_weight_file(name: str) -> bool:
    """Whether a file of this name holds weights (or indexes them) by its suffix."""
    return name.lower().removesuffix(INDEX_SUFFIX).endswith(WEIGHT_SUFFIXES)


def check_weights_name(weights_name: object) -> str:
    if (
        not isinstance(weights_name, str)
        or not _is_plain_name(weights_name)
        or not weights_name.endswith(".safetensors")
        or weights_name == ".safetensors"
    ):
        raise ValueError(
            "`weights_name` must be a plain file name ending in `.safetensors`, such as "
            f"'model.safetensors' or 'adapter_model.safetensors'; got {weights_name!r}."
        )
    return weights_name


def weight_file_names(weights_name: str, count: int) -> list[str]:
    """`weights_name` for one file; `<stem>-0000k-of-0000n.safetensors` for several."""
    if count == 1:
        return [weights_name]
    stem = weights_name.removesuffix(".safetensors")
    return [f"{stem}-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def index_name(weights_name: str) -> str:
    return weights_name + INDEX_SUFFIX


def owns_weight_file(weights_name: str, name: str) -> bool:
    """Whether `name` is one of the files a save with `weights_name` writes (or would write)."""
    stem = weights_name.removesuffix(".safetensors")
    if name in (weights_name, index_name(weights_name)):
        return True
    shard = name.removeprefix(f"{stem}-").removesuffix(".safetensors")
    parts = shard.split("-of-")
    return (
        name.startswith(f"{stem}-")
        and name.endswith(".safetensors")
        and len(parts) == 2
        and all(len(p) == 5 and p.isdigit() for p in parts)
    )


def _is_plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


def check_files(files: object, weights_name: str) -> dict[str, bytes | Path]:
    """The extra files of a save (`files=`), checked: plain names to bytes or files to copy."""
    if files is None:
        return {}
    if not isinstance(files, Mapping):
        raise TypeError(f"`files` must map file names to bytes or paths; got {files!r:.80}.")
    checked: dict[str, bytes | Path] = {}
    for name, content in files.items():
        if not isinstance(name, str) or not _is_plain_name(name):
            raise ValueError(
                "`files` must be keyed by plain file names (no directories), such as "
                f"'config.json'; got {name!r}."
            )
        if owns_weight_file(weights_name, name):
            raise ValueError(
                f"`files` must not name the save's own weight file {name!r}; it writes that "
                "file itself (choose its name with `weights_name`)."
            )
        if isinstance(content, bytes | bytearray | memoryview):
            checked[name] = bytes(content)
        elif isinstance(content, os.PathLike):
            source = Path(content)
            if not source.is_file():
                raise FileNotFoundError(
                    f"`files[{name!r}]` must be an existing file to copy; {source} is "
                    f"{'a directory' if source.is_dir() else 'missing'}."
                )
            checked[name] = source
        else:
            raise TypeError(
                f"`files[{name!r}]` must be bytes (the content, e.g. `text.encode()`) or a "
                f"`pathlib.Path` of a file to copy; got {type(content).__name__}. (A `str` is "
                "refused because it could mean either.)"
            )
    return checked


# --- the target ---------------------------------------------------------------------------------


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


def resolve_target(path: str | os.PathLike) -> tuple[Path, os.stat_result | None]:
    """The directory a save replaces (a symbolic link is followed; the link itself is kept),
    and its `stat`; refuses, before any work, a directory that cannot be replaced."""
    given = os.fspath(path)
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
    target = Path(os.path.realpath(given))
    if target.parent == target or is_mount_point(target):
        raise _refuse(
            given,
            f"is {target}, a mount point: it cannot be replaced by another directory. Save into "
            "a directory inside it.",
        )
    cwd = Path(os.getcwd())
    if target == cwd or target in cwd.parents:
        raise _refuse(
            given,
            f"is {target}, which holds the current working directory, so it cannot be replaced. "
            "Change directory first or save elsewhere.",
        )
    try:
        info = os.stat(target)
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
        if not os.access(target, os.R_OK | os.W_OK | os.X_OK):
            raise PermissionError(
                errno.EACCES,
                f"`path` must be a directory this user can read and write, but {given} (mode "
                f"{mode:04o}, owner uid {info.st_uid}) is not. Nothing was written",
                given,
            )
    ancestor = target.parent
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
    return target, info


class Carried(NamedTuple):
    relative: str  # inside the target, "/"-separated
    kind: Literal["dir", "file", "link"]
    mode: int  # permission bits (of the directory, or of the file copied)
    link: str = ""  # the text of a link recreated as it is


class Target(NamedTuple):
    path: Path  # the directory replaced (links resolved)
    exists: bool
    mode: int  # permission bits the new directory gets
    carried: tuple[Carried, ...]
    owned_modes: dict[str, int]  # permission bits of the old files the save owns, by name


def plan(
    path: str | os.PathLike,
    owns: Callable[[str], bool],
    other_weights: OtherWeights,
) -> Target:
    """Checks `path` and sorts the entries of an existing target into owned, carried over and
    refused (see the module's docstring), before anything is written.

    **Arguments:**

    - `path`: the checkpoint directory.
    - `owns`: whether a top-level name is one of the save's own files.
    - `other_weights`: what to do with weight files it does not own: `"refuse"` (raise, naming
        them), `"keep"` (copy them into the new checkpoint) or `"drop"` (leave them out).

    **Returns:**

    The `Target`.
    """
    if other_weights not in ("refuse", "keep", "drop"):
        raise ValueError(
            f'`other_weights` must be "refuse", "keep" or "drop"; got {other_weights!r}.'
        )
    target, target_info = resolve_target(path)
    if target_info is None:
        return Target(target, False, 0o777, (), {})
    carried: list[Carried] = []
    owned_modes: dict[str, int] = {}
    others: list[str] = []
    problems: list[str] = []
    mounts = _mount_points()

    def scan(directory: Path, prefix: str) -> None:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            relative = prefix + entry.name
            source = Path(entry.path)
            info = entry.stat(follow_symlinks=False)
            if not prefix and owns(entry.name):
                if stat.S_ISREG(info.st_mode):  # keep its mode for the new file
                    owned_modes[entry.name] = stat.S_IMODE(info.st_mode)
                continue
            if stat.S_ISLNK(info.st_mode):
                try:
                    info = os.stat(source)
                except OSError:  # points nowhere (or in a loop): nothing to copy
                    carried.append(Carried(relative, "link", 0, os.readlink(source)))
                    continue
                if stat.S_ISDIR(info.st_mode):  # outside data, maybe large: keep the link
                    carried.append(Carried(relative, "link", 0, os.readlink(source)))
                    continue
            mode = stat.S_IMODE(info.st_mode)
            if stat.S_ISDIR(info.st_mode):
                if info.st_dev != target_info.st_dev or os.fspath(source) in mounts:
                    # Its files would be copied, then deleted with the old checkpoint.
                    problems.append(f"{relative}/ (a mount point, another filesystem's data)")
                    continue
                if not os.access(source, os.R_OK | os.X_OK) or not (
                    os.access(source, os.W_OK) or info.st_uid == os.geteuid()
                ):
                    problems.append(f"{relative}/ (a directory this user cannot read or clear)")
                    continue
                carried.append(Carried(relative, "dir", mode))
                scan(source, relative + "/")
            elif stat.S_ISREG(info.st_mode):
                if is_weight_file(entry.name) and other_weights != "keep":
                    if other_weights == "refuse":
                        others.append(relative)
                    continue
                if not os.access(source, os.R_OK):
                    problems.append(f"{relative} (a file this user cannot read)")
                    continue
                carried.append(Carried(relative, "file", mode))
            else:
                problems.append(f"{relative} (neither a file, a directory nor a link)")

    scan(target, "")
    if others:
        listed = ", ".join(repr(o) for o in others[:5])
        more = f" and {len(others) - 5} more" if len(others) > 5 else ""
        raise ValueError(
            f"{target} holds weight files that this save does not own: {listed}{more}. A save "
            "replaces the whole directory, so it would either lose them or copy them. Pass "
            '`other_weights="keep"` to copy them into the new checkpoint, or '
            '`other_weights="drop"` to leave them out (they are deleted with the old '
            "checkpoint). Nothing was written."
        )
    if problems:
        raise PermissionError(
            errno.EACCES,
            f"a save of {target} must copy (or later delete) every entry it does not own, but "
            f"cannot: {'; '.join(problems[:5])}. Fix or move them. Nothing was written",
            os.fspath(target),
        )
    return Target(target, True, stat.S_IMODE(target_info.st_mode), tuple(carried), owned_modes)


# --- building and swapping ----------------------------------------------------------------------


def _leftover_name(target: Path, kind: str) -> Path:
    # A file name is at most 255 bytes; keep room for the prefix and the token.
    return target.parent / f".{target.name[:200]}.{kind}-{uuid.uuid4().hex[:8]}"


def _make_parents(target: Path) -> None:
    missing = []
    parent = target.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for directory in reversed(missing):
        try:
            fs.mkdir(directory, 0o777)
        except FileExistsError:  # made meanwhile by another save
            continue
        fs.fsync_dir(directory.parent)


def _carry_over(target: Target, new: Path) -> None:
    for entry in target.carried:
        destination = new / entry.relative
        if entry.kind == "dir":
            fs.mkdir(destination, 0o700)  # its mode is set once it is complete
        elif entry.kind == "file":
            fs.copy_file(target.path / entry.relative, destination)
        else:
            fs.symlink(entry.link, destination)
    for entry in reversed(target.carried):  # each directory after its contents
        if entry.kind == "dir":
            fs.chmod(new / entry.relative, entry.mode)
            fs.fsync_dir(new / entry.relative)


def _failed_before_swap(error: BaseException, target: Target, new: Path) -> None:
    """Deletes the partial new checkpoint, and adds to `error` what became of everything."""
    if target.exists:
        state = f"{target.path} still holds the old checkpoint, unchanged."
    else:
        state = f"{target.path} did not exist before, and the save put nothing there."
    error.add_note(f"eqx_lean: the save failed before the new checkpoint was in place: {state}")
    if not new.exists():
        return
    try:
        fs.remove(new)
        error.add_note(f"The partial new checkpoint ({new}) was deleted.")
    except BaseException as cleanup_error:  # e.g. the filesystem went read-only
        error.add_note(
            f"The partial new checkpoint lies in {new} ({cleanup_error!r}): it is not the "
            "checkpoint and nothing reads it, so it is safe to delete now."
        )


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def replace(target: Target, write_owned: Callable[[Path, Mapping[str, int]], None]) -> None:
    """Writes the new checkpoint beside `target.path` and swaps it into place atomically.

    **Arguments:**

    - `target`: from `plan`.
    - `write_owned`: writes the save's own files into the directory it is given (with
        `fs.write_file` or `fs.copy_file`), each given the mode of the old file of that name
        when the mapping holds one.

    If anything fails before the swap, the partial new directory is deleted and the error gets
    notes saying that `target.path` still holds the old checkpoint (and where a leftover lies,
    if deleting failed too). Once swapped, the save has succeeded: failing to delete the old
    checkpoint is a warning naming where it lies.
    """
    path = target.path
    new = _leftover_name(path, "tmp")
    aside = _leftover_name(path, "old")  # used only without an atomic exchange
    try:
        _make_parents(path)
        fs.mkdir(new, 0o700 if target.exists else 0o777)
        write_owned(new, target.owned_modes)
        _carry_over(target, new)
        if target.exists:
            fs.chmod(new, target.mode)
        fs.fsync_dir(new)
    except BaseException as error:
        _failed_before_swap(error, target, new)
        raise
    new_identity = _identity(new)
    try:
        if not target.exists:
            fs.rename(new, path)
        elif not fs.exchange(new, path):
            _swap_by_renames(new, path, aside)
    except BaseException as error:
        now = _identity(path)
        if now == new_identity:  # swapped, then failed (in a hook)
            old = None if not target.exists else aside if aside.exists() else new
            where = f"; the old one lies in {old}, which is safe to delete" if old else ""
            error.add_note(f"eqx_lean: the new checkpoint is in place in {path}{where}.")
        elif now is None and target.exists:
            error.add_note(
                f"eqx_lean: {path} is missing: the old checkpoint lies in {aside}; rename it "
                f"back to {path}. The new one lies in {new}."
            )
        else:
            _failed_before_swap(error, target, new)
        raise
    old = None if not target.exists else aside if aside.exists() else new
    _after_swap(path, old)


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
        warnings.warn(
            f"eqx_lean: the new checkpoint is in place in {path}, but finishing the save "
            f"failed ({error!r}).{where}",
            stacklevel=5,  # the caller of save_stacked or save_tensors
        )
    except BaseException as error:
        where = ""
        if old is not None and os.path.lexists(old):
            where = f" The old one lies in {old}, which is safe to delete."
        error.add_note(f"eqx_lean: the new checkpoint is in place in {path}.{where}")
        raise
