"""The Orbax recipe (`docs/orbax.md`) runs as written, and does what the page says.

Its code blocks run in page order in one fresh interpreter on 8 forced CPU devices, with real
`orbax-checkpoint`, in a scratch directory; then the checks below run in the same namespace:
the restored and the loaded stacks hold the saved values in the target's shardings, and
`fold` on them (and on the layer-sharded restore, once resharded as the page shows) gives the
output of a Python loop over `eqx_lean.unstack` of the saved model. A stack restored with its
layer axis sharded is refused by `fold` with eqx_lean's message, not JAX's.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from test_docs import code_blocks


ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = "docs/orbax.md"

_CHECKS = textwrap.dedent(
    """
    import numpy as np

    def arrays(tree):
        return jax.tree.leaves(eqx.filter(tree, eqx.is_array))

    def bits(x):
        return np.asarray(x).view(np.uint16)  # bfloat16, compared bitwise

    assert len(jax.devices()) == 8
    reference = jnp.ones(8, jnp.bfloat16)
    for layer in eqx_lean.unstack(stacked):
        reference = layer(reference)

    # The restore and the load: the saved values, in the target's shardings (layer axis
    # replicated), each device holding a quarter of each layer.
    for name, tree in [("restored", restored), ("loaded", loaded)]:
        for a, b, t in zip(arrays(tree), arrays(stacked), jax.tree.leaves(target), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert a.sharding.spec == P(None, "model"), (name, a.sharding)
            assert a.sharding.is_equivalent_to(t.sharding, a.ndim), (name, a.sharding)
            assert a.addressable_shards[0].data.shape[:2] == (4, a.shape[1] // 4), name
            np.testing.assert_array_equal(bits(a), bits(b))
        out = eqx_lean.fold(tree, jnp.ones(8, jnp.bfloat16), num_layers=4)
        np.testing.assert_array_equal(bits(out), bits(reference))
    np.testing.assert_array_equal(bits(y), bits(reference))  # the page's last fold

    # The layer-sharded restore: 2 layers per device; refused by `fold` as it is.
    for a in arrays(by_stage):
        assert a.sharding.spec[0] == "layers" and a.addressable_shards[0].data.shape[0] == 2
    try:
        eqx_lean.fold(by_stage, jnp.ones(8, jnp.bfloat16))
    except ValueError as e:
        message = str(e)
        assert "`stacked.layers[0].weight`" in message, message
        assert "sharded over mesh axis 'layers'" in message, message
        assert "NamedSharding(mesh, P(None, 'model', None))" in message, message
    else:
        raise AssertionError("fold ran a stack whose layer axis is sharded")
    runnable = jax.tree.map(replicate_layer_axis, by_stage)
    for a in arrays(runnable):
        assert a.sharding.spec == P(None, "model"), a.sharding
    out = eqx_lean.fold(runnable, jnp.ones(8, jnp.bfloat16), num_layers=4)
    np.testing.assert_array_equal(bits(out), bits(reference))

    # `load_stacked` refuses the layer-sharded target, and its advice works: specs that start
    # with None, and `layer_axis=` to shard the layer axis.
    staged_target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(stages, P("layers", "model"))
        ),
        params,
    )
    try:
        eqx_lean.load_stacked(
            "safetensors_ckpt", eqx.combine(staged_target, static), names, layer_axis="layers"
        )
    except ValueError as e:
        message = str(e)
        assert "leaf .layers[0].weight carries the stacked sharding" in message, message
        assert "here P(None, 'model')" in message and "layer_axis='layers'" in message, message
    else:
        raise AssertionError("load_stacked took a target that shards the layer axis")
    advised = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(stages, P(None, "model"))
        ),
        params,
    )
    staged = eqx_lean.load_stacked(
        "safetensors_ckpt", eqx.combine(advised, static), names, layer_axis="layers"
    )
    for a, b in zip(arrays(staged), arrays(by_stage), strict=True):
        assert a.sharding == b.sharding, (a.sharding, b.sharding)
        np.testing.assert_array_equal(bits(a), bits(b))
    print("ok")
    """
)


def test_orbax_page_runs_and_its_targets_run_under_fold_and_load(tmp_path: pathlib.Path):
    pytest.importorskip("orbax.checkpoint")
    blocks = [b for b in code_blocks(PAGE) if b.language == "python"]
    assert len(blocks) == 4 and not any(b.not_run for b in blocks)
    script = "\n".join([*(b.code for b in blocks), _CHECKS])
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert done.stdout.strip().endswith("ok")
