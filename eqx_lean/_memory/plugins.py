"""Planning's plugins kept out of the user's environment.

JAX imports every `jax_plugins` module and every `jax_plugins` entry point it can find, and
tries libtpu wherever it is importable, the first time any JAX program starts a backend: with
JAX's CUDA plugin and libtpu installed in an environment (the `plan` extra), every JAX program
there prints about 30 lines of CUDA and TPU errors (8 with `JAX_PLATFORMS=cpu`). JAX 0.10 to
0.11 have no switch to skip that discovery.

So the plugins can live in a directory of their own, outside `sys.path` (pip's `--target`;
by default `<environment>/plan-plugins`, or the directory `EQX_LEAN_PLAN_PLUGINS` names),
where JAX never looks. A plan for a GPU or a TPU makes that
directory importable in its own process only, once JAX's backends have started (so JAX's own
discovery never meets it), and starts the plugin it needs itself. Every other program in the
environment stays quiet.
"""

import importlib
import importlib.util
import os
import re
import sys
import threading
from importlib import metadata
from pathlib import Path


VARIABLE = "EQX_LEAN_PLAN_PLUGINS"
DEFAULT_NAME = "plan-plugins"

# The module that planning for each platform needs.
_CUDA_MODULE = "jax_plugins.xla_cuda12"
_TPU_MODULE = "libtpu"

# The plugins from the package index into the directory, pinned to the installed JAX.
_INSTALL = (
    "pip install --no-deps --target {target} "
    'jax-cuda12-plugin=={jax} jax-cuda12-pjrt=={jax} "libtpu=={libtpu}"'
)

_lock = threading.Lock()
_started: set[str] = set()


def directory() -> Path:
    """Where planning's plugins are looked for: `EQX_LEAN_PLAN_PLUGINS`, or `plan-plugins` in
    the running environment (`sys.prefix`: the virtual environment's own directory)."""
    named = os.environ.get(VARIABLE)
    return Path(named).expanduser() if named else Path(sys.prefix) / DEFAULT_NAME


def _in_directory(platform: str, where: Path) -> bool:
    if platform == "cuda":
        return (where / "jax_plugins" / "xla_cuda12" / "__init__.py").is_file()
    return (where / "libtpu" / "__init__.py").is_file()


def _module(platform: str) -> str:
    return _CUDA_MODULE if platform == "cuda" else _TPU_MODULE


# Test seam: tests/test_plan_plugins.py hides the environment's own plugins.
def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package that is not there
        return False


def available(platform: str) -> bool:
    """Whether planning for `platform` (`"cuda"` or `"tpu"`) can find its plugin: in the
    environment itself, or in the plugins directory."""
    return _importable(_module(platform)) or _in_directory(platform, directory())


def make_visible(platform: str) -> None:
    """Makes the plugin that planning for `platform` (`"cuda"` or `"tpu"`) needs loadable in
    this process, from the plugins directory, when the environment itself does not hold it.

    Does nothing when the environment holds the plugin (JAX found it on its own) or the
    directory does not. Otherwise: starts JAX's backends first (`jax.devices()`, which runs
    JAX's one plugin discovery without the directory), then appends the directory to
    `sys.path`; for `"cuda"`, it then starts the CUDA plugin itself, with its check of the local
    CUDA installation skipped (`JAX_SKIP_CUDA_CONSTRAINTS_CHECK`, set for that call only: the
    plugin compiles for GPUs this machine lacks); libtpu JAX loads itself when asked for a TPU
    topology.
    """
    with _lock:
        if platform in _started:
            return
        where = directory()
        if str(where) not in sys.path and _importable(_module(platform)):
            return  # the environment's own plugin, which JAX found (or will find) itself
        if not _in_directory(platform, where):
            return
        if platform == "cuda":
            _check_version(where)
        import jax

        jax.devices()  # JAX's plugin discovery runs now, before the directory is visible
        if str(where) not in sys.path:
            sys.path.append(str(where))
            importlib.invalidate_caches()
        # A module JAX imported itself (the directory was already on `sys.path`) is JAX's.
        if platform == "cuda" and _CUDA_MODULE not in sys.modules:
            plugin = importlib.import_module(_CUDA_MODULE)
            skip = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
            before = os.environ.get(skip)
            os.environ[skip] = "1"
            try:
                plugin.initialize()
            finally:
                if before is None:
                    del os.environ[skip]
                else:
                    os.environ[skip] = before
        _started.add(platform)


def _check_version(where: Path) -> None:
    """Refuses a CUDA plugin in `where` built for another JAX than the installed one (JAX's
    plugin and jaxlib must be the same release), with the command that installs the right one."""
    jax_version = metadata.version("jax")
    found = sorted(
        d.version
        for d in metadata.distributions(path=[str(where)])
        if d.metadata["Name"] in ("jax-cuda12-plugin", "jax_cuda12_plugin")
    )
    if found != [jax_version]:
        raise RuntimeError(
            f"The plugins directory {where} holds JAX's CUDA plugin "
            f"{', '.join(found) or 'without its metadata'}, but this environment runs JAX "
            f"{jax_version}; the two must be the same release. Reinstall the plugins there: "
            f"`{install_command(str(where))}`."
        )


def install_command(where: str | None = None) -> str:
    """The command that installs planning's plugins into the plugins directory (`where`, or
    `directory()`), pinned to the installed JAX: its CUDA plugin (without NVIDIA's libraries)
    and the libtpu its `tpu` extra pins (JAX 0.10.2: `0.0.42.*`)."""
    jax_version = metadata.version("jax")
    libtpu = "0.0.42.*"
    for requirement in metadata.requires("jax") or []:
        pin = re.fullmatch(r"libtpu\s*==\s*([\w.*]+)\s*;(.*)", requirement)
        if pin and "'tpu'" in pin.group(2).replace('"', "'"):
            libtpu = pin.group(1)
    target = where if where is not None else str(directory())
    return _INSTALL.format(target=target, jax=jax_version, libtpu=libtpu)
