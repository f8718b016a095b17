"""Issue 46: what each private-JAX path (and scan's optimisation barrier) changes, per platform.

Run from the repository root, with the `plan` extra (JAX's CUDA plugin and libtpu):

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/private_paths.py

Every figure is compiled (nothing runs) for this CPU, for one H100 (`eqx_lean.memory.target
("h100")`, compile-only) and for a v5e (one chip of `target("v5e-4")`, compile-only), with the
path on and off, each cell in a fresh process. "off" is `eqx_lean._compat.without_private_jax()`
around the trace, lowering and compile (every accessor takes its public fallback). Memory is
`memory_analysis().temp_size_in_bytes` on CPU and H100; on TPU that field reads 0, so the TPU
column is `peak_memory_in_bytes - argument_size_in_bytes - output_size_in_bytes +
alias_size_in_bytes` (a donated argument that an output aliases is one buffer, counted once).

The private paths of `eqx_lean/_compat.py`, and the figure each exists to change:

- `primitive_rules` (the custom-transpose primitive of `_scan.linear_call`): the gradient
    temporaries of `fold` over 16 layers of 2048 x 2048 bfloat16 with rank-8 float32 adapters,
    `remat=True` (`benchmarks/scan_public_vjp.py`'s model), adapters only and whole stack.
    Off, the public `jax.custom_vjp` of `_scan.public_vjp` runs. And what it alone buys: forward
    mode (`jit(jvp(fold))` compiles, or is refused).
- `lower_with_overrides` (the only lowering override is the unrolled Threefry of
    `_threefry.FUSED_RULES`, applied through `_platform.lower` where `Tricks.fused_threefry`):
    the largest temporaries of `build_stacked`'s compiled writes for the bench's default block
    (24 layers, `benchmarks/gpu_target.py`'s figure), with every other trick of the platform as
    `Tricks.for_platform` gives it and `fused_threefry=True`; off, JAX's own lowering.
- `shard_alike` (its private home `jax._src.shard_alike`): searched only when no public home
    has `shard_alike`; JAX 0.10.2 has it in `jax.experimental.shard_alike`, so the private home
    is never taken here and there is nothing to measure (on one device it changes no program).
- `refuse_as_jax_value`: an error message for a misused type, registered at import; it changes
    no compiled program.

And scan's optimisation barriers (public API but a per-platform choice: `_platform.barrier_on_cpu`
in the `_scan` loops, `_platform.gather_barrier` in the per-layer gather, both read as module
attributes; the one `quant/_ops.py` imports by name is left as it is), both switched together: the
same `fold` gradients with `lax.optimization_barrier` lowered on every platform ("on") and on none
("off"), the private primitive on; and, since the barrier is a choice for whole programs, the plan
of a Llama-3.1-8B-shaped LoRA step (`benchmarks/long_context.py`'s: NF4 at 1 x 131,072 tokens on the
H100; on the v5e, which refuses the NF4 step, the bfloat16 base at 4 x 2,048 on 4 chips),
`Plan.needed`, barrier on and off (not compiled for CPU); and each barrier alone (the other lowered
nowhere) in the bfloat16 step at 4 x 2,048 on 4 H100s and on a v5e-4.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from _worker_runs import run_json


LAYERS, DIM, RANK, BATCH = 16, 2048, 8, 4
TARGETS = ("cpu", "h100", "v5e-4")
TRAINABLES = ("adapters", "whole stack")


def _device(target: str) -> Any:
    import jax

    if target == "cpu":
        return jax.devices("cpu")[0]
    import eqx_lean

    return eqx_lean.memory.target(target).devices[0]


def _memory(compiled: Any, target: str) -> int:
    analysis = compiled.memory_analysis()
    if target.startswith("v"):  # TPU: `temp_size_in_bytes` reads 0
        # Donated arguments aliased by outputs are one buffer, counted once.
        return (
            analysis.peak_memory_in_bytes
            - analysis.argument_size_in_bytes
            - analysis.output_size_in_bytes
            + analysis.alias_size_in_bytes
        )
    return analysis.temp_size_in_bytes


def _fold_gradients(target: str) -> dict[str, int]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import eqx_lean

    sharding = jax.sharding.SingleDeviceSharding(_device(target))

    class LoraLinear(eqx.Module):
        weight: Any
        lora_a: Any
        lora_b: Any

        def __call__(self, x):
            base = x @ self.weight.astype(jnp.float32).T
            return jnp.tanh(base + (x @ self.lora_a.T) @ self.lora_b.T)

    def struct(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    stack = LoraLinear(
        struct((LAYERS, DIM, DIM), jnp.bfloat16),
        struct((LAYERS, RANK, DIM), jnp.float32),
        struct((LAYERS, DIM, RANK), jnp.float32),
    )
    x = struct((BATCH, DIM), jnp.float32)
    found = {}
    for trainable in TRAINABLES:
        if trainable == "adapters":
            train, frozen = eqx.partition(stack, lambda leaf: leaf.dtype == jnp.float32)
        else:
            train, frozen = eqx.partition(stack, lambda _: True)

        @jax.jit
        def gradient(train, frozen, x):
            def loss(t):
                return jnp.sum(eqx_lean.fold(eqx.combine(t, frozen), x, remat=True) ** 2)

            return jax.grad(loss)(train)

        compiled = gradient.trace(train, frozen, x).lower().compile()
        found[trainable] = _memory(compiled, target)
    return found


def _build_writes(target: str) -> dict[str, int]:
    import dataclasses

    import jax
    import jax.numpy as jnp

    from eqx_lean.internal import PRESETS, Block, Tricks, lower_writes, plan_build

    device = _device(target)
    sharding = jax.sharding.SingleDeviceSharding(device)
    config = PRESETS["default"]
    keys = jax.random.split(jax.random.key(0), config.num_layers)  # the plan reads its shape
    plan = plan_build(lambda k: Block(config, key=k), keys, jnp.bfloat16, sharding)
    tricks = dataclasses.replace(Tricks.for_platform(device.platform), fused_threefry=True)
    lowered = lower_writes(plan, tricks=tricks)
    temps = [_memory(w.compile(), target) for w in lowered]
    return {"largest write": max(temps)}


def _forward_mode(target: str) -> dict[str, str]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import eqx_lean

    sharding = jax.sharding.SingleDeviceSharding(_device(target))
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(
        jax.random.split(jax.random.key(0), 2)
    )
    stack = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), stack)
    x = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)

    @jax.jit
    def tangent(stack, x):
        return jax.jvp(lambda v: eqx_lean.fold(stack, v), (x,), (x,))

    try:
        tangent.trace(stack, x).lower().compile()
    except Exception as error:  # JAX's own refusal inside `jit`
        return {"jax.jvp": f"refused ({type(error).__name__})"}
    return {"jax.jvp": "compiles"}


def _llama_step_sharded(target: str) -> dict[str, int]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fused_loss import ALL_SEVEN, LLAMA_8B

    from eqx_lean import hf, lora

    rank16 = lora.LoraConfig(r=16, lora_alpha=32, target_modules=ALL_SEVEN)
    plan = hf.plan_lora_step(
        LLAMA_8B,
        "4xh100" if target == "h100" else target,
        batch_size=4,
        seq_len=2048,
        lora_config=rank16,
        quantize=None,
        remat=True,
    )
    return {"needed": plan.needed}


def _llama_step(target: str) -> dict[str, int]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fused_loss import ALL_SEVEN, LLAMA_8B

    from eqx_lean import hf, lora

    rank16 = lora.LoraConfig(r=16, lora_alpha=32, target_modules=ALL_SEVEN)
    # H100: docs/benchmarks.md, "Long contexts" (50.48 GiB); TPUs refuse the NF4 step there, so
    # the bfloat16 base, 4 x 2,048 on 4 chips.
    on_h100 = target == "h100"
    plan = hf.plan_lora_step(
        LLAMA_8B,
        target,
        batch_size=1 if on_h100 else 4,
        seq_len=131_072 if on_h100 else 2048,
        lora_config=rank16,
        quantize="nf4" if on_h100 else None,
        remat=True,
    )
    return {"needed": plan.needed}


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    import contextlib

    from jax import lax

    from eqx_lean.internal import platform_tricks, without_private_jax

    figure, target, on = spec["figure"], spec["target"], spec["on"]
    barrier = lax.optimization_barrier if on else (lambda values: values)
    none = lambda values: values  # noqa: E731
    if figure in ("barrier", "barrier-8b"):  # both barriers (read from the module)
        platform_tricks.barrier_on_cpu = platform_tricks.gather_barrier = barrier
    if figure in ("loops-8b", "gather-8b"):  # one of them, the other lowered nowhere
        loops = figure == "loops-8b"
        platform_tricks.barrier_on_cpu = barrier if loops else none
        platform_tricks.gather_barrier = none if loops else barrier
        return _llama_step_sharded(target)
    off = not on and figure in ("scan", "scan-jvp", "threefry")
    context = without_private_jax() if off else contextlib.nullcontext()
    with context:
        if figure == "threefry":
            return _build_writes(target)
        if figure == "scan-jvp":
            return _forward_mode(target)
        if figure == "barrier-8b":
            return _llama_step(target)
        if figure == "barrier":
            from eqx_lean.internal import has_custom_transpose

            assert has_custom_transpose()
        return _fold_gradients(target)


FIGURES = {
    "scan": (
        "`_compat.primitive_rules`: the scan primitive (off: public `custom_vjp`)",
        "`fold` gradient temporaries, adapters / whole stack",
    ),
    "scan-jvp": (
        "`_compat.primitive_rules`: the scan primitive (off: public `custom_vjp`)",
        "`jit(jvp(fold))`, 2 layers of 8 x 8: compiles or refused",
    ),
    "threefry": (
        "`_compat.lower_with_overrides`: Threefry lowered unrolled (off: JAX's lowering)",
        "`build_stacked` writes, default block, largest temporaries",
    ),
    "barrier": (
        "`_platform.barrier_on_cpu`: `optimization_barrier` in the by-index loops "
        "(on: every platform; off: none)",
        "`fold` gradient temporaries, adapters / whole stack",
    ),
    "loops-8b": (
        "the barrier in the `_scan` loops only (on: every platform; off: none)",
        "Llama-3.1-8B-shaped LoRA step, bfloat16 base, 4 x 2,048 on 4 chips (4 H100s, a v5e-4), "
        "`Plan.needed` per device",
    ),
    "gather-8b": (
        "the barrier in the per-layer gather only (on: every platform; off: none)",
        "the same",
    ),
    "barrier-8b": (
        "`_platform.barrier_on_cpu`, the same (on: every platform; off: none)",
        "Llama-3.1-8B-shaped LoRA step (rank 16 x 7, `remat=True`), `Plan.needed`: H100 NF4 "
        "1 x 131,072; v5e bfloat16 base 4 x 2,048 on 4 chips, per chip; CPU not compiled",
    ),
}


def _measure(figure: str, target: str, on: bool) -> dict[str, int]:
    env = dict(os.environ)
    env.pop("EQX_LEAN_NO_PRIVATE_JAX", None)
    env.update(JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    spec = json.dumps(dict(figure=figure, target=target, on=on))
    return run_json([sys.executable, __file__, "--worker", spec], env)


def _cell(figure: str, values: dict[str, Any]) -> str:
    if figure.endswith("8b"):
        return " / ".join(f"{v / 2**30:.2f} GiB" for v in values.values())
    return " / ".join(v if isinstance(v, str) else f"{v / 2**20:.2f}" for v in values.values())


def main() -> None:
    parser = argparse.ArgumentParser(description="issue 46: private JAX paths per platform")
    parser.add_argument("--figure", choices=(*FIGURES, "all"), default="all")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's eqx_lean
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    import jax

    root = Path(__file__).resolve().parent.parent
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    print(
        f"jax {jax.__version__}, commit {commit}, {datetime.date.today()}; MiB; CPU and H100: "
        "`temp_size_in_bytes`; v5e: `peak_memory_in_bytes` - arguments - outputs + aliased"
    )
    print()
    columns = " | ".join(f"{t} on | {t} off" for t in ("CPU", "H100", "v5e"))
    print(f"| path | figure | {columns} |")
    print("| --- | --- |" + " --- |" * 6)
    chosen = FIGURES if args.figure == "all" else {args.figure: FIGURES[args.figure]}
    for figure, (path, what) in chosen.items():
        cells = [
            "-" if figure.endswith("8b") and t == "cpu" else _cell(figure, _measure(figure, t, on))
            for t in TARGETS
            for on in (True, False)
        ]
        print(f"| {path} | {what} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
