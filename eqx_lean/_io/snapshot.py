"""One checkpoint, opened whole: every file a load reads, opened once, relative to one directory.

A save never changes a checkpoint's files: it builds a new directory beside the checkpoint,
swaps the two (`eqx_lean._io.directory`), then deletes the old one. A reader that opened files
by path one at a time could get the index of one save and the shards of the next, or a header
from one file and the data from its successor. So a load opens the checkpoint's directory once
(a descriptor), then, relative to it, every file it will read: the index (or the directory's
listing), every weight file, and the small files it is asked for (`config.json`, ...), all
before any tensor is read. Headers and data are then read from those open files only: an open
file keeps its content even after a save deletes it.

Whether the files opened are one checkpoint is settled once all of them are open: the directory
opened must still be the one at `path`. While its descriptor is open, the directory's inode
cannot be reused, so comparing `(st_dev, st_ino)` is exact here (comparing the numbers of files
opened by path at different times is not: ext4 reuses a deleted file's inode number at once,
and successive saves of one model have equal sizes). An open that fails with ENOENT, an empty
listing, or a directory whose link count is 0 are the same sign seen earlier. Then the load
starts again from `path`, at most `RETRIES` times.

This holds on local filesystems. On NFS, a reader on another client can get ESTALE for a file
a save deleted, or SIGBUS through a memory map of one: NFS does not keep a file another client
deleted for an open descriptor.
"""

import contextlib
import errno
import os
import resource
import stat
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .owned import describe_kind, is_plain_name
from .safetensors import (
    INDEX_FILE,
    INDEX_SUFFIX,
    PICKLE_SUFFIXES,
    Tensor,
    parse_index,
    pickle_error,
    read_header,
)


RETRIES = 3
"""How many times a load starts again when a save replaced the checkpoint while it opened it."""

# O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused once open). Symbolic
# links are followed, as in the Hugging Face cache, where weight files link to blobs.
_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
_DIRECTORY = os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY


class CheckpointReplacedError(RuntimeError):
    """A save replaced the checkpoint each time a load opened it (see `open_checkpoint`)."""


class Checkpoint:
    """A checkpoint opened whole: its tensors, from files held open (see `open_checkpoint`).

    Pass it as the `path` of [`eqx_lean.load_tensors`][], [`eqx_lean.load_stacked`][] or
    [`eqx_lean.checkpoint_tensors`][] to read the tensors of exactly this checkpoint, and read
    the small files opened with it with `file(name)`. Close it (or use it in a `with` block)
    once done: it holds every file open.
    """

    def __init__(
        self,
        source: str,
        files: tuple[Path, ...],
        tensors: dict[str, Tensor],
        fds: dict[Path, int],
        extra: dict[str, bytes | None],
    ):
        self.source = source
        self.files = files
        self.tensors = tensors
        self.fds = fds
        self._extra = extra
        self.closed = False

    def describe(self) -> str:
        if len(self.files) == 1:
            return str(self.files[0])
        return f"{len(self.files)} files in {self.files[0].parent}"

    def file(self, name: str) -> bytes | None:
        """The content of a file opened with the checkpoint (`open_checkpoint(..., files=)`).

        **Arguments:**

        - `name`: one of the names given to `files=`.

        **Returns:**

        The file's bytes as they were when the checkpoint was opened, or `None` if the
        checkpoint's directory held no such file.
        """
        if name not in self._extra:
            raise KeyError(
                f"`name` must be one of the files opened with the checkpoint "
                f"({sorted(self._extra)}), as `open_checkpoint(path, files=[...])`; got {name!r}."
            )
        return self._extra[name]

    def close(self) -> None:
        """Closes every file of the checkpoint (a second call does nothing)."""
        fds, self.fds = self.fds, {}
        self.closed = True
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<eqx_lean checkpoint {self.describe()}, {len(self.tensors)} tensors, {state}>"


