"""Gradient temporaries of `eqx_lean.fold` over a bfloat16 stack with LoRA-style adapters.

Run from the repository root:

    python benchmarks/scan_grad_memory.py                 # both parts, markdown on stdout
    python benchmarks/scan_grad_memory.py --part memory   # or: --part compile

The model is issue 15's benchmark: `L=16` layers of 2048 x 2048 bfloat16 weights (a 128 MiB
stack), rank-8 float32 adapters per layer (`A: [8, 2048]`, `B: [2048, 8]`, stacked), a layer
`tanh(x W^T + (x A^T) B^T)` on a batch of 4 x 2048 float32 inputs, and the loss
`sum(fold(...)**2)`. Everything is compiled only, never run: the parameters are
`ShapeDtypeStruct`s.

- memory: `memory_analysis().temp_size_in_bytes` of `jax.jit(jax.grad(loss))`, with respect
    to the adapters alone (the base frozen through `eqx.partition`) and to the whole stack, for
    each `remat` and two layer styles: "f32 product" casts the weight to float32 before the
    product, "bf16 product" multiplies in bfloat16 with float32 accumulation
    (`preferred_element_type=jnp.float32`). "public" is the path `fold` takes where its
    private-JAX accessor is unavailable (`EQX_LEAN_NO_PRIVATE_JAX=1`): since issue 46 the
    hand-written backward pass as a `jax.custom_vjp` (before, `jax.lax.scan` over the stack as
    `xs`, the "earlier" column of docs/benchmarks.md); "index" is the hand-written backward
    pass through the private primitive.
- compile: trace + lower + compile time of the adapter gradient (`remat=True`) at L=2 and
    L=64, process CPU time, median of `REPEATS` fresh processes per point.

Each path runs in its own process (the switch is read at import); the figures are
deterministic apart from the compile times.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _worker_runs import run_json


LAYERS, DIM, RANK, BATCH = 16, 2048, 8, 4
REMATS = ("none", "true", "dots_saveable", "nested")
STYLES = ("f32 product", "bf16 product")
TRAINABLES = ("adapters", "whole stack")
COMPILE_LAYERS = (2, 64)
REPEATS = 3


def _worker(spec: dict[str, Any]) -> Any:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import eqx_lean

    class LoraLinear(eqx.Module):
        weight: Any  # arrays, or `ShapeDtypeStruct`s to compile without allocating
        lora_a: Any
        lora_b: Any
        bfloat16_product: bool = eqx.field(static=True)

        def __call__(self, x):
            if self.bfloat16_product:
                base = jnp.dot(
                    x.astype(jnp.bfloat16), self.weight.T, preferred_element_type=jnp.float32
                )
            else:
                base = x @ self.weight.astype(jnp.float32).T
            return jnp.tanh(base + (x @ self.lora_a.T) @ self.lora_b.T)

    remats = {
        "none": None,
        "true": True,
        "dots_saveable": jax.checkpoint_policies.dots_saveable,
        "nested": "nested",
    }

    def compiled(num_layers: int, remat: str, style: str, trainable: str) -> Any:
        struct = jax.ShapeDtypeStruct
        stack = LoraLinear(
            struct((num_layers, DIM, DIM), jnp.bfloat16),
            struct((num_layers, RANK, DIM), jnp.float32),
            struct((num_layers, DIM, RANK), jnp.float32),
            bfloat16_product=style == "bf16 product",
        )
        if trainable == "adapters":
            train, frozen = eqx.partition(stack, lambda leaf: leaf.dtype == jnp.float32)
        else:
            train, frozen = eqx.partition(stack, lambda _: True)

        @jax.jit
        def gradient(train, frozen, x):
            def loss(train):
                out = eqx_lean.fold(eqx.combine(train, frozen), x, remat=remats[remat])
                return jnp.sum(out**2)

            return jax.grad(loss)(train)

        x = struct((BATCH, DIM), jnp.float32)
        return gradient.trace(train, frozen, x).lower().compile()

    if spec["part"] == "memory":
        rows = []
        for remat in REMATS:
            for style in STYLES:
                for trainable in TRAINABLES:
                    analysis = compiled(LAYERS, remat, style, trainable).memory_analysis()
                    rows.append(dict(remat=remat, style=style, trainable=trainable,
                                     temp=analysis.temp_size_in_bytes))  # fmt: skip
        return rows
    start = time.process_time()
    compiled(spec["layers"], "true", "f32 product", "adapters")
    return time.process_time() - start


def _measure(spec: dict[str, Any], earlier: bool) -> Any:
    env = dict(os.environ)
    env.pop("EQX_LEAN_NO_PRIVATE_JAX", None)
    if earlier:
        env["EQX_LEAN_NO_PRIVATE_JAX"] = "1"
    return run_json([sys.executable, __file__, "--worker", json.dumps(spec)], env)


def _memory_part() -> None:
    mib = 2**20
    stack = LAYERS * DIM * DIM * 2
    print(
        f"\n### Gradient temporaries, L={LAYERS}, {DIM}x{DIM} bfloat16 weights "
        f"({stack / mib:.0f} MiB stack), rank {RANK}, batch {BATCH}x{DIM} float32\n\n"
        f"`memory_analysis().temp_size_in_bytes`; bar: at most half the bfloat16 stack "
        f"({stack / 2 / mib:.0f} MiB) with `remat=True`. One layer in float32 is "
        f"{DIM * DIM * 4 / mib:.0f} MiB.\n"
    )
    earlier = _measure(dict(part="memory"), earlier=True)
    index = _measure(dict(part="memory"), earlier=False)
    print(
        "| remat | layer | gradient of | public (`EQX_LEAN_NO_PRIVATE_JAX=1`) | private primitive |"
    )
    print("| --- | --- | --- | --- | --- |")
    for old, new in zip(earlier, index, strict=True):
        print(
            f"| {old['remat']} | {old['style']} | {old['trainable']} | "
            f"{old['temp'] / mib:.1f} MiB | {new['temp'] / mib:.1f} MiB |",
            flush=True,
        )


def _compile_part() -> None:
    print(
        f"\n### Compile time of the adapter gradient (`remat=True`), process CPU seconds, "
        f"median of {REPEATS} processes\n"
    )
    print("| path | " + " | ".join(f"L={n}" for n in COMPILE_LAYERS) + " | ratio |")
    print("| --- | " + " | ".join("---" for _ in COMPILE_LAYERS) + " | --- |")
    for name, earlier in (("public (`EQX_LEAN_NO_PRIVATE_JAX=1`)", True), ("private", False)):
        times = [
            statistics.median(
                _measure(dict(part="compile", layers=n), earlier) for _ in range(REPEATS)
            )
            for n in COMPILE_LAYERS
        ]
        cells = " | ".join(f"{t:.2f} s" for t in times)
        print(f"| {name} | {cells} | {times[-1] / times[0]:.2f} x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="fold gradient temporaries, LoRA benchmark")
    parser.add_argument("--part", choices=("memory", "compile", "all"), default="all")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # This checkout's eqx_lean, whatever else is installed.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    import jax

    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {len(jax.devices())} device(s)")
    if args.part in ("memory", "all"):
        _memory_part()
    if args.part in ("compile", "all"):
        _compile_part()


if __name__ == "__main__":
    main()
