"""A quiet environment: JAX's CUDA plugin and libtpu, which planning for GPUs and TPUs needs,
kept out of the environment the README's main job makes (issue 41).

JAX imports every plugin it can find when any JAX program starts: installed in the environment
(the `plan` extra), they make `python -c "import jax; print(jax.numpy.ones(2).sum())"` print
about 30 lines of CUDA and TPU errors. So the README's main job installs no plugin, its test
command installs `plan` into an environment of its own, and a user plans from a directory of
plugins (`eqx_lean/_memory/plugins.py`) that only a plan's process loads.

The split is made here from this environment, offline: a new virtual environment whose
site-packages links every entry of this one's except the plugins, and a plugins directory that
links those (what the documented `pip install --no-deps --target` writes). It needs the plugins
in this environment (the README's test command installs the `plan` extra).
"""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from eqx_lean.internal import (
    PLAN_PLUGINS_NAME,
    PLAN_PLUGINS_VARIABLE,
    make_plan_plugins_visible,
    plan_plugins,
    plan_plugins_install_command,
)


# The docs tier (`-m docs`): the README's test command runs it after the default tier.
pytestmark = pytest.mark.docs

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The site-packages entries of JAX's plugins (packages, their metadata) and their distributions.
_PLUGIN_ENTRIES = ("jax_plugins", "jax_cuda", "jax_rocm", "libtpu")
_PLUGIN_DISTRIBUTIONS = ("jax-cuda", "jax-rocm", "libtpu")

ONE_LINE = "import jax; print(jax.numpy.ones(2).sum())"


def _has_plugins() -> bool:
    return all(
        importlib.util.find_spec(name) is not None for name in ("jax_plugins.xla_cuda12", "libtpu")
    )


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{command}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    """(the interpreter of an environment like this one without JAX's plugins, a plugins
    directory holding this one's)."""
    if not _has_plugins():
        pytest.skip(
            "needs JAX's CUDA plugin and libtpu in this environment, to move them out of it "
            '(the README\'s test command installs them: pip install ".[plan]")'
        )
    root = tmp_path_factory.mktemp("split")
    venv = root / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    purelib = pathlib.Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).stdout.strip()
    )
    directory = root / "plan-plugins"
    directory.mkdir()
    for site in sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")}):
        for entry in sorted(pathlib.Path(site).iterdir()):
            into = directory if entry.name.startswith(_PLUGIN_ENTRIES) else purelib
            if not (into / entry.name).exists():
                (into / entry.name).symlink_to(entry)
    return python, directory


def _env(directory: pathlib.Path) -> dict[str, str]:
    """This process's environment with the checkout first on `PYTHONPATH`, the plugins
    directory named, and neither `JAX_PLATFORMS` nor the `TPU_LIBRARY_PATH` that importing
    libtpu set in this process (a user's plain environment has neither)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_LIBRARY_PATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env[PLAN_PLUGINS_VARIABLE] = str(directory)
    return env


@pytest.mark.parametrize(
    "program",
    [ONE_LINE, "import jax, eqx_lean, eqx_lean.memory; print(jax.numpy.ones(2).sum())"],
    ids=["jax", "with-eqx_lean"],
)
def test_a_jax_program_prints_only_its_result(
    split: tuple[pathlib.Path, pathlib.Path], tmp_path: pathlib.Path, program: str
):
    """With the plugins in a directory of their own, a JAX program in the environment prints
    its result and nothing else, without `JAX_PLATFORMS`."""
    python, directory = split
    done = _run([str(python), "-c", program], cwd=tmp_path, env=_env(directory))
    assert (done.stdout, done.stderr) == ("2.0\n", ""), done.stdout + done.stderr


PLAN = """
import json, jax, jax.numpy as jnp, eqx_lean.memory
results = {}
for spec in ["8xh100", "v5e-16"]:
    target = eqx_lean.memory.target(spec)
    mesh = target.mesh((len(target.devices),), ("x",))
    x = jax.ShapeDtypeStruct((8 * len(target.devices), 128), jnp.float32,
                             sharding=jax.NamedSharding(mesh, jax.P("x")))
    plan = eqx_lean.memory.plan(lambda a: a * 2, x, target=target)
    results[spec] = [target.platform, len(target.devices), target.device_kind, plan.fits]
results["after"] = [str(jax.numpy.ones(2).sum()), jax.default_backend()]
print(json.dumps(results))
"""


def test_a_plan_loads_the_plugins_in_its_own_process(
    split: tuple[pathlib.Path, pathlib.Path], tmp_path: pathlib.Path
):
    """A plan for GPUs and one for a TPU slice, in a process that started without
    `JAX_PLATFORMS` and whose environment holds no plugin: each target loads its plugin from the
    directory, and JAX still computes on the CPU afterwards. What remains on stderr is the
    plugins' own start-up lines (docs/planning.md lists them), no traceback."""
    python, directory = split
    done = _run([str(python), "-c", PLAN], cwd=tmp_path, env=_env(directory))
    results = json.loads(done.stdout.splitlines()[-1])
    assert results["8xh100"][:3] == ["gpu", 8, "NVIDIA H100 80GB HBM3"]
    assert results["v5e-16"][:2] == ["tpu", 16]
    assert results["after"] == ["2.0", "cpu"]
    assert "Traceback" not in done.stderr and "plugin configuration error" not in done.stderr
    print(done.stderr)