class _Request:
    """What to open: weight files by directory, or a directory (with or without an index)."""

    def __init__(self, path: Any, files: Any):
        if isinstance(path, bytes):
            raise TypeError(
                "`path` must be a `str` or `os.PathLike` (a directory, a safetensors file, or an "
                f"index file), or a list of them; got the bytes {path!r}. Decode it first, with "
                "`os.fsdecode(path)`."
            )
        if isinstance(path, str | os.PathLike):
            paths = [Path(path)]
        elif _is_path_list(path):
            paths = [Path(p) for p in path]
        else:
            raise TypeError(
                "`path` must be a safetensors file, a list of them, or a directory (with "
                f"{INDEX_FILE} or *.safetensors files); got {path!r:.200}."
            )
        self.source = os.fspath(path) if isinstance(path, str | os.PathLike) else str(paths)
        self.extra = _check_extra_names(files)
        self.index: Path | None = None  # an index file given as the path
        self.directory: Path | None = None  # a directory given as the path
        self.weights: list[Path] = []  # weight files given as the path
        if len(paths) == 1 and paths[0].is_dir():
            self.directory = paths[0]
        elif len(paths) == 1 and paths[0].name.endswith(INDEX_SUFFIX):
            self.index = paths[0]
        else:
            for p in paths:
                if p.suffix in PICKLE_SUFFIXES:
                    raise pickle_error(p)
            self.weights = paths
        parents = {p.parent for p in self.weights}
        if self.extra and len(parents) > 1:
            raise ValueError(
                "`files` are read from the checkpoint's directory, so the weight files given as "
                f"`path` must lie in one directory; they lie in {len(parents)}."
            )

    def home(self) -> Path:
        """The directory that `files=` are read from."""
        if self.directory is not None:
            return self.directory
        return (self.index or self.weights[0]).parent


def _is_path_list(path: Any) -> bool:
    return (
        isinstance(path, Sequence)
        and not isinstance(path, str | bytes)
        and len(path) > 0
        and all(isinstance(p, str | os.PathLike) for p in path)
    )


def _check_extra_names(files: Any) -> tuple[str, ...]:
    if isinstance(files, str | bytes) or not isinstance(files, Iterable):
        raise TypeError(
            f"`files` must be a list of file names, such as ['config.json']; got {files!r:.80}."
        )
    names = tuple(files)
    for name in names:
        if not isinstance(name, str) or not is_plain_name(name):
            raise ValueError(
                "`files` must name files in the checkpoint's directory (plain names, no "
                f"directories), such as 'config.json'; got {name!r}."
            )
    return names


