"""JAX's persistent compilation cache, turned on for repeated runs: a second run compiles nothing.

JAX keys each cached executable on the program, its compile options, the backend and jaxlib's
version. The default directory is also split by machine (the accelerators' kind, or the host
CPU's features for CPU programs): an XLA:CPU executable compiled for one CPU's instruction set
is refused by another, so a home directory shared between machines would otherwise keep
evicting and recompiling.
"""

import hashlib
import os
import platform
import stat
import tempfile
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from . import _arguments as arguments


ENV = "EQX_LEAN_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no")


def _cpu_features() -> str:
    """The host CPU's feature flags (Linux), or what `platform` knows of it elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def machine_key() -> str:
    """What an executable compiled here depends on beyond JAX's own key: the platform, the
    devices' kind and, for CPU, the host's instruction set."""
    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    parts = [jax.__version__, devices[0].platform, *kinds]
    if devices[0].platform == "cpu":
        parts.append(_cpu_features())
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return f"{devices[0].platform}-{digest}"


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/eqx_lean/xla/<machine>` (`~/.cache` without `XDG_CACHE_HOME`)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG specification says a relative path there is invalid and to be ignored: taken as
    # it is, it would put the cache under whatever directory the process happens to start in.
    if not os.path.isabs(base):
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            raise OSError(
                "The compilation cache's default directory is under the home directory, but "
                "it cannot be determined: set HOME (or XDG_CACHE_HOME) to an absolute path, "
                f"or {ENV} to the directory to use."
            )
        base = os.path.join(home, ".cache")
    return Path(base) / "eqx_lean" / "xla" / machine_key()


def _why_not_a_directory(error: OSError) -> str:
    """Why `mkdir -p` failed, naming the path it failed at (a parent, possibly)."""
    name = error.filename if error.filename is not None else "?"
    if isinstance(error, (FileExistsError, NotADirectoryError)):
        # `mkdir` names the path it could not create, and `NotADirectoryError` the path
        # below a file: find the component that exists but is no directory.
        path = Path(name)
        while not (path.exists() or path.is_symlink()) and path != path.parent:
            path = path.parent
        if path.is_symlink() and not path.exists():
            return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
        if path.exists() and not path.is_dir():
            return f"{path} exists and is not a directory"
    return f"{name} could not be created ({error.strerror})"


def _others_can_write(path: Path) -> str | None:
    """Why users other than this process's could write entries in the directory `path`, or
    `None`: it belongs to another user (who can always make it writable), or its group or
    everyone may write in it. A sticky bit (as on `/tmp`) does not help a cache: it keeps
    others from replacing entries, not from writing the entry a later program will look for
    before this process does."""
    info = path.stat()
    if info.st_uid != os.geteuid():
        return (
            f"it belongs to another user (uid {info.st_uid}; this process runs as {os.geteuid()})"
        )
    writable = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable:
        who = "everyone" if writable & stat.S_IWOTH else "its group"
        return f"{who} may write in it (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _check_directory(path: Path, source: str, remedy: str, shared: bool = False) -> None:
    """Creates `path` (mode 0700) if missing, then checks this process can list it and write a
    file in it, as JAX's cache will, and (unless `shared`) that no other user can write in it:
    else raises an `OSError` saying so, before JAX is told.

    JAX itself only warns, for every program it compiles, when it cannot write an entry, and
    `mkdir` fails with a bare error naming a parent, or nothing of the cache at all."""

    def refuse(why: str) -> OSError:
        return OSError(
            f"The compilation cache's directory {path} ({source}) must be a directory this "
            f"process can create, list and write files in, but {why}. {remedy}"
        )

    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise refuse(_why_not_a_directory(e)) from e
    try:
        with os.scandir(path) as entries:  # readable; a full cache need not be listed
            next(entries, None)
        fd, probe = tempfile.mkstemp(prefix=".eqx_lean-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise refuse(f"{e.filename or path} could not be read or written ({e.strerror})") from e
    # Refused, not warned of: JAX runs what it reads from the cache as this process's own
    # compiled code, so a directory another user can write in lets that user run their program
    # as this one (and a warning printed once per run is easily missed in a training log).
    # Whoever does share a cache with users they trust says so with `shared=True`.
    others = None if shared else _others_can_write(path)
    if others is not None:
        raise OSError(
            f"The compilation cache's directory {path} ({source}) must be writable by this user "
            f"alone, but {others}: a program another user writes there would be run by this "
            f"process as its own. Make it yours alone (`chmod 700 {path}`), or pass "
            f"`shared=True` to use_compilation_cache if you trust everyone who can write in "
            f"it. {remedy}"
        )


def use_compilation_cache(
    directory: str | os.PathLike | None = None, *, shared: bool = False
) -> Path | None:
    """Turns on JAX's persistent compilation cache, so that a second run compiles nothing.

    The `python -m examples.mistral7b` commands call it (pass `--no-compilation-cache` to
    opt out), and so should a training script, first thing:

    ```python
    eqx_lean.use_compilation_cache()  # ~/.cache/eqx_lean/xla/<machine>
    ```

    Every program JAX compiles afterwards, however small or quick to compile, is written to
    the directory, and read from it instead of compiled when a later process compiles the
    same program for the same devices with the same versions (JAX's key). A run still traces
    and lowers its functions; only XLA's compilation is skipped.

    JAX writes each entry in place, not atomically: a process killed while writing one leaves
    it truncated, and JAX then refuses it (its compressed stream does not decode), warns and
    compiles again, in every later run, since it never replaces an entry. Delete the directory
    to clear such entries. The cache is trusted code: keep it in a directory only you can write
    (it is created with mode 0700). Where JAX's own cache was already set up
    (`JAX_COMPILATION_CACHE_DIR` or `jax.config.update("jax_compilation_cache_dir", ...)`),
    that setting is kept, and checked as any other.

    The directory is checked first: it is created if missing, and it must be a directory this
    process can list and write files in, and that no other user can write in (owned by this
    user, not writable by its group or by everyone, sticky bit or not). Otherwise this raises
    an `OSError` naming it and what is wrong (a file in the way, a dangling symbolic link, no
    permission, another user's directory or one others may write in), and leaves JAX's
    configuration as it was, so a caller that wants to run uncached instead can catch it, as
    the `python -m examples.mistral7b` commands do.

    **Arguments:**

    - `directory`: where to keep the cache. Default: the environment variable
        `EQX_LEAN_COMPILATION_CACHE` if set (`0`, `off`, `false` or `no` turn the cache off),
        else `$XDG_CACHE_HOME/eqx_lean/xla/<machine>` (`~/.cache/...`), one directory per
        platform, device kind and (for CPU programs) host instruction set.
    - `shared`: use a directory that other users can write in (another user's, or one its
        group or everyone may write in). Only for a cache shared with users you trust: JAX
        runs what it reads there as this process's own code.

    **Returns:**

    The directory in use, or `None` when turned off.

    **Raises:**

    `OSError` if the directory is not one this process can create, list and write files in,
    or (without `shared=True`) other users can write in it.
    """
    shared = arguments.boolean(shared, "`shared`")
    configured = jax.config.jax_compilation_cache_dir  # pyright: ignore[reportAttributeAccessIssue]
    if directory is None:
        setting = os.environ.get(ENV)
        if setting is not None and setting.strip().lower() in _OFF:
            return None
        if configured:
            # JAX's own setting, kept; checked as any other, since JAX reads it all the same.
            path = Path(configured).expanduser()
            _check_directory(
                path,
                "JAX's jax_compilation_cache_dir, or JAX_COMPILATION_CACHE_DIR",
                "Set JAX_COMPILATION_CACHE_DIR (or jax_compilation_cache_dir) elsewhere.",
                shared,
            )
            return path
        if setting:
            directory, source = setting, f"from {ENV}"
        else:
            directory, source = default_cache_dir(), "the default"
        remedy = f"Set {ENV} to another directory, or to off to run without the cache."
    else:
        source = "passed to use_compilation_cache"
        remedy = "Pass another directory."
    path = Path(directory).expanduser()
    _check_directory(path, source, remedy, shared)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # JAX caches only programs that took a second to compile by default: a run's dozens of
    # small programs (loads, writes, updates) would all compile again.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # JAX decides once per process whether the cache is in use, at its first compilation:
    # reset that, so that a call after some compilation still takes effect.
    compilation_cache.reset_cache()
    return path
