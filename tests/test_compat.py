"""Private JAX in one place (`_compat.py`): version-gated, each use with a tested fallback.

Every fallback is forced here, and the library must then give exactly the values of the normal
path, eagerly and under `jit`, `vmap`, `grad` and `eqx.filter_eval_shape`.
"""

import subprocess
import sys
import tomllib
import types
from importlib import metadata
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from harness import TINY_BLOCK, GPTBlock, assert_bitwise_equal
from packaging.requirements import Requirement

import eqx_lean
from eqx_lean.internal import (
    can_override_lowering,
    compat,
    has_custom_transpose,
    private_jax_allowed,
    shard_alike,
    without_private_jax,
)


WORKER = Path(__file__).with_name("workers") / "private_jax_env.py"
KEYS = jax.random.split(jax.random.key(3), 3)


def make_block(key):
    return GPTBlock(TINY_BLOCK, key=key)


def scaled_draw(scale):
    # Large enough (>= 2**16 counters) to take the unrolled hash when the override is on.
    return lambda key: {"w": jax.random.normal(key, (256, 300)) * scale, "b": jnp.zeros(3)}


def every_use(tmp_path):
    """Build, load and scan eagerly and under each transformation; a dict of results."""
    results = {}
    results["build"] = eqx_lean.build_stacked(make_block, KEYS, jnp.bfloat16)
    results["build/jit"] = jax.jit(
        lambda keys: eqx_lean.build_stacked(make_block, keys, jnp.bfloat16)
    )(KEYS)
    results["build/eval_shape"] = eqx.filter_eval_shape(
        eqx_lean.build_stacked, make_block, KEYS, jnp.bfloat16
    )
    results["build/vmap"] = jax.vmap(lambda s: eqx_lean.build_stacked(scaled_draw(s), KEYS))(
        jnp.array([1.0, 2.0])
    )
    results["build/grad"] = jax.grad(
        lambda s: eqx_lean.build_stacked(scaled_draw(s), KEYS)["w"].sum()
    )(1.5)

    names = lambda path, _: "layers.{i}" + jax.tree_util.keystr(path)  # noqa: E731
    eqx_lean.save_stacked(tmp_path / "ckpt", results["build"], names)
    like = eqx.filter_eval_shape(eqx_lean.build_stacked, make_block, KEYS, jnp.bfloat16)
    results["load"] = eqx_lean.load_stacked(tmp_path / "ckpt", like, names)

    stacked = eqx_lean.build_stacked(lambda k: eqx.nn.Linear(16, 16, key=k), KEYS)
    x = jnp.linspace(-1, 1, 16)

    def run(stacked, x):
        return eqx_lean.fold(stacked, x, call=lambda layer, x: x + 0.1 * jnp.tanh(layer(x)))

    results["scan"] = run(stacked, x)
    results["scan/jit"] = jax.jit(run)(stacked, x)
    results["scan/vmap"] = jax.vmap(run, in_axes=(None, 0))(stacked, x[None])
    results["scan/grad"] = jax.grad(lambda s, x: run(s, x).sum())(stacked, x)
    results["scan/eval_shape"] = eqx.filter_eval_shape(run, stacked, x)
    return results


@pytest.mark.private_jax
def test_private_apis_are_used_on_the_tested_jax():
    assert private_jax_allowed()
    assert can_override_lowering()
    assert has_custom_transpose()


def test_another_jax_series_takes_the_fallbacks(monkeypatch):
    monkeypatch.setattr(jax, "__version_info__", (0, 11, 0))
    assert not private_jax_allowed()
    assert not can_override_lowering()
    assert not has_custom_transpose()


def test_forced_fallbacks_give_the_same_values(tmp_path):
    normal = every_use(tmp_path / "normal")
    with without_private_jax():
        assert not can_override_lowering()
        eqx_lean.clear_caches()  # so nothing compiled with the private path is reused
        fallback = every_use(tmp_path / "fallback")
    assert sorted(normal) == sorted(fallback)
    for name in normal:
        assert_bitwise_equal(fallback[name], normal[name])


def test_a_jax_without_the_lowering_hook_takes_the_fallback(monkeypatch, tmp_path):
    # As if `Traced.lower` had no `_private_parameters`, and `jax.interpreters.mlir` no longer
    # imported: JAX's own lowering, the same values.
    normal = eqx_lean.build_stacked(make_block, KEYS, jnp.bfloat16)
    import jax.interpreters

    monkeypatch.delattr(jax.interpreters, "mlir")
    monkeypatch.setitem(sys.modules, "jax.interpreters.mlir", None)
    compat._lowering_api.cache_clear()
    try:
        assert compat._lowering_api() is None
        assert not can_override_lowering()
        eqx_lean.clear_caches()
        assert_bitwise_equal(eqx_lean.build_stacked(make_block, KEYS, jnp.bfloat16), normal)
    finally:
        compat._lowering_api.cache_clear()
        eqx_lean.clear_caches()


@pytest.fixture
def shard_alike_cache():
    compat._find_shard_alike.cache_clear()
    yield
    compat._find_shard_alike.cache_clear()