# Test seam: tests/conftest.py (`when_load_files_are_open`) and tests/test_io_snapshot.py wrap its
# methods (`__init__`, `directory`, `weight_file`, `live`) to land a save mid-open.
class _Opener:
    """One try at opening a checkpoint: the descriptors it has opened, to check and to close."""

    def __init__(self, request: _Request):
        self.request = request
        self.dirs: dict[Path, int] = {}
        self.fds: dict[Path, int] = {}

    def directory(self, path: Path) -> int:
        if path not in self.dirs:
            try:
                self.dirs[path] = os.open(path, _DIRECTORY)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"`path` must name existing files; the directory {path} does not exist."
                ) from None
            except NotADirectoryError:
                raise ValueError(f"{path} must be a directory.") from None
        return self.dirs[path]

    def _open(self, path: Path, what: str) -> int | None:
        """Opens the regular file `path` relative to its directory; `None` if there is none."""
        directory = self.directory(path.parent)
        try:
            fd = os.open(path.name, _READ, dir_fd=directory)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise _too_many_files(self.request, len(self.fds) + len(self.dirs)) from None
            raise
        kind = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind):
            os.close(fd)
            raise ValueError(
                f"{what} {path} must be a regular file (or a link to one), but it is "
                f"{describe_kind(kind)}."
            )
        return fd

    def weight_file(self, path: Path, what: str, missing: Exception) -> None:
        """Opens the weight file `path`; `what` starts a message about it, `missing` is raised
        if it does not exist."""
        if path in self.fds:
            return
        fd = self._open(path, what)
        if fd is None:
            raise missing
        self.fds[path] = fd

    def read_small(self, path: Path, what: str) -> bytes | None:
        fd = self._open(path, what)
        if fd is None:
            return None
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def open(self) -> Checkpoint:
        request = self.request
        expected: dict[str, Path] = {}
        if request.directory is not None:
            files, expected = self._files_of_directory(request.directory)
        elif request.index is not None:
            files, expected = self._files_of_index(request.index)
        else:
            files = request.weights
            for file in files:
                self.weight_file(
                    file,
                    "The weight file",
                    FileNotFoundError(f"`path` must name existing files; {file} does not exist."),
                )
        extra = {name: self.read_small(request.home() / name, "`files`") for name in request.extra}
        tensors: dict[str, Tensor] = {}
        for file in files:
            for name, tensor in read_header(file, self.fds[file]).items():
                if name in tensors:
                    raise ValueError(
                        f"Tensor {name!r} is stored twice, in {tensors[name].file} and in {file}; "
                        "a checkpoint must name each tensor once."
                    )
                tensors[name] = tensor
        for name, file in expected.items():
            if name not in tensors or tensors[name].file != file:
                raise ValueError(
                    f"The index names {file} as the file holding tensor {name!r}, but that file "
                    "has no such tensor."
                )
        return Checkpoint(request.source, tuple(files), tensors, self.fds, extra)

    def _files_of_index(self, index: Path) -> tuple[list[Path], dict[str, Path]]:
        raw = self.read_small(index, "The index")
        if raw is None:
            raise FileNotFoundError(
                f"`path` must name an existing index file; {index} does not exist."
            )
        return self._indexed(index, raw)

    def _indexed(self, index: Path, raw: bytes) -> tuple[list[Path], dict[str, Path]]:
        expected = {name: index.parent / file for name, file in parse_index(index, raw).items()}
        files = sorted(set(expected.values()))
        for file in files:
            self.weight_file(
                file,
                f"{index} names {file.name}, but the entry",
                ValueError(f"{index} refers to {file.name}, which does not exist."),
            )
        return files, expected

    def _files_of_directory(self, directory: Path) -> tuple[list[Path], dict[str, Path]]:
        index = directory / INDEX_FILE
        raw = self.read_small(index, "The index")
        if raw is not None:
            return self._indexed(index, raw)
        # Empty, or without weights, once a save deleted it: then `live` says so, and the
        # error below is not raised but the checkpoint opened again.
        names = sorted(os.listdir(self.directory(directory)))
        files = [directory / n for n in names if n.endswith(".safetensors")]
        if not files:
            pickles = [n for n in names if Path(n).suffix in PICKLE_SUFFIXES]
            if pickles:
                raise pickle_error(directory / pickles[0])
            raise ValueError(
                f"`path` must hold safetensors weights, but the directory {directory} has no "
                f"{INDEX_FILE} and no *.safetensors file."
            )
        for file in files:
            self.weight_file(
                file,
                "The weight file",
                FileNotFoundError(f"The weight file {file} does not exist."),
            )
        return files, {}

    def live(self) -> bool:
        """Whether every directory opened is still the one at its path (so no save replaced it
        while the files were opened). Exact while the descriptors are open: see the module."""
        for path, fd in self.dirs.items():
            opened = os.fstat(fd)
            if opened.st_nlink == 0:
                return False
            try:
                now = os.stat(path)
            except FileNotFoundError:
                return False
            if (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
                return False
        return True

    def close_directories(self) -> None:
        dirs, self.dirs = self.dirs, {}
        for fd in dirs.values():
            os.close(fd)

    def close(self) -> None:
        self.close_directories()
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            os.close(fd)


def _too_many_files(request: _Request, held: int) -> OSError:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return OSError(
        errno.EMFILE,
        f"Loading {request.source} opens all of its files at once (so that a save cannot swap "
        f"them during the load), but this process reached its open-file limit ({soft}, with "
        f"{held} of the checkpoint's files and directories open). Raise the limit, e.g. "
        "`ulimit -n 65536` or `resource.setrlimit(resource.RLIMIT_NOFILE, ...)`, or save the "
        "checkpoint in fewer, larger files (`max_shard_bytes`)",
    )


def open_checkpoint(
    path: str | os.PathLike | Sequence[str | os.PathLike], *, files: Sequence[str] = ()
) -> Checkpoint:
    """Opens a checkpoint whole, so that everything read from it is of one save.

    Every file a load reads is opened here, relative to one open descriptor of the checkpoint's
    directory, before any tensor is read: the index (or the directory's listing), every weight
    file, and the small files named in `files`. A save that replaces the checkpoint meanwhile
    (see [`eqx_lean.save_tensors`][]) is noticed, and the checkpoint is opened again from
    `path`, at most three times. What is read from the result, headers, tensor data and
    `files`, comes from those open files only, so it is exactly the old or exactly the new
    checkpoint, never a mix, however many saves replace it while it is read.

    [`eqx_lean.load_tensors`][] and friends call this themselves; call it to read other files of
    the same checkpoint, such as the `config.json` a model is built from:

    ```python
    with eqx_lean.open_checkpoint("checkpoint/", files=["config.json"]) as checkpoint:
        config = json.loads(checkpoint.file("config.json"))
        model = eqx_lean.load_tensors(checkpoint, make_like(config), names)
    ```

    The guarantee holds on local filesystems. On NFS, a reader on another client can get
    `ESTALE` (or `SIGBUS` through a memory map) for a file a save deleted.

    **Arguments:**

    - `path`: as for [`eqx_lean.load_stacked`][]: a directory (with
        `model.safetensors.index.json` or `*.safetensors` files), a safetensors file, a list of
        them, or an index file.
    - `files`: names of other files in the checkpoint's directory to read with it (a file the
        directory lacks reads as `None`).

    **Returns:**

    An open `Checkpoint`: pass it as `path` to the loading functions, read `files` with
    `checkpoint.file(name)`, and close it (or use `with`) once done.

    **Raises:**

    `CheckpointReplacedError` if a save replaced the checkpoint during each of the four
    tries; an `OSError` naming the open-file limit if the checkpoint has more files than this
    process may open.
    """
    if isinstance(path, Checkpoint):
        raise TypeError("`path` is already an open checkpoint; use it as it is.")
    if sys.byteorder != "little":  # pragma: no cover
        raise NotImplementedError("Reading safetensors files needs a little-endian host.")
    request = _Request(path, files)
    for _ in range(1 + RETRIES):
        opener = _Opener(request)
        try:
            checkpoint = opener.open()
        except Exception:
            # An error about files that a save deleted or replaced meanwhile is no error of
            # the checkpoint: try again. Otherwise it is the checkpoint's own.
            live = opener.live()
            opener.close()
            if live:
                raise
            continue
        except BaseException:
            opener.close()
            raise
        if opener.live():
            opener.close_directories()
            return checkpoint
        opener.close()
    raise CheckpointReplacedError(
        f"A save replaced the checkpoint {request.source} during the load, each of the "
        f"{1 + RETRIES} times it was opened. It was read whole each time (never a mix of two "
        "saves) and nothing was loaded. Load it again once the saves pause, or load from a "
        "copy that no save writes to."
    )


@contextlib.contextmanager
def opened(path: Any) -> Iterator[Checkpoint]:
    """`path` opened whole for the block (see `open_checkpoint`); a `Checkpoint` already open
    is used as it is, and left open."""
    if not isinstance(path, Checkpoint):
        with open_checkpoint(path) as checkpoint:
            yield checkpoint
        return
    if path.closed:
        raise ValueError(
            f"`path` is a closed checkpoint ({path.describe()}); read it inside its `with "
            "eqx_lean.open_checkpoint(...)` block, or pass the path itself."
        )
    yield path
