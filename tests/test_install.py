"""The package as a user installs it: a wheel of this checkout, in a fresh virtual environment,
imported from outside the checkout, fine-tunes a tiny checkpoint with `eqx_lean.hf`.

The default test is offline: the wheel is built with `--no-index --no-build-isolation`, by the
build backend that `pyproject.toml` names, installed here (the `test` extra holds it); it is
installed with `--no-index --no-deps`, and the new environment sees the running interpreter's
packages (jax, equinox, optax...) through a `.pth` file of plain directories. Plain
directories, because the running environment may hold an editable `eqx_lean` (a `.pth` pointing
at a checkout): `.pth` files inside a directory added that way are not processed, and the test
checks that `eqx_lean` comes from the new environment.
"""

import os
import pathlib
import socket
import subprocess
import sys
import sysconfig
import time
import tomllib

import pytest


# The docs tier (`-m docs`): the README's test command runs it after the default tier.
pytestmark = pytest.mark.docs


ROOT = pathlib.Path(__file__).resolve().parents[1]

# Run by the new environment's interpreter, from a directory outside the checkout: a tiny random
# checkpoint, written, loaded, fine-tuned with LoRA for a few steps, adapters saved. By its
# absolute path, with `-P`: its folder, inside the checkout, stays off `sys.path`.
FINETUNE_WORKER = ROOT / "tests" / "workers" / "installed_finetune.py"


def _finetune_command(python: pathlib.Path) -> list[str]:
    return [str(python), "-P", str(FINETUNE_WORKER)]


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{command}:\n{done.stdout}\n{done.stderr}"
    return done


def _missing_build_requirements() -> list[str]:
    """The requirements of `pyproject.toml`'s `[build-system]` that this interpreter lacks."""
    from importlib import metadata

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    missing = []
    for text in pyproject["build-system"]["requires"]:
        requirement = Requirement(text)
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{text} (not installed)")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            missing.append(f"{text} (found {version})")
    return missing


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """One wheel of this checkout, built once for the module's tests, offline: a build that
    fails, or cannot start for want of the build backend, fails the tests."""
    missing = _missing_build_requirements()
    assert not missing, (
        f"the build backend of pyproject.toml is not installed: {', '.join(missing)}. The wheel "
        "is built offline (pip wheel --no-build-isolation), so it must be; the `test` extra "
        "installs it"
    )
    out = tmp_path_factory.mktemp("wheel")
    offline = ["--no-deps", "--no-index", "--no-build-isolation"]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", *offline, "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = list(out.glob("eqx_lean-*.whl"))
    assert len(wheels) == 1, wheels
    return out


def _outside_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_wheel_holds_the_hf_layer_and_lora_and_nothing_of_examples(wheel_dir: pathlib.Path):
    import zipfile

    (wheel,) = wheel_dir.glob("eqx_lean-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ["eqx_lean/hf/__init__.py", "eqx_lean/hf/_state.py", "eqx_lean/lora/__init__.py"]:
        assert needed in names, needed
    assert not [n for n in names if n.startswith(("examples/", "tests/"))]


def test_wheel_installs_offline_and_fine_tunes(
    wheel_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
):
    start = time.perf_counter()
    # Outside the checkout, whatever pytest's tmp_path is configured to.
    venv = pathlib.Path(tmp_path_factory.mktemp("venv")) / "env"
    assert not str(venv.resolve()).startswith(str(ROOT) + os.sep)
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    purelib = pathlib.Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).stdout.strip()
    )
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-index",
            "--find-links",
            str(wheel_dir),
            "--no-build-isolation",
            "--no-deps",
            "eqx_lean",
        ],
        env=_outside_env(),
    )
    # Only now the running interpreter's packages, as plain directories (their `.pth` files,
    # such as an editable eqx_lean's, are not processed; pip, had it seen that eqx_lean's
    # metadata, would have found the requirement satisfied); the new environment's own come
    # first on `sys.path`.
    ours = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (purelib / "_outer_packages.pth").write_text("\n".join(sorted(ours)) + "\n")
    installed = time.perf_counter() - start
    assert installed < 60, f"the offline install took {installed:.1f} s"
    work = pathlib.Path(tmp_path_factory.mktemp("outside"))
    done = _run(_finetune_command(python), cwd=work, env=_outside_env(), timeout=300)
    assert f"eqx_lean from {purelib.resolve()}" in done.stdout, done.stdout
    print(done.stdout)


def _online() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_pip_install_hf_extra_from_the_index(tmp_path: pathlib.Path):
    """`pip install ".[hf]"` in a plain virtual environment, from the package index (all of the
    `hf` extra's dependencies downloaded), then the same fine-tuning run."""
    if not _online():
        pytest.skip("no network: pypi.org:443 cannot be reached, so nothing can be downloaded")
    venv = tmp_path / "env"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    _run(
        [str(python), "-m", "pip", "install", f"{ROOT}[hf]"],
        env=_outside_env(),
        cwd=tmp_path,
        timeout=1800,
    )
    done = _run(_finetune_command(python), cwd=tmp_path, env=_outside_env(), timeout=600)
    assert "losses" in done.stdout
