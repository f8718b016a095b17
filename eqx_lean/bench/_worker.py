"""Runs one construction method in this (fresh) process and prints its figures as JSON.

Invoked by `python -m eqx_lean.bench` as `python -m eqx_lean.bench._worker METHOD CONFIG_JSON`,
so that every method starts from the same idle process.
"""

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_lean
from eqx_lean._core import tree_bytes
from eqx_lean._rss import file_rss_bytes, peak_rss_bytes, rss_bytes

from ._models import Block, BlockConfig, Embeddings


def cast_floating(tree: Any, dtype: Any) -> Any:
    def cast(x):
        return x.astype(dtype) if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)


def _vmap_eager(make, keys, dtype):
    return cast_floating(eqx.filter_vmap(make)(keys), dtype)


def _vmap_jit(make, keys, dtype):
    return eqx.filter_jit(lambda k: cast_floating(eqx.filter_vmap(make)(k), dtype))(keys)


def _list_stack(make, keys, dtype):
    layers = [make(k) for k in keys]
    return cast_floating(jax.tree.map(lambda *xs: jnp.stack(xs), *layers), dtype)


def _build_stacked(make, keys, dtype):
    return eqx_lean.build_stacked(make, keys, dtype)


METHODS: dict[str, Callable[..., Any]] = {
    "filter_vmap": _vmap_eager,
    "filter_jit(filter_vmap)": _vmap_jit,
    "list + jnp.stack": _list_stack,
    "build_stacked": _build_stacked,
}


def run(method: str, config: BlockConfig, dtype: Any, seed: int = 0) -> dict[str, Any]:
    jax.devices()
    key_blocks, key_embed = jax.random.split(jax.random.key(seed))
    keys = jax.random.split(key_blocks, config.num_layers)
    jax.block_until_ready(keys)
    idle = rss_bytes()
    file_idle = file_rss_bytes()

    start = time.perf_counter()
    embeddings = None
    if config.vocab:
        # Built before the stack exists: its Threefry temporaries (about 2 GiB for a
        # 32000 x 4096 table) then never sit on top of the final model.
        embeddings = eqx.filter_jit(lambda k: cast_floating(Embeddings(config, key=k), dtype))(
            key_embed
        )
        jax.block_until_ready(embeddings)
    make = lambda k: Block(config, key=k)  # noqa: E731
    blocks = METHODS[method](make, keys, dtype)
    jax.block_until_ready(blocks)
    seconds = time.perf_counter() - start

    peak = peak_rss_bytes()
    final = tree_bytes(blocks) + tree_bytes(embeddings)
    return {
        "method": method,
        "idle_bytes": idle,
        "peak_over_idle_bytes": peak - idle,
        "final_bytes": final,
        "ratio": (peak - idle) / final,
        "seconds": seconds,
        # File-backed pages count in RSS; if other processes' memory pressure evicts some, the
        # peak over idle comes out low. This drop (normally about zero) tells such runs apart.
        "file_rss_drop_bytes": file_idle - file_rss_bytes(),
    }


def main() -> None:
    method, config_json = sys.argv[1], sys.argv[2]
    fields = json.loads(config_json)
    dtype = jnp.dtype(fields.pop("dtype"))
    print(json.dumps(run(method, BlockConfig(**fields), dtype)))


if __name__ == "__main__":
    main()
