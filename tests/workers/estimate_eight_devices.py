"""Run by `tests/test_memory.py` with 8 forced CPU devices (`XLA_FLAGS`): estimates and builds
a stack of 4 MLPs in bfloat16 sharded by `eqx_lean.fsdp` over the 8 devices, places a replicated
float32[1000] array, and prints as one JSON line the estimate's figures and tables beside what
was built (its bytes, those on device 0) and what `eqx_lean.memory.live_arrays` reports of the
replicated array.

Its own process, because `live_arrays` reports every array alive in the process: in a fresh one,
the only float32[1000] array is the one placed here.

    python tests/workers/estimate_eight_devices.py  # XLA_FLAGS: 8 forced devices
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_lean


def make(key):
    return eqx.nn.MLP(64, 64, 256, 2, key=key)


def main() -> None:
    mesh = jax.make_mesh((8,), ("d",))
    keys = jax.random.split(jax.random.key(0), 4)
    rule = eqx_lean.fsdp(mesh, "d")
    e = eqx_lean.memory.estimate(make, keys, jnp.bfloat16, rule)
    built = eqx_lean.build_stacked(make, keys, jnp.bfloat16, rule)
    leaves = jax.tree.leaves(eqx.filter(built, eqx.is_array))
    on_device_0 = sum(
        s.data.nbytes for x in leaves for s in x.addressable_shards if s.device.id == 0
    )
    replicated = jax.device_put(jnp.zeros((1000,), jnp.float32), NamedSharding(mesh, P()))
    report = eqx_lean.memory.live_arrays(top=None)
    group = [g for g in report.groups if g.shape == (1000,) and g.dtype == "float32"]
    unsharded = eqx_lean.memory.estimate(make, keys, jnp.bfloat16)
    figures = {
        "final": e.final_bytes,
        "per_device": e.final_bytes_per_device,
        "devices": e.num_devices,
        "built": sum(x.nbytes for x in leaves),
        "on_device_0": on_device_0,
        "replicated": group[0].nbytes,
        "sharding": group[0].sharding,
        "table": e.table(),
        "unsharded_table": unsharded.table(),
        "peaks": [e.build_stacked_peak, e.filter_vmap_peak, e.filter_jit_vmap_peak],
        "leaf_shardings": [x.sharding for x in e.leaves],
        "leaf_per_device": sum(x.nbytes_per_device for x in e.leaves),
    }
    del replicated  # alive until `live_arrays` has reported it
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
