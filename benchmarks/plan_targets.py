"""Planning times on this machine for 7B and 175B builds and steps on compile-only targets.

    JAX_PLATFORMS=cpu python benchmarks/plan_targets.py            # every case, a process each
    JAX_PLATFORMS=cpu python benchmarks/plan_targets.py build-7b 8xh100   # one case

Cases: `build-7b` (the 32 Mistral-7B blocks built fsdp-sharded, `eqx_lean.memory.estimate`;
`build-7b-rows` compiles its programs one at a time and prints each one's time),
`lora-7b` (one LoRA AdamW step, rank 16 on all seven projections, remat=True, 256 tokens per
row, a row per device), `build-175b` (96 GPT-NeoX-shaped blocks, d=12288, MLP 4d, fsdp over
256 GPUs), `fit-7b` (`eqx_lean.memory.fit` of the LoRA step over three remat modes).
"""

import os
import re
import subprocess
import sys
import time


CASES = [
    ("build-7b", "8xh100", 60),
    ("build-7b", "v5e-16", 60),
    ("lora-7b", "8xh100", 60),
    ("lora-7b", "v5e-16", 60),
    ("build-175b", "32x8xh100", 180),
    ("fit-7b", "8xh100", 300),
]


def _mesh(where):
    import jax

    n = len(where.devices)
    return where.mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def build_7b(spec):
    import jax
    import jax.numpy as jnp

    import eqx_lean
    from eqx_lean import memory
    from eqx_lean.hf import DecoderConfig, make_block

    where = memory.target(spec)
    mesh = _mesh(where)
    config = DecoderConfig()
    keys = jax.random.split(jax.random.key(0), config.num_hidden_layers)
    est = memory.estimate(
        lambda k: make_block(config, key=k), keys, jnp.bfloat16, eqx_lean.fsdp(mesh), mesh=mesh
    )
    return est.build_stacked_peak, est.build_stacked_peak <= where.device_memory


def build_7b_rows(spec):
    """`build-7b`, each of `estimate`'s programs compiled in turn and timed (printed)."""
    import jax

    from eqx_lean.internal import compile_writes, memory_estimates

    def one_by_one(plan, lowered):
        start = time.perf_counter()
        writes = compile_writes(plan)
        print(f"ROW\tbuild_stacked writes\t{time.perf_counter() - start:.1f} s", flush=True)
        compiled = {}
        for name, program in lowered.items():
            start = time.perf_counter()
            compiled[name] = program.compile()
            seconds = time.perf_counter() - start
            if isinstance(name, str):
                what = name
            else:  # (primitive, its params as text, input structs): name the jitted function
                called = re.search(r"'name': '(\w+)'", name[1])
                out = jax.tree.leaves(compiled[name].out_info)[0]
                what = f"eager {called.group(1) if called else name[0]} -> {out.shape}"
            print(f"ROW\t{what}\t{seconds:.1f} s", flush=True)
        return writes, compiled

    memory_estimates._compile_side_by_side = one_by_one
    return build_7b(spec)


def build_175b(spec):
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import eqx_lean
    from eqx_lean import memory

    d = 12288

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        qkv: eqx.nn.Linear
        out: eqx.nn.Linear
        ln2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k = jax.random.split(key, 4)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
            self.qkv = eqx.nn.Linear(d, 3 * d, key=k[0])
            self.out = eqx.nn.Linear(d, d, key=k[1])
            self.up = eqx.nn.Linear(d, 4 * d, key=k[2])
            self.down = eqx.nn.Linear(4 * d, d, key=k[3])

    where = memory.target(spec)
    mesh = _mesh(where)
    keys = jax.random.split(jax.random.key(0), 96)
    est = memory.estimate(Block, keys, jnp.bfloat16, eqx_lean.fsdp(mesh), mesh=mesh)
    return est.build_stacked_peak, est.build_stacked_peak <= where.device_memory


def _lora_7b(where):
    """The abstract LoRA model, fsdp-sharded as `eqx_lean.hf.plan_lora_step` shards it."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from eqx_lean import lora
    from eqx_lean.hf import DecoderConfig, fsdp_shardings, lora_config_of_rank
    from eqx_lean.internal import abstract_lora_model

    mesh = _mesh(where)
    n = len(where.devices)
    model = eqx.filter_eval_shape(
        abstract_lora_model, DecoderConfig(), lora_config_of_rank(16), jnp.bfloat16
    )
    model = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        model,
        fsdp_shardings(model, mesh, axis="data"),
    )

    def make_batch(rows):
        return (
            jax.ShapeDtypeStruct((rows, 256), jnp.int32, sharding=NamedSharding(mesh, P("data"))),
        )

    return model, make_batch, lora.lora_filter(model), n


def _make_loss(remat):
    from eqx_lean.hf import next_token_loss

    return lambda model, ids: next_token_loss(model, ids, remat=remat)


def lora_7b(spec):
    from eqx_lean import memory
    from eqx_lean.hf import DecoderConfig, plan_lora_step

    where = memory.target(spec)
    plan = plan_lora_step(DecoderConfig(), where, batch_size=len(where.devices), seq_len=256)
    print(plan)
    return plan.peak, plan.fits


def fit_7b(spec):
    import optax

    from eqx_lean import memory

    where = memory.target(spec)
    model, make_batch, trainable, n = _lora_7b(where)
    found = memory.fit(
        _make_loss,
        model,
        optax.adamw(1e-4),
        make_batch,
        target=where,
        batch_multiple=n,
        max_batch=1024,
        trainable=trainable,
    )
    print(found)
    for r in found.results:
        print(r.remat, r.compiles, [(b, f) for b, _, f in r.tried])
    best = found.best
    return (
        best.plan.peak if best else 0
    ), f"best {best.remat if best else None} b={best.batch_size if best else 0}"


def _one(case, spec):
    start = time.perf_counter()
    peak, fits = {
        "build-7b": build_7b,
        "build-7b-rows": build_7b_rows,
        "lora-7b": lora_7b,
        "build-175b": build_175b,
        "fit-7b": fit_7b,
    }[case](spec)
    seconds = time.perf_counter() - start
    print(f"RESULT\t{case}\t{spec}\t{peak / 2**30:.2f} GiB\t{fits}\t{seconds:.1f} s")


def main():
    if len(sys.argv) == 3:
        _one(*sys.argv[1:])
        return
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    rows = []
    for case, spec, bar in CASES:
        out = subprocess.run(
            [sys.executable, __file__, case, spec], env=env, capture_output=True, text=True
        )
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
        rows.append(
            (line[0].split("\t")[1:] if line else [case, spec, "error", out.stderr[-300:], ""])
            + [f"bar {bar} s"]
        )
        print("\t".join(rows[-1]), flush=True)
    print("\nwhat\ttarget\tper-device peak\tfits\tseconds\tbar")
    for row in rows:
        print("\t".join(row))


if __name__ == "__main__":
    main()
