"""The fused linear + cross-entropy against materialised logits: XLA's plans, compile only.

Cases (each prints one table row per method; nothing runs, nothing is allocated):

- `loss`: `memory_analysis()` on XLA:CPU of the gradient of the loss with respect to the hidden
    states and the head at 16,384 tokens x hidden 256 x vocab 128,256 (float32):
    `eqx_lean.nn.linear_cross_entropy` against the textbook loss (float32 logits,
    `log_softmax`), and the fused loss's temporaries for several `chunk_bytes`.
- `decoder`: the adapter gradient of `eqx_lean.hf.next_token_loss` on a narrow Llama-3-shaped
    decoder (hidden 256, 2 layers, vocab 128,256, LoRA rank 16 on all seven projections,
    float32) at 1 x 2,048 and 1 x 16,384 tokens, `fused=True` against `fused=False` (XLA:CPU).
    At 16,384 tokens the attention's `[heads, seq, seq]` scores dominate either way.
- `plan8b`: `eqx_lean.hf.plan_lora_step` of a Llama-3.1-8B-shaped NF4 LoRA step (rank 16, all
    seven projections, `remat=True`) for one compile-only H100 at 1 x 2,048, 2 x 2,048 and
    1 x 8,192 (the `plan` extra; `JAX_PLATFORMS=cpu`). It plans whatever `eqx_lean` is
    imported: run it on an older checkout (`PYTHONPATH=<checkout>`) for the figure before.

- `steptime`: a LoRA AdamW step of the narrow decoder in bfloat16 at 1 x 2,048 tokens, run on
    this CPU, the textbook loss and the fused one alternated (median of steps 2-6).
- `step1b`: the same step for a Llama-3.2-1B-shaped decoder (hidden 2,048, intermediate 8,192,
    16 layers, 32 heads, 8 KV heads, vocab 128,256, tied head), random weights built in the
    process, bfloat16, rank 16 on all seven projections, `remat=True`, 1 x 2,048 tokens, on
    this CPU. `--loss textbook` or `--loss fused` runs one loss in its own process (for its
    peak RSS: the build's and the step's, printed apart), `--loss both` alternates them in one
    process (for the time); `--steps N` steps of each (the first compiles); `--plan` prints
    XLA's memory plan of each step instead (compile only); `--seq-len N` runs 1 x N tokens
    (issue 44's bar: 8,192). It prints the load average.

    JAX_PLATFORMS=cpu python benchmarks/fused_loss.py loss decoder
    JAX_PLATFORMS=cpu python benchmarks/fused_loss.py steptime
    JAX_PLATFORMS=cpu /usr/bin/time -v python benchmarks/fused_loss.py step1b --loss textbook
    JAX_PLATFORMS=cpu /usr/bin/time -v python benchmarks/fused_loss.py step1b --loss fused
    JAX_PLATFORMS=cpu python benchmarks/fused_loss.py step1b --loss both --steps 6
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 CUDA_VISIBLE_DEVICES=-1 \\
        python benchmarks/fused_loss.py plan8b
"""

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from eqx_lean import hf, lora


MiB, GiB = 2**20, 2**30
ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def row(name: str, analysis: Any, seconds: float) -> None:
    print(
        f"| {name} | {analysis.temp_size_in_bytes / MiB:,.1f} MiB | "
        f"{analysis.argument_size_in_bytes / MiB:,.1f} MiB | "
        f"{analysis.output_size_in_bytes / MiB:,.1f} MiB | {seconds:.1f} s |",
        flush=True,
    )


