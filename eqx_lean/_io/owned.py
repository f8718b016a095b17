"""What a save owns: its weight files, their index, and the files given to it with `files=`.

A save writes each of these names anew, as a regular file, and drops the old entry of that name
with the old checkpoint; it owns a name only while the old entry is a regular file (or a
symbolic link to one): see `carry.list_destination`, which refuses any other kind of entry there.
"""

import os
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from .safetensors import index_name


def check_weights_name(weights_name: object) -> str:
    if (
        not isinstance(weights_name, str)
        or not is_plain_name(weights_name)
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


def is_plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


Owner = Callable[[str], str | None]
"""What makes a top-level name the save's own (for messages: "`files['config.json']`"), or
`None` for a name it does not own."""


def owner(weights_name: str, files: Iterable[str]) -> Owner:
    """The `Owner` of a save with `weights_name` and these `files=` keys."""
    keys = frozenset(files)

    def owned_by(name: str) -> str | None:
        if name in keys:
            return f"`files[{name!r}]`"
        if owns_weight_file(weights_name, name):
            return f"`weights_name={weights_name!r}` (its weight files and index)"
        return None

    return owned_by


def describe_kind(mode: int) -> str:
    """What an entry of this `st_mode` is, in words ("a directory", "a FIFO", ...)."""
    kinds = [
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ]
    return next((words for test, words in kinds if test(mode)), "neither a file nor a directory")


def check_files(files: object, weights_name: str) -> dict[str, bytes | Path]:
    """The extra files of a save (`files=`), checked: plain names to bytes or files to copy."""
    if files is None:
        return {}
    if not isinstance(files, Mapping):
        raise TypeError(f"`files` must map file names to bytes or paths; got {files!r:.80}.")
    checked: dict[str, bytes | Path] = {}
    for name, content in files.items():
        if not isinstance(name, str) or not is_plain_name(name):
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
            checked[name] = _file_to_copy(name, content)
        else:
            raise TypeError(
                f"`files[{name!r}]` must be bytes (the content, e.g. `text.encode()`) or a "
                f"`pathlib.Path` of a file to copy; got {type(content).__name__}. (A `str` is "
                "refused because it could mean either.)"
            )
    return checked


def _file_to_copy(name: str, content: os.PathLike) -> Path:
    source = Path(content)
    try:
        mode = os.stat(source).st_mode  # links followed: a link to a file is that file
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(
            f"`files[{name!r}]` must be an existing file to copy; {source} is missing."
        ) from None
    if not stat.S_ISREG(mode):
        # Copying from a FIFO or a device (`/dev/null`, `/dev/zero`) would block or never end.
        raise ValueError(
            f"`files[{name!r}]` must be a regular file to copy; {source} is not a regular file "
            f"but {describe_kind(mode)}. Nothing was written."
        )
    return source
