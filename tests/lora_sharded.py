"""Run by `tests/test_lora.py` in a process with 8 forced CPU devices: LoRA adapters of a
sharded base are sharded like it (`A`'s input dim as the base's, `B`'s output dim as the
base's, the rank replicated, the layer axis as the base's), and a sharded forward matches."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_lean
from eqx_lean.lora import LoraConfig, add_lora, load_adapters, save_adapters


def main(directory: str) -> None:
    assert len(jax.devices()) == 8
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    keys = jax.random.split(jax.random.key(0), 4)
    stacked = eqx_lean.build_stacked(lambda k: eqx.nn.Linear(16, 16, use_bias=False, key=k), keys)
    stacked = eqx.tree_at(
        lambda m: m.weight,
        stacked,
        jax.device_put(stacked.weight, NamedSharding(mesh, P(None, "model", "data"))),
    )
    head = eqx.nn.Linear(16, 8, key=jax.random.key(1))
    head = eqx.tree_at(
        lambda m: m.weight, head, jax.device_put(head.weight, NamedSharding(mesh, P("data", None)))
    )
    model = {"layers": stacked, "head": head}
    config = LoraConfig(r=2, target_modules="all-linear")
    lora = add_lora(model, config, key=jax.random.key(2))
    layers, out = lora["layers"], lora["head"]
    assert layers.lora_A.sharding.spec == P(None, None, "data"), layers.lora_A.sharding
    assert layers.lora_B.sharding.spec == P(None, "model", None), layers.lora_B.sharding
    assert out.lora_A.sharding.spec == P(None, None), out.lora_A.sharding
    assert out.lora_B.sharding.spec == P("data", None), out.lora_B.sharding

    # A layer axis sharded in the base is sharded in the adapters too.
    by_layer = eqx.tree_at(
        lambda m: m.weight,
        stacked,
        jax.device_put(stacked.weight, NamedSharding(mesh, P("data", "model", None))),
    )
    adapted = add_lora(by_layer, LoraConfig(r=2, target_modules=".*"), key=jax.random.key(3))
    assert adapted.lora_A.sharding.spec == P("data", None, None), adapted.lora_A.sharding
    assert adapted.lora_B.sharding.spec == P("data", "model", None), adapted.lora_B.sharding

    # The same values as unsharded, and loaded adapters are placed like fresh ones.
    plain = add_lora(jax.device_get(model), config, key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(layers.lora_A), np.asarray(plain["layers"].lora_A))

    def names(path, leaf):
        del leaf
        key = jax.tree_util.keystr(path)
        return key.replace("['layers'].", "layers.{i}.").replace("['head'].", "head.")

    lora = eqx.tree_at(lambda m: m["layers"].lora_B, lora, jnp.ones_like(layers.lora_B))
    save_adapters(lora, directory, names)
    loaded = load_adapters(model, directory, names)
    assert loaded["layers"].lora_A.sharding.spec == P(None, None, "data")
    assert loaded["layers"].lora_B.sharding.spec == P(None, "model", None)
    x = jnp.ones((3, 16))
    y = eqx_lean.fold(loaded["layers"], x, call=lambda layer, h: jnp.tanh(layer.project(h)) * 2)
    want = eqx_lean.fold(lora["layers"], x, call=lambda layer, h: jnp.tanh(layer.project(h)) * 2)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6)
    print("ok")


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
