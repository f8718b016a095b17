"""Issue 46's done-when figures for the public lean backward of `eqx_lean.fold`.

Run from the repository root:

    python benchmarks/scan_public_vjp.py                  # every part, markdown on stdout
    python benchmarks/scan_public_vjp.py --part memory    # or: parity, compile, forward, vmap
    python benchmarks/scan_public_vjp.py --part memory --h100  # and compiled for an H100

The model is `benchmarks/scan_grad_memory.py`'s (issue 15's): `L=16` layers of 2048 x 2048
bfloat16 weights (a 128 MiB stack), rank-8 float32 adapters per layer, the layer
`tanh(x W^T + (x A^T) B^T)` with the weight cast to float32, a batch of 4 x 2048 float32
inputs, the loss `sum(fold(...)**2)`, `remat=True`. Each path runs in its own process (the
switch is read at import): "public" with `EQX_LEAN_NO_PRIVATE_JAX=1`, the `jax.custom_vjp` of
`eqx_lean._scan.public_vjp`; "private" without it, the custom-transpose primitive (JAX 0.10).

- memory: `memory_analysis().temp_size_in_bytes` of `jax.jit(jax.grad(loss))` with respect to
    the adapters alone and to the whole stack (compiled only); with `--h100`, also compiled
    for a compile-only H100 (JAX's CUDA plugin, XLA's `h100_sxm.txtpb`), as
    `benchmarks/gpu_target.py` does.
- parity: the same gradients run on random values against a Python loop over the layers
    (`eqx_lean.unstack`), the largest difference relative to the loop's largest magnitude.
- compile: trace + lower + compile time of the adapter gradient at L=2 and L=64, process CPU
    time, median of `REPEATS` fresh processes per point.
- forward: whether `jax.jvp` and `jax.jacfwd` of `fold` run, or the error they raise.
- vmap: the temporaries of `grad(sum(vmap(per-example loss)))`, 4 examples of 2048: the stack
    closed over by the vmapped function (not batched), with respect to the adapters and to the
    whole stack; and per-example adapters (batched) over a shared frozen base.
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
TRAINABLES = ("adapters", "whole stack")
COMPILE_LAYERS = (2, 64)
REPEATS = 3
H100_SPEC = Path(__file__).resolve().parent.parent / "eqx_lean/_memory/gpu_specs/h100_sxm.txtpb"
PATHS = ("public", "private")


def _worker(spec: dict[str, Any]) -> Any:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqx_lean
    from eqx_lean.internal import has_custom_transpose

    class LoraLinear(eqx.Module):
        weight: Any  # arrays, or `ShapeDtypeStruct`s to compile without allocating
        lora_a: Any
        lora_b: Any

        def __call__(self, x):
            base = x @ self.weight.astype(jnp.float32).T
            return jnp.tanh(base + (x @ self.lora_a.T) @ self.lora_b.T)

    sharding = None
    if spec.get("target") == "h100":  # a compile-only H100 (docs/benchmarks.md, gpu_target.py)
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(
            platform="cuda", topology="1x1x1", target_config=H100_SPEC.read_text()
        )
        (device,) = topology.devices
        sharding = jax.sharding.SingleDeviceSharding(device)

    def struct(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def structs(num_layers: int) -> LoraLinear:
        return LoraLinear(
            struct((num_layers, DIM, DIM), jnp.bfloat16),
            struct((num_layers, RANK, DIM), jnp.float32),
            struct((num_layers, DIM, RANK), jnp.float32),
        )

    def split(stack: LoraLinear, trainable: str) -> tuple[Any, Any]:
        if trainable == "adapters":
            return eqx.partition(stack, lambda leaf: leaf.dtype == jnp.float32)
        return eqx.partition(stack, lambda _: True)

    def gradient_of(fold: Any) -> Any:
        @jax.jit
        def gradient(train, frozen, x):
            return jax.grad(lambda t: jnp.sum(fold(eqx.combine(t, frozen), x) ** 2))(train)

        return gradient

    def lean(stack: Any, x: Any) -> Any:
        return eqx_lean.fold(stack, x, remat=True)

    def loop(stack: Any, x: Any) -> Any:
        for layer in eqx_lean.unstack(stack):
            x = layer(x)
        return x

    def temporaries(traced: Any) -> int:
        analysis = traced.lower().compile().memory_analysis()
        assert analysis is not None  # XLA:CPU always reports it
        return analysis.temp_size_in_bytes

    assert has_custom_transpose() == (spec["path"] == "private")
    part = spec["part"]
    x_struct = struct((BATCH, DIM), jnp.float32)
    if part == "memory":
        temps = {}
        for trainable in TRAINABLES:
            traced = gradient_of(lean).trace(*split(structs(LAYERS), trainable), x_struct)
            temps[trainable] = temporaries(traced)
        return temps
    if part == "compile":
        start = time.process_time()
        train, frozen = split(structs(spec["layers"]), "adapters")
        gradient_of(lean).trace(train, frozen, x_struct).lower().compile()
        return time.process_time() - start
    keys = jax.random.split(jax.random.key(0), 4)
    stack = LoraLinear(
        (jax.random.normal(keys[0], (LAYERS, DIM, DIM)) / DIM**0.5).astype(jnp.bfloat16),
        jax.random.normal(keys[1], (LAYERS, RANK, DIM)) / DIM**0.5,
        jax.random.normal(keys[2], (LAYERS, DIM, RANK)) / RANK**0.5,
    )
    x = jax.random.normal(keys[3], (BATCH, DIM))
    if part == "parity":
        differences = {}
        for trainable in TRAINABLES:
            train, frozen = split(stack, trainable)
            found = gradient_of(lean)(train, frozen, x)
            expected = gradient_of(loop)(train, frozen, x)
            scale = max(
                float(jnp.max(jnp.abs(e.astype(jnp.float32)))) for e in jax.tree.leaves(expected)
            )
            difference = max(
                float(jnp.max(jnp.abs(f.astype(jnp.float32) - e.astype(jnp.float32))))
                for f, e in zip(jax.tree.leaves(found), jax.tree.leaves(expected), strict=True)
            )
            differences[trainable] = f"{difference / scale:.1e} (largest gradient {scale:.2e})"
        return differences
    if part == "forward":
        weights = LoraLinear(
            stack.weight[:2, :8, :8], stack.lora_a[:2, :, :8], stack.lora_b[:2, :8, :]
        )
        x8 = x[:1, :8]
        outcomes = {}
        runs = {
            "jax.jvp": lambda: jax.jvp(lambda v: lean(weights, v), (x8,), (x8,)),
            "jax.jacfwd": lambda: jax.jacfwd(lambda v: lean(weights, v))(x8),
        }
        for name, run in runs.items():
            try:
                found = run()
            except TypeError as e:
                outcomes[name] = "refused: " + str(e).split(":")[0]
                continue
            expected = {
                "jax.jvp": lambda: jax.jvp(lambda v: loop(weights, v), (x8,), (x8,)),
                "jax.jacfwd": lambda: jax.jacfwd(lambda v: loop(weights, v))(x8),
            }[name]()
            difference = max(
                float(np.max(np.abs(np.asarray(f) - np.asarray(e))))
                for f, e in zip(jax.tree.leaves(found), jax.tree.leaves(expected), strict=True)
            )
            outcomes[name] = f"works, {difference:.1e} from the loop"
        return outcomes
    assert part == "vmap"
    temps = {}
    examples = struct((BATCH, DIM), jnp.float32)
    for trainable in TRAINABLES:

        @jax.jit
        def gradient(train, frozen, xs):
            def loss(train):
                stack = eqx.combine(train, frozen)  # closed over by the vmapped function
                return jnp.sum(jax.vmap(lambda v: jnp.sum(lean(stack, v) ** 2))(xs))

            return jax.grad(loss)(train)

        traced = gradient.trace(*split(structs(LAYERS), trainable), examples)
        temps[trainable] = temporaries(traced)

    # Per-example adapters (batched, differentiated) over a shared frozen base (closed over).
    @jax.jit
    def per_example_adapters(train, frozen, xs):
        def loss(train):
            each = lambda t, v: jnp.sum(lean(eqx.combine(t, frozen), v) ** 2)  # noqa: E731
            return jnp.sum(jax.vmap(each)(train, xs))

        return jax.grad(loss)(train)

    train, frozen = split(structs(LAYERS), "adapters")
    train = jax.tree.map(lambda a: struct((BATCH, *a.shape), a.dtype), train)
    temps["per-example adapters"] = temporaries(per_example_adapters.trace(train, frozen, examples))
    return temps


def _measure(spec: dict[str, Any]) -> Any:
    env = dict(os.environ)
    env.pop("EQX_LEAN_NO_PRIVATE_JAX", None)
    if spec["path"] == "public":
        env["EQX_LEAN_NO_PRIVATE_JAX"] = "1"
    if spec.get("target") == "h100":  # JAX's CUDA plugin compiles for absent GPUs only so
        env.update(JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
        env.update(CUDA_VISIBLE_DEVICES="-1")
    return run_json([sys.executable, __file__, "--worker", json.dumps(spec)], env)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _two_trainables(part: str, title: str, target: str = "cpu") -> None:
    print(f"\n### {title}\n")
    print("| path | adapters | whole stack |")
    print("| --- | --- | --- |")
    for path in PATHS:
        found = _measure(dict(part=part, path=path, target=target))
        text = [found[t] if part == "parity" else _mib(found[t]) for t in TRAINABLES]
        print(f"| {path} | {text[0]} | {text[1]} |", flush=True)


def _compile_part() -> None:
    print(
        "\n### Compile time of the adapter gradient (`remat=True`), process CPU seconds, "
        f"median of {REPEATS} processes\n"
    )
    print("| path | " + " | ".join(f"L={n}" for n in COMPILE_LAYERS) + " | ratio |")
    print("| --- | " + " | ".join("---" for _ in COMPILE_LAYERS) + " | --- |")
    for path in PATHS:
        times = [
            statistics.median(
                _measure(dict(part="compile", path=path, layers=n)) for _ in range(REPEATS)
            )
            for n in COMPILE_LAYERS
        ]
        cells = " | ".join(f"{t:.2f} s" for t in times)
        print(f"| {path} | {cells} | {times[-1] / times[0]:.2f} x |", flush=True)


def _forward_part() -> None:
    print("\n### Forward mode of `fold` (2 layers of 8 x 8)\n")
    print("| path | `jax.jvp` | `jax.jacfwd` |")
    print("| --- | --- | --- |")
    for path in PATHS:
        found = _measure(dict(part="forward", path=path))
        print(f"| {path} | {found['jax.jvp']} | {found['jax.jacfwd']} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="issue 46: the public lean backward of fold")
    parts = ("memory", "parity", "compile", "forward", "vmap")
    parser.add_argument("--part", choices=(*parts, "all"), default="all")
    parser.add_argument(
        "--h100", action="store_true", help="also the memory part compiled for an H100"
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
    chosen = parts if args.part == "all" else (args.part,)
    if "memory" in chosen:
        _two_trainables(
            "memory",
            f"Gradient temporaries, L={LAYERS}, {DIM}x{DIM} bfloat16, `remat=True` "
            "(`memory_analysis().temp_size_in_bytes`; bar: 32 MiB)",
        )
        if args.h100:
            _two_trainables(
                "memory",
                "The same, compiled for one H100 (compile-only, XLA's plan)",
                target="h100",
            )
    if "parity" in chosen:
        _two_trainables(
            "parity",
            "Gradient against a Python loop over the layers, largest difference / largest "
            "magnitude",
        )
    if "compile" in chosen:
        _compile_part()
    if "forward" in chosen:
        _forward_part()
    if "vmap" in chosen:
        print(
            f"\n### `grad(sum(vmap(per-example loss)))`, {BATCH} examples (temporaries; bar: "
            "272.78 MiB with the stack closed over)\n"
        )
        print("| path | stack closed over: adapters | whole stack | per-example adapters, "
              "frozen base closed over |")  # fmt: skip
        print("| --- | --- | --- | --- |")
        for path in PATHS:
            found = _measure(dict(part="vmap", path=path))
            cells = " | ".join(_mib(v) for v in found.values())
            print(f"| {path} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