def test_shard_alike_is_found_where_this_jax_keeps_it(shard_alike_cache):
    from jax.experimental.shard_alike import shard_alike as jax_shard_alike

    assert compat._find_shard_alike() is jax_shard_alike


def _tied(x, y):
    return ("tied", x), ("tied", y)


def only_home(monkeypatch, home):
    """Every home of `shard_alike` but `home` (a module name, or None) is without it; `home`
    has a fake one (`_tied`). Modules that only exist for it are replaced in `sys.modules`;
    JAX's own modules (`jax`, `jax.sharding`, `jax.lax`) get or lose the attribute."""
    for name in (*compat._SHARD_ALIKE_HOMES, compat._SHARD_ALIKE_PRIVATE_HOME):
        if name in ("jax.experimental.shard_alike", compat._SHARD_ALIKE_PRIVATE_HOME):
            module = types.ModuleType(name)
            if name == home:
                module.shard_alike = _tied  # pyright: ignore[reportAttributeAccessIssue]
            monkeypatch.setitem(sys.modules, name, module)
        elif name == home:
            monkeypatch.setattr(sys.modules[name], "shard_alike", _tied, raising=False)
        else:
            monkeypatch.delattr(sys.modules[name], "shard_alike", raising=False)


# JAX 0.10-0.11.1.dev keep it in `jax.experimental.shard_alike` (docs/jax-compat.md); the
# others are where a later JAX may move it.
@pytest.mark.parametrize("home", ["jax.experimental.shard_alike", "jax.sharding", "jax.lax", "jax"])
def test_shard_alike_is_found_in_each_public_home(monkeypatch, shard_alike_cache, home):
    only_home(monkeypatch, home)
    assert compat._find_shard_alike() is _tied
    with without_private_jax():
        assert shard_alike(1, 2) == (("tied", 1), ("tied", 2))


def test_the_private_home_of_shard_alike_is_searched_only_where_private_jax_is_allowed(
    monkeypatch, shard_alike_cache
):
    only_home(monkeypatch, compat._SHARD_ALIKE_PRIVATE_HOME)
    assert compat._find_shard_alike(True) is _tied
    assert compat._find_shard_alike(False) is None
    with without_private_jax():
        with pytest.raises(NotImplementedError, match="needs `shard_alike`"):
            shard_alike(jnp.arange(3.0), jnp.zeros(3))  # the suite's process has 8 devices


@pytest.mark.private_jax
def test_shard_alike_takes_its_private_home_on_the_tested_jax(monkeypatch, shard_alike_cache):
    only_home(monkeypatch, compat._SHARD_ALIKE_PRIVATE_HOME)
    assert shard_alike(1, 2) == (("tied", 1), ("tied", 2))


def test_a_jax_without_shard_alike_runs_on_one_device_and_says_so_on_several(
    monkeypatch, shard_alike_cache
):
    # JAX 0.11.2 (seen on a lent GPU machine) has no `jax.experimental.shard_alike`; a single
    # device needs nothing tied, several cannot do without it.
    x, y = jnp.arange(3.0), jnp.zeros(3)
    only_home(monkeypatch, None)
    assert compat._find_shard_alike(False) is None
    assert compat._find_shard_alike(True) is None
    # The suite's process has 8 devices (conftest): the one-device case is patched in.
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    tied_x, tied_y = shard_alike(x, y)
    assert tied_x is x and tied_y is y
    monkeypatch.setattr(jax, "device_count", lambda: 8)
    with pytest.raises(NotImplementedError, match="needs `shard_alike`.*use JAX 0.10"):
        shard_alike(x, y)


def test_the_jax_requirement_admits_the_series_read_from_source_and_no_newer():
    # docs/jax-compat.md reads each API eqx_lean uses in JAX's sources up to
    # `NEWEST_JAX_SERIES_READ`: pyproject.toml admits JAX and jaxlib that far (and the JAX
    # installed here), and not the next series.
    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    requirements = {Requirement(text).name: Requirement(text) for text in dependencies}
    major, minor = compat.NEWEST_JAX_SERIES_READ
    for name in ("jax", "jaxlib"):
        specifier = requirements[name].specifier
        assert specifier.contains(metadata.version(name)), (name, str(specifier))
        assert specifier.contains(f"{major}.{minor}.9"), (name, str(specifier))
        assert not specifier.contains(f"{major}.{minor + 1}.0"), (name, str(specifier))


@pytest.mark.parametrize("value", ["1", "0"])
def test_the_environment_variable_forces_the_fallbacks(value):
    env = {"EQX_LEAN_NO_PRIVATE_JAX": value, "JAX_PLATFORMS": "cpu", "PATH": ""}
    out = subprocess.run(
        [sys.executable, str(WORKER)], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == ("False" if value == "1" else "True")
    keys = jax.random.split(jax.random.key(0), 2)
    expected = float(jax.vmap(lambda k: jax.random.normal(k, (256, 300)))(keys).sum())
    assert float(out[1]) == pytest.approx(expected, rel=1e-6)