def test_planning_docs_give_the_planner_s_install_command():
    """docs/planning.md's command for the plugins directory is the one the library's messages
    give (pinned to the installed JAX), into `plan-plugins` of the active environment, where
    the library looks by default."""
    assert PLAN_PLUGINS_NAME == "plan-plugins"
    command = plan_plugins_install_command(".venv/plan-plugins")
    assert command in (ROOT / "docs" / "planning.md").read_text()


def test_a_cuda_plugin_for_another_jax_is_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
):
    """A plugins directory whose CUDA plugin is another release than the running JAX is
    refused before anything is loaded, with the command that installs the right one."""
    from jax import __version__ as jax_version

    package = tmp_path / "jax_plugins" / "xla_cuda12"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    info = tmp_path / "jax_cuda12_plugin-0.9.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: jax-cuda12-plugin\nVersion: 0.9.0\n"
    )
    monkeypatch.setenv(PLAN_PLUGINS_VARIABLE, str(tmp_path))
    monkeypatch.setattr(
        plan_plugins, "_importable", lambda name: False
    )  # as if not in site-packages
    expected = (
        rf"CUDA plugin 0\.9\.0, but this environment runs JAX {re.escape(jax_version)}.*"
        rf"pip install --no-deps --target {re.escape(str(tmp_path))} "
        rf"jax-cuda12-plugin=={re.escape(jax_version)}"
    )
    with pytest.raises(RuntimeError, match=expected):
        make_plan_plugins_visible("cuda")
    assert str(tmp_path) not in sys.path


# --- the README's commands ------------------------------------------------------------------------


def _readme_commands() -> tuple[str, str]:
    """(the main job's command line, the test command's)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    (main,) = [x for x in lines if "python -m eqx_lean.bench" in x and "pip install" in x]
    marker = lines.index("<!-- test-command -->")
    assert lines[marker + 1].startswith("```"), lines[marker + 1]
    return main, lines[marker + 2]


def _distributions(extras: set[str]) -> set[str]:
    """Every distribution `pip install ".[extras]"` brings, by this environment's metadata."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    todo, seen_extras = sorted(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen_extras:
            continue
        seen_extras.add(extra)
        for text in project["optional-dependencies"][extra]:
            requirement = Requirement(text)
            if canonicalize_name(requirement.name) == "eqx-lean":
                todo.extend(requirement.extras)
            else:
                requirements.append(requirement)
    found: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    while requirements:
        requirement = requirements.pop()
        name = canonicalize_name(requirement.name)
        if (name, frozenset(requirement.extras)) in seen:
            continue
        seen.add((name, frozenset(requirement.extras)))
        found.add(name)
        try:
            needs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in needs:
            need = Requirement(text)
            if need.marker is None or any(
                need.marker.evaluate({"extra": extra}) for extra in requirement.extras or {""}
            ):
                requirements.append(need)
    return found


def _plugins_of(extras: set[str]) -> set[str]:
    return {d for d in _distributions(extras) if d.startswith(_PLUGIN_DISTRIBUTIONS)}


def _extras_and_venv(command: str) -> tuple[set[str], str]:
    (venv,) = re.findall(r"python3\.11 -m venv (\S+)", command)
    named = re.findall(r'pip install (?:-e )?"\.\[([\w,-]+)\]"', command)
    return {e for group in named for e in group.split(",")}, venv


def test_the_readme_s_main_job_installs_no_jax_plugin_and_its_tests_install_theirs_apart():
    """The main job's environment holds no JAX plugin (so a JAX program there prints only its
    result); the test command, which installs the `plan` extra, makes an environment of its
    own, so it never leaves the main job's noisier."""
    main, tests = _readme_commands()
    main_extras, main_venv = _extras_and_venv(main)
    test_extras, test_venv = _extras_and_venv(tests)
    assert main_extras and test_extras, (main, tests)
    if not _has_plugins():
        pytest.skip("the closure of the extras is read from this environment's metadata")
    assert _plugins_of({"plan"}) >= {"jax-cuda12-plugin", "jax-cuda12-pjrt", "libtpu"}
    assert not _plugins_of(main_extras), (main_extras, _plugins_of(main_extras))
    if _plugins_of(test_extras):
        assert os.path.normpath(test_venv) != os.path.normpath(main_venv), (main, tests)
