"""A saver and a loader racing on one checkpoint, each in its own process (`test_io_race.py`).

    python tests/io_race.py save PATH FILES SECONDS   # FILES: single or sharded; prints
                                                      # {"saves": n} at the end
    python tests/io_race.py load PATH SECONDS   # prints a JSON summary on its last line

`tests/test_io_race.py` and `benchmarks/load_race.py` run it.

Every tensor of save number `s` holds the value `1000 * s + t` everywhere, `t` the tensor's
own number, so a load tells exactly which save each tensor came from: a whole checkpoint has
one `s` in every tensor and each tensor's own `t`. Between saves the saver changes the order
of the tensors in the files (so a name's offset changes) and, with `sharded` files, which
shard holds which tensor (so a shard's content changes, not its name): reading a header of one
save with the data of the next, or a shard of each, is seen.
"""

import json
import sys
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import eqx_lean


NUM_LAYERS = 4
# name template, per-layer shape; ten tensors of 1 KiB to 8 KiB
LEAVES = {
    "w": ("layers.{i}.w", (32, 64)),
    "b": ("layers.{i}.b", (256,)),
    "emb": ("embed", (64, 16)),
    "head": ("head", (16, 64)),
}


def tensor_numbers() -> dict[str, int]:
    """Each tensor's own number `t`, by tensor name."""
    names = []
    for template, _ in LEAVES.values():
        if "{i}" in template:
            names += [template.format(i=i) for i in range(NUM_LAYERS)]
        else:
            names.append(template)
    return {name: t for t, name in enumerate(sorted(names))}


def _shape(key: str) -> tuple[int, ...]:
    template, shape = LEAVES[key]
    return (NUM_LAYERS, *shape) if "{i}" in template else shape


def like() -> dict[str, jax.ShapeDtypeStruct]:
    return {key: jax.ShapeDtypeStruct(_shape(key), jnp.float32) for key in LEAVES}


def names(path, _leaf) -> str:
    return LEAVES[path[-1].key.split("/")[-1]][0]


def model_of_save(s: int, order: list[str]) -> dict[str, jax.Array]:
    """Save `s`'s model. Dict keys flatten sorted, so prefixing the keys by `order` sets the
    order in which the tensors are written."""
    numbers = tensor_numbers()
    model = {}
    for rank, key in enumerate(order):
        template, _ = LEAVES[key]
        if "{i}" in template:
            values = [1000.0 * s + numbers[template.format(i=i)] for i in range(NUM_LAYERS)]
            value = np.broadcast_to(
                np.array(values, np.float32).reshape(-1, *([1] * len(LEAVES[key][1]))),
                _shape(key),
            )
        else:
            value = np.full(_shape(key), 1000.0 * s + numbers[template], np.float32)
        model[f"{rank}/{key}"] = jnp.asarray(value)
    return model


def save_loop(path: str, files: str, seconds: float) -> None:
    rng = np.random.default_rng(0)
    deadline = time.monotonic() + seconds
    s = 0
    while s == 0 or time.monotonic() < deadline:
        order = list(rng.permutation(list(LEAVES)))
        # 1 file; or 2, 3 or 5 shards, their boundaries moving with the order
        shard_bytes = 2**30 if files == "single" else int(rng.choice([4096, 8192, 20000]))
        eqx_lean.save_tensors(path, model_of_save(s, order), names, max_shard_bytes=shard_bytes)
        s += 1
        if s == 1:
            print("first save done", flush=True)
    print(json.dumps({"saves": s}), flush=True)


def classify(loaded: dict[str, Any]) -> str:
    """`whole` (every tensor of one save), or `mixed`."""
    numbers = tensor_numbers()
    saves = set()
    for key, array in loaded.items():
        template, _ = LEAVES[key]
        values = np.asarray(array)
        layers = range(NUM_LAYERS) if "{i}" in template else [None]
        for i in layers:
            part = values if i is None else values[i]
            name = template if i is None else template.format(i=i)
            distinct = np.unique(part)
            if distinct.size != 1:
                return "mixed"
            s, t = divmod(int(distinct[0]), 1000)
            if t != numbers[name] or distinct[0] != 1000.0 * s + t:
                return "mixed"
            saves.add(s)
    return "whole" if len(saves) == 1 else "mixed"


def load_loop(path: str, seconds: float) -> None:
    # Absent before eqx_lean 0.3.0, whose loads `benchmarks/load_race.py --code` also races.
    replaced = getattr(eqx_lean, "CheckpointReplacedError", ())
    counts = {"whole": 0, "mixed": 0, "replaced": 0, "other": 0}
    others: list[str] = []
    target = like()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            loaded = eqx_lean.load_tensors(path, target, names)
        except replaced:
            counts["replaced"] += 1
            continue
        except Exception:
            counts["other"] += 1
            others.append(traceback.format_exc(limit=3)[-600:])
            continue
        counts[classify(loaded)] += 1
    print(json.dumps({**counts, "errors": others[:3]}), flush=True)


if __name__ == "__main__":
    role, path, *rest = sys.argv[1:]
    if role == "save":
        save_loop(path, rest[0], float(rest[1]))
    else:
        load_loop(path, float(rest[0]))