def compiled(f: Callable[..., Any], *shapes: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    analysis = jax.jit(f).lower(*shapes).compile().memory_analysis()
    return analysis, time.perf_counter() - start


def textbook(hidden: Any, weight: Any, labels: Any) -> Any:
    logits = jnp.einsum("...h,vh->...v", hidden, weight).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    counted = labels != -100
    picked = jnp.take_along_axis(log_probs, jnp.where(counted, labels, 0)[..., None], axis=-1)
    return -jnp.sum(jnp.where(counted, picked[..., 0], 0.0)) / jnp.sum(counted, dtype=jnp.float32)


def loss_case() -> None:
    from eqx_lean.nn import linear_cross_entropy

    tokens, hidden, vocab = 16_384, 256, 128_256
    shapes = (
        jax.ShapeDtypeStruct((1, tokens, hidden), jnp.float32),
        jax.ShapeDtypeStruct((vocab, hidden), jnp.float32),
        jax.ShapeDtypeStruct((1, tokens), jnp.int32),
    )
    print(f"\ngradient w.r.t. hidden and head, {tokens} tokens x {hidden} x vocab {vocab}")
    print("| loss | temporaries | arguments | outputs | compile |\n| --- | --- | --- | --- | --- |")
    row("textbook (float32 logits, log_softmax)", *compiled(jax.grad(textbook, (0, 1)), *shapes))
    for chunk_mib in (None, 16, 32, 128):
        chunk = None if chunk_mib is None else chunk_mib * MiB

        def fused(h: Any, w: Any, labels: Any, chunk: Any = chunk) -> Any:
            return linear_cross_entropy(h, w, labels, chunk_bytes=chunk)

        size = "default (64 MiB)" if chunk is None else f"{chunk_mib} MiB"
        name = f"linear_cross_entropy, chunk_bytes={size}"
        row(name, *compiled(jax.grad(fused, (0, 1)), *shapes))
        if chunk is None:
            row(name + ", hidden only", *compiled(jax.grad(fused), *shapes))


NARROW = hf.DecoderConfig(
    vocab_size=128_256,
    hidden_size=256,
    intermediate_size=896,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=500_000.0,
    sliding_window=None,
    model_type="llama",
    dtype="float32",
)


def decoder_case() -> None:
    config = NARROW
    lora_config = lora.LoraConfig(r=16, lora_alpha=32, target_modules=ALL_SEVEN)

    def build() -> hf.Decoder:
        base = hf.init(config, key=jax.random.key(0))
        return lora.add_lora(base, lora_config, key=jax.random.key(1))

    model = eqx.filter_eval_shape(build)
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    print("\nadapter gradient of next_token_loss, narrow Llama-3 shape (4 heads), remat")
    print("| loss | temporaries | arguments | outputs | compile |\n| --- | --- | --- | --- | --- |")
    for seq in (2048, 16_384):
        ids = jax.ShapeDtypeStruct((1, seq), jnp.int32)
        for fused in (False, True):

            def loss_of(adapters: Any, frozen: Any, ids: Any, fused: bool = fused) -> Any:
                model = eqx.combine(adapters, frozen)
                return hf.next_token_loss(model, ids, remat=True, fused=fused)

            row(
                f"1 x {seq}: next_token_loss(fused={fused})",
                *compiled(jax.grad(loss_of), adapters, frozen, ids),
            )


LLAMA_8B = hf.DecoderConfig(
    vocab_size=128_256,
    hidden_size=4096,
    intermediate_size=14_336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    rope_theta=500_000.0,
    sliding_window=None,
    model_type="llama",
)


PLANS_8B = ((1, 2048), (2, 2048), (1, 8192))


def plan8b_case(plans: tuple[tuple[int, int], ...] = PLANS_8B) -> None:
    """XLA's plans of the Llama-3.1-8B-shaped NF4 LoRA step on one H100, `(batch, seq)` each."""
    lora_config = lora.LoraConfig(r=16, lora_alpha=32, target_modules=ALL_SEVEN)
    print("\nplan_lora_step, Llama-3.1-8B shape, NF4 base, rank 16 x 7, remat=True, one H100")
    print("| tokens | peak | temporaries | fits | plan |\n| --- | --- | --- | --- | --- |")
    for batch, seq in plans:
        start = time.perf_counter()
        plan = hf.plan_lora_step(
            LLAMA_8B,
            "h100",
            batch_size=batch,
            seq_len=seq,
            lora_config=lora_config,
            remat=True,
            quantize="nf4",
        )
        seconds = time.perf_counter() - start
        print(
            f"| {batch} x {seq} | {plan.peak / GiB:.2f} GiB | "
            f"{plan.temp / GiB:.2f} GiB | {plan.fits} | {seconds:.0f} s |",
            flush=True,
        )


def alternated_steps(
    variants: dict[str, dict[str, Any]], steps: int = 6
) -> tuple[dict[str, float], dict[str, list[float]], dict[str, float]]:
    """A LoRA AdamW step of the narrow decoder in bfloat16 at 1 x 2,048 tokens on this CPU, one
    jitted step per variant (`next_token_loss`'s keyword arguments, by name), the variants run
    alternately `steps` times. Returns each variant's median step time after the first, every
    step's time, and its last loss."""
    import statistics

    import optax

    config = dataclasses.replace(NARROW, dtype="bfloat16")
    lora_config = lora.LoraConfig(r=16, lora_alpha=32, target_modules=ALL_SEVEN)
    model = lora.add_lora(
        hf.init(config, key=jax.random.key(0)), lora_config, key=jax.random.key(1)
    )
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    optimizer = optax.adamw(1e-4)
    ids = jax.random.randint(jax.random.key(2), (1, 2048), 0, config.vocab_size)

    def make(loss_kwargs: dict[str, Any]) -> Any:
        @jax.jit
        def step(adapters: Any, state: Any) -> Any:
            def loss_of(adapters: Any) -> Any:
                model = eqx.combine(adapters, frozen)
                return hf.next_token_loss(model, ids, remat=True, **loss_kwargs)

            loss, grads = jax.value_and_grad(loss_of)(adapters)
            updates, state = optimizer.update(grads, state, adapters)
            return optax.apply_updates(adapters, updates), state, loss

        return step

    jitted = {name: make(kwargs) for name, kwargs in variants.items()}
    states = {name: (adapters, optimizer.init(adapters)) for name in variants}
    times: dict[str, list[float]] = {name: [] for name in variants}
    losses: dict[str, float] = {}
    for _ in range(steps):
        for name in variants:
            start = time.perf_counter()
            new = jitted[name](*states[name])
            jax.block_until_ready(new)
            times[name].append(time.perf_counter() - start)
            states[name] = new[:2]
            losses[name] = float(new[2])
    median = {name: statistics.median(times[name][1:]) for name in variants}
    return median, times, losses


def steptime_case() -> None:
    """The textbook loss and the fused one, alternated in one process (median of steps 2-6)."""
    median, times, _ = alternated_steps({"textbook": dict(fused=False), "fused": dict(fused=True)})
    print("\nLoRA step, narrow decoder, bfloat16, 1 x 2,048 tokens, this CPU (alternated)")
    print(
        f"textbook loss: {median['textbook']:.2f} s, fused: {median['fused']:.2f} s "
        f"({median['fused'] / median['textbook']:.2f}x); every step: {times}"
    )


LLAMA_1B = hf.DecoderConfig(
    vocab_size=128_256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    rope_theta=500_000.0,
    sliding_window=None,
    model_type="llama",
    tie_word_embeddings=True,
    dtype="bfloat16",
)


def step1b_case(
    loss: str = "both", steps: int = 6, plan: bool = False, seq_len: int = 2048
) -> None:
    """A LoRA AdamW step of a Llama-3.2-1B-shaped decoder in bfloat16 at 1 x `seq_len` tokens
    on this CPU: `loss` is `"textbook"`, `"fused"` or `"both"` (alternated in one process),
    each run `steps` times (the first compiles); the times of steps 2 on and their median.
    With `plan`, XLA's memory plan of each step instead (compile only)."""
    import os
    import statistics

    import optax

    from eqx_lean.internal import status_kib, tree_bytes

    print(f"load average before: {os.getloadavg()}", flush=True)
    lora_config = lora.LoraConfig(r=16, lora_alpha=32, target_modules=ALL_SEVEN)
    ids = jax.random.randint(jax.random.key(2), (1, seq_len), 0, LLAMA_1B.vocab_size)
    jax.block_until_ready(ids)
    idle = status_kib("VmRSS")
    start = time.perf_counter()

    def build() -> Any:
        base = hf.init(LLAMA_1B, key=jax.random.key(0))
        return lora.add_lora(base, lora_config, key=jax.random.key(1))

    # A plan needs only the shapes: nothing is built.
    model = eqx.filter_eval_shape(build) if plan else jax.block_until_ready(build())
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    print(
        f"built in {time.perf_counter() - start:.1f} s: base {tree_bytes(frozen) / GiB:.2f} GiB, "
        f"adapters {tree_bytes(adapters) / MiB:.1f} MiB; idle {idle / 2**20:.2f} GiB, "
        f"peak RSS so far {status_kib('VmHWM') / 2**20:.2f} GiB",
        flush=True,
    )
    optimizer = optax.adamw(1e-4)
    fused_of = {"textbook": [False], "fused": [True], "both": [False, True]}[loss]

    def make(fused: bool) -> Any:
        # The frozen base is an argument, not a constant captured by the trace.
        @jax.jit
        def step(frozen: Any, adapters: Any, state: Any, ids: Any) -> Any:
            def loss_of(adapters: Any) -> Any:
                model = eqx.combine(adapters, frozen)
                return hf.next_token_loss(model, ids, remat=True, fused=fused)

            value, grads = jax.value_and_grad(loss_of)(adapters)
            updates, state = optimizer.update(grads, state, adapters)
            return optax.apply_updates(adapters, updates), state, value

        return step

    made = {fused: make(fused) for fused in fused_of}
    if plan:
        # XLA's plan of each step (compile only; nothing runs).
        for fused in fused_of:
            state = jax.eval_shape(optimizer.init, adapters)
            analysis = made[fused].lower(frozen, adapters, state, ids).compile().memory_analysis()
            print(
                f"plan, fused={fused}: temporaries {analysis.temp_size_in_bytes / MiB:,.0f} MiB, "
                f"arguments {analysis.argument_size_in_bytes / MiB:,.0f} MiB",
                flush=True,
            )
        return
    states = {fused: (adapters, optimizer.init(adapters)) for fused in fused_of}
    times: dict[bool, list[float]] = {fused: [] for fused in fused_of}
    # The build's own peak (the random draws) is not the step's: reset the high-water mark
    # (Linux's `clear_refs`), so that "peak RSS since the build" is the steps' alone. The
    # reset lowers the mark `/usr/bin/time -v` reads too (its maximum resident set size is
    # then the steps' peak): the whole process's peak is the larger of the two printed.
    build_peak = status_kib("VmHWM")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    print(
        f"build peak {build_peak / 2**20:.2f} GiB; after the reset "
        f"{status_kib('VmHWM') / 2**20:.2f} GiB (resident now)",
        flush=True,
    )
    for i in range(steps):
        for fused in fused_of:
            start = time.perf_counter()
            new = made[fused](frozen, *states[fused], ids)
            jax.block_until_ready(new)
            times[fused].append(time.perf_counter() - start)
            states[fused] = new[:2]
            print(
                f"step {i + 1}, fused={fused}: {times[fused][-1]:.1f} s, loss "
                f"{float(new[2]):.4f}, peak RSS since the build "
                f"{status_kib('VmHWM') / 2**20:.2f} GiB, "
                f"load average {os.getloadavg()}",
                flush=True,
            )
    print(f"\nLoRA step, Llama-3.2-1B shape, bfloat16, 1 x {seq_len:,} tokens, this CPU")
    median = {f: statistics.median(t[1:]) for f, t in times.items() if len(t) > 1}
    for fused, seconds in median.items():
        print(f"fused={fused}: median of steps 2-{steps} {seconds:.1f} s")
    if len(median) == 2:
        print(f"fused / textbook: {median[True] / median[False]:.3f}x")
    print(
        f"peak RSS since the build {status_kib('VmHWM') / 2**20:.2f} GiB, the build's "
        f"{build_peak / 2**20:.2f} GiB, the whole process's "
        f"{max(build_peak, status_kib('VmHWM')) / 2**20:.2f} GiB (idle {idle / 2**20:.2f} GiB); "
        f"load average after: {os.getloadavg()}"
    )


CASES = {
    "loss": loss_case,
    "decoder": decoder_case,
    "plan8b": plan8b_case,
    "steptime": steptime_case,
    "step1b": step1b_case,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("cases", nargs="*", default=["loss", "decoder"])
    parser.add_argument("--loss", choices=("textbook", "fused", "both"), default="both")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--plan", action="store_true", help="step1b: XLA's plans, nothing run")
    parser.add_argument("--seq-len", type=int, default=2048, help="step1b: tokens per row")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    for name in args.cases:
        if name == "step1b":
            step1b_case(args.loss, args.steps, args.plan, args.seq_len)
        else:
            CASES[name]()


if __name__ == "__main__":
    main()
