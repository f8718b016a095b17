"""Compile time, runtime and gradient memory of `eqx_lean.fold` versus an unrolled Python loop.

Run from the repository root:

    python benchmarks/scan_compile.py            # everything, markdown tables on stdout
    python benchmarks/scan_compile.py --part compile|runtime|memory

Every measurement runs in a fresh Python process (no persistent compilation cache), so no
method profits from another's compilations. Each process re-runs this file with `--worker`.
The unrolled loop is a jitted Python loop over a list of `L` separate layers, as an unrolled
model holds them; `fold` gets the same layers stacked.

- compile: trace + lower + compile of a jitted forward+backward (`jax.value_and_grad` of a
    loss with respect to the parameters), for L = 2, 8, 32, 64. Nothing is allocated: the
    parameters are `ShapeDtypeStruct`s. Wall time and process CPU time (all threads), median
    over `FOLD_REPEATS` processes for `fold`; the loop's compile time grows faster than
    linearly, so it runs once per `L` (about four minutes of CPU at L = 64). The table uses
    MLP blocks to keep the loop affordable; `fold` is also timed on the transformer block.
- runtime: one forward+backward step of transformer blocks at L = 8, best of `STEPS` steps
    after a warm-up, in alternating processes (fold, loop, fold, loop, ...), the best process
    per method, so that the load of a shared machine touches both alike.
- memory: `memory_analysis().temp_size_in_bytes` of the compiled forward+backward of
    transformer blocks with each `remat` setting, on a configuration whose activations dwarf
    its parameters (a batch of sequences through a narrow model). Compiled only, never run.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _worker_runs import run_json


MLP_BLOCK = dict(dim=128, hidden=512, heads=4, tokens=64, batch=1, attention=False)
TRANSFORMER_BLOCK = dict(MLP_BLOCK, attention=True)
COMPILE_LAYERS = (2, 8, 32, 64)
FOLD_REPEATS = 5

RUNTIME_CONFIG = dict(dim=256, hidden=1024, heads=4, tokens=256, batch=1, attention=True)
RUNTIME_LAYERS = 8
RUNTIME_PROCESSES = 3  # per method
STEPS = 10

MEMORY_CONFIG = dict(dim=256, hidden=1024, heads=4, tokens=256, batch=8, attention=True)
MEMORY_LAYERS = 64
MEMORY_REMATS = ("none", "true", "dots_saveable", "nested", "nested_7")


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import eqx_lean
    from eqx_lean.internal import tree_bytes

    config = spec["config"]
    dim, hidden, heads, tokens, batch = (
        config[k] for k in ("dim", "hidden", "heads", "tokens", "batch")
    )

    class Block(eqx.Module):
        norm1: eqx.nn.LayerNorm
        qkv: eqx.nn.Linear
        out: eqx.nn.Linear
        norm2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3, k4 = jax.random.split(key, 4)
            self.norm1 = eqx.nn.LayerNorm(dim)
            self.qkv = eqx.nn.Linear(dim, 3 * dim, use_bias=False, key=k1)
            self.out = eqx.nn.Linear(dim, dim, use_bias=False, key=k2)
            self.norm2 = eqx.nn.LayerNorm(dim)
            self.up = eqx.nn.Linear(dim, hidden, key=k3)
            self.down = eqx.nn.Linear(hidden, dim, key=k4)

        def __call__(self, x):
            if not config["attention"]:
                return x + jax.vmap(self.down)(
                    jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm2)(x)))
                )
            q, k, v = jnp.split(jax.vmap(self.qkv)(jax.vmap(self.norm1)(x)), 3, axis=-1)
            q, k, v = (y.reshape(tokens, heads, dim // heads) for y in (q, k, v))
            logits = jnp.einsum("thd,shd->hts", q, k) / jnp.sqrt(jnp.float32(dim // heads))
            causal = jnp.tril(jnp.ones((tokens, tokens), bool))
            weights = jax.nn.softmax(jnp.where(causal, logits, jnp.float32(-1e30)), axis=-1)
            x = x + jax.vmap(self.out)(jnp.einsum("hts,shd->thd", weights, v).reshape(x.shape))
            return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm2)(x))))

    num_layers = spec["layers"]
    keys = jax.random.split(jax.random.key(0), num_layers)
    method, remat = spec["method"], spec.get("remat", "none")
    remat_arg = {
        "none": None,
        "true": True,
        "dots_saveable": jax.checkpoint_policies.dots_saveable,
        "nested": "nested",
        "nested_7": eqx_lean.NestedRemat(group_size=7),
    }[remat]

    def apply(layer, x):
        return jax.vmap(layer)(x)  # over the batch

    def forward(model, x):
        if method == "fold":
            return eqx_lean.fold(model, x, call=apply, remat=remat_arg)
        for layer in model:
            x = apply(layer, x)
        return x

    # The loop gets a list of separate layers, as an unrolled model holds them.
    if method == "fold":
        abstract = eqx.filter_eval_shape(eqx.filter_vmap(Block), keys)
    else:
        abstract = [eqx.filter_eval_shape(Block, key) for key in keys]
    dynamic_structs, static = eqx.partition(
        abstract, lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct)
    )
    x_struct = jax.ShapeDtypeStruct((batch, tokens, dim), jnp.float32)

    @jax.jit
    def step(dynamic, x):
        def loss(dynamic):
            out = forward(eqx.combine(dynamic, static), x)
            return jnp.mean(out**2)

        return jax.value_and_grad(loss)(dynamic)

    start, start_cpu = time.perf_counter(), time.process_time()
    lowered = step.lower(dynamic_structs, x_struct)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at, compiled_cpu = time.perf_counter(), time.process_time()
    result: dict[str, Any] = dict(
        lower_s=lowered_at - start,
        compile_s=compiled_at - lowered_at,
        total_s=compiled_at - start,
        total_cpu_s=compiled_cpu - start_cpu,
        temp_bytes=compiled.memory_analysis().temp_size_in_bytes,  # pyright: ignore
        param_bytes=tree_bytes(dynamic_structs),
        carry_bytes=batch * tokens * dim * 4,
    )
    if spec.get("run"):
        model = eqx_lean.build_stacked(Block, keys)
        if method == "loop":
            model = eqx_lean.unstack(model)
        dynamic, _ = eqx.partition(model, eqx.is_array)
        x = jax.random.normal(jax.random.key(1), (batch, tokens, dim))
        jax.block_until_ready(compiled(dynamic, x))
        times = []
        for _ in range(STEPS):
            start = time.perf_counter()
            jax.block_until_ready(compiled(dynamic, x))
            times.append(time.perf_counter() - start)
        result["step_s"] = min(times)
    return result


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    return run_json([sys.executable, __file__, "--worker", json.dumps(spec)])


def _compile_times(config: dict[str, Any], method: str, num_layers: int, repeats: int):
    runs = [_measure(dict(config=config, layers=num_layers, method=method)) for _ in range(repeats)]
    return {k: statistics.median(r[k] for r in runs) for k in ("total_s", "total_cpu_s")}


def _compile_part(max_loop_layers: int) -> None:
    print(
        f"\n### Compile time of a jitted forward+backward, MLP blocks ({MLP_BLOCK})\n\n"
        f"fold: median of {FOLD_REPEATS} processes; loop: one process. Wall / CPU seconds.\n"
    )
    print("| L | fold: wall | fold: CPU | loop: wall | loop: CPU | loop / fold (CPU) |")
    print("| --- | --- | --- | --- | --- | --- |")
    fold_cpu: dict[int, float] = {}
    for num_layers in COMPILE_LAYERS:
        fold = _compile_times(MLP_BLOCK, "fold", num_layers, FOLD_REPEATS)
        fold_cpu[num_layers] = fold["total_cpu_s"]
        row = f"| {num_layers} | {fold['total_s']:.2f} s | {fold['total_cpu_s']:.2f} s |"
        if num_layers <= max_loop_layers:
            loop = _compile_times(MLP_BLOCK, "loop", num_layers, 1)
            ratio = loop["total_cpu_s"] / fold["total_cpu_s"]
            row += f" {loop['total_s']:.2f} s | {loop['total_cpu_s']:.2f} s | {ratio:.1f} x |"
        else:
            row += " not run | not run | |"
        print(row, flush=True)
    first, last = COMPILE_LAYERS[0], COMPILE_LAYERS[-1]
    print(f"\nfold, CPU time at L={last} / at L={first}: {fold_cpu[last] / fold_cpu[first]:.2f} x")

    print(f"\n`fold` on transformer blocks ({TRANSFORMER_BLOCK}), median of {FOLD_REPEATS}:\n")
    print("| L | fold: wall | fold: CPU |")
    print("| --- | --- | --- |")
    for num_layers in (first, last):
        fold = _compile_times(TRANSFORMER_BLOCK, "fold", num_layers, FOLD_REPEATS)
        print(f"| {num_layers} | {fold['total_s']:.2f} s | {fold['total_cpu_s']:.2f} s |")


def _runtime_part() -> None:
    steps: dict[str, list[float]] = {"fold": [], "loop": []}
    for _ in range(RUNTIME_PROCESSES):
        for method in steps:
            spec = dict(config=RUNTIME_CONFIG, layers=RUNTIME_LAYERS, method=method, run=True)
            steps[method].append(_measure(spec)["step_s"])
    fold, loop = min(steps["fold"]), min(steps["loop"])
    print(f"\n### Runtime, forward+backward step at L={RUNTIME_LAYERS} ({RUNTIME_CONFIG})\n")
    print("| method | best step | all processes (best step each) |")
    print("| --- | --- | --- |")
    for name, best in (("fold", fold), ("loop", loop)):
        each = ", ".join(f"{1e3 * s:.1f}" for s in steps[name])
        print(f"| {name} | {1e3 * best:.1f} ms | {each} ms |")
    print(f"\nfold / loop = {fold / loop:.3f}")


def _memory_part() -> None:
    print(
        f"\n### Gradient temporaries, L={MEMORY_LAYERS} ({MEMORY_CONFIG}), "
        "`memory_analysis().temp_size_in_bytes`\n"
    )
    print("| remat | temp | / no remat |")
    print("| --- | --- | --- |")
    results = {}
    for remat in MEMORY_REMATS:
        spec = dict(config=MEMORY_CONFIG, layers=MEMORY_LAYERS, method="fold", remat=remat)
        results[remat] = _measure(spec)
        temp, base = results[remat]["temp_bytes"], results["none"]["temp_bytes"]
        print(f"| {remat} | {temp / 2**20:.1f} MiB | {temp / base:.3f} |", flush=True)
    print(
        f"\nparameters {results['none']['param_bytes'] / 2**20:.1f} MiB, "
        f"one carry {results['none']['carry_bytes'] / 2**20:.2f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="fold versus an unrolled loop")
    parser.add_argument("--part", choices=("compile", "runtime", "memory", "all"), default="all")
    parser.add_argument(
        "--max-loop-layers",
        type=int,
        default=COMPILE_LAYERS[-1],
        help="compile the unrolled loop only up to this L (L=64 takes minutes)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # This checkout's eqx_lean, whatever else is installed.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    import jax

    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {len(jax.devices())} device(s)")
    if args.part in ("compile", "all"):
        _compile_part(args.max_loop_layers)
    if args.part in ("runtime", "all"):
        _runtime_part()
    if args.part in ("memory", "all"):
        _memory_part()


if __name__ == "__main__":
    main()
