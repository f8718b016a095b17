"""The Orbax recipe (`docs/orbax.md`) runs as written, and does what the page says.

Its code blocks run in page order in one namespace, in this process on the suite's 8 CPU
devices, with real `orbax-checkpoint`, in a scratch directory (a module fixture, run once);
then the tests below check that namespace: the restored and the loaded stacks hold the saved
values in the target's shardings, and `fold` on them (and on the layer-sharded restore, once
resharded as the page shows) gives the output of a Python loop over `eqx_lean.unstack` of the
saved model. A stack restored with its layer axis sharded is refused by `fold` with eqx_lean's
message, not JAX's; so is a layer-sharded target by `load_stacked`, whose advice works.
"""

from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import arrays, bits
from jax.sharding import NamedSharding, PartitionSpec as P
from test_docs import code_blocks

import eqx_lean


# The page's meshes span the eight forced CPU devices (on a GPU machine too).
pytestmark = pytest.mark.cpu_mesh


PAGE = "docs/orbax.md"


class Page(NamedTuple):
    names: dict[str, Any]  # the namespace the page's blocks ran in
    directory: Path  # where they ran: their relative paths are relative to it


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    pytest.importorskip("orbax.checkpoint")
    # The page's meshes (2 x 4) span every device: a quarter of each layer on each.
    assert jax.device_count() == 8
    blocks = [b for b in code_blocks(PAGE) if b.language == "python"]
    assert len(blocks) == 4 and not any(b.not_run for b in blocks)
    directory = tmp_path_factory.mktemp("orbax")
    names: dict[str, Any] = {"__name__": "__main__"}  # as in a script of the page's code
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(directory)
        for block in blocks:
            exec(compile(block.code, f"{PAGE}:{block.line}", "exec"), names)
    yield Page(names, directory)
    names["checkpointer"].close()


@pytest.fixture(scope="module")
def reference(page) -> jax.Array:
    """The saved model's output: a Python loop over `eqx_lean.unstack` of it."""
    out = jnp.ones(8, jnp.bfloat16)
    for layer in eqx_lean.unstack(page.names["stacked"]):
        out = layer(out)
    return out


@pytest.mark.parametrize("name", ["restored", "loaded"])
def test_the_restore_and_the_load_hold_the_saved_values_in_the_target_s_shardings(
    page, reference, name
):
    """The layer axis replicated, each device holding a quarter of each layer; `fold` on them
    gives the loop's output."""
    tree, stacked, target = (page.names[k] for k in (name, "stacked", "target"))
    for a, b, t in zip(arrays(tree), arrays(stacked), jax.tree.leaves(target), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.sharding.spec == P(None, "model"), (name, a.sharding)
        assert a.sharding.is_equivalent_to(t.sharding, a.ndim), (name, a.sharding)
        assert a.addressable_shards[0].data.shape[:2] == (4, a.shape[1] // 4), name
        np.testing.assert_array_equal(bits(a), bits(b))
    out = eqx_lean.fold(tree, jnp.ones(8, jnp.bfloat16), num_layers=4)
    np.testing.assert_array_equal(bits(out), bits(reference))


def test_the_page_s_last_fold_gives_the_loop_s_output(page, reference):
    np.testing.assert_array_equal(bits(page.names["y"]), bits(reference))


def test_fold_refuses_the_layer_sharded_restore_and_runs_it_resharded(page, reference):
    """2 layers per device; refused by `fold` as it is, naming the leaf and the fix; resharded
    with the page's `replicate_layer_axis`, the loop's output."""
    by_stage = page.names["by_stage"]
    for a in arrays(by_stage):
        assert a.sharding.spec[0] == "layers" and a.addressable_shards[0].data.shape[0] == 2
    with pytest.raises(ValueError) as caught:
        eqx_lean.fold(by_stage, jnp.ones(8, jnp.bfloat16))
    message = str(caught.value)
    assert "`stacked.layers[0].weight`" in message, message
    assert "sharded over mesh axis 'layers'" in message, message
    assert "NamedSharding(mesh, P(None, 'model', None))" in message, message
    runnable = jax.tree.map(page.names["replicate_layer_axis"], by_stage)
    for a in arrays(runnable):
        assert a.sharding.spec == P(None, "model"), a.sharding
    out = eqx_lean.fold(runnable, jnp.ones(8, jnp.bfloat16), num_layers=4)
    np.testing.assert_array_equal(bits(out), bits(reference))


def test_load_stacked_refuses_a_layer_sharded_target_and_its_advice_works(page):
    """Specs that start with None, and `layer_axis=` to shard the layer axis: the layout and
    values of the layer-sharded restore."""
    params, static, stages, names, by_stage = (
        page.names[k] for k in ("params", "static", "stages", "names", "by_stage")
    )
    checkpoint = page.directory / "safetensors_ckpt"

    def target_of(spec):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(stages, spec)),
            params,
        )

    staged_target = target_of(P("layers", "model"))
    with pytest.raises(ValueError) as caught:
        eqx_lean.load_stacked(
            checkpoint, eqx.combine(staged_target, static), names, layer_axis="layers"
        )
    message = str(caught.value)
    assert "leaf .layers[0].weight carries the stacked sharding" in message, message
    assert "here P(None, 'model')" in message and "layer_axis='layers'" in message, message
    advised = target_of(P(None, "model"))
    staged = eqx_lean.load_stacked(
        checkpoint, eqx.combine(advised, static), names, layer_axis="layers"
    )
    for a, b in zip(arrays(staged), arrays(by_stage), strict=True):
        assert a.sharding == b.sharding, (a.sharding, b.sharding)
        np.testing.assert_array_equal(bits(a), bits(b))
