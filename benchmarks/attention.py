"""Blockwise attention against eager attention: XLA's plans, compile only.

Cases (each prints one table row per method; nothing runs, nothing is allocated):

- `kernel`: `memory_analysis()` on XLA:CPU of `eqx_lean.nn.attention` and of eager attention
    (every score held, float32 softmax), forward and gradient with respect to q, k and v, at
    1 x 4,096 and 1 x 16,384 tokens, 4 query heads and 2 key/value heads of 64 (float32).
- `decoder`: the adapter gradient of `eqx_lean.hf.next_token_loss` (fused loss) on the narrow
    Llama-3-shaped decoder of `benchmarks/fused_loss.py` (hidden 256, 2 layers, vocab 128,256,
    LoRA rank 16 on all seven projections, float32, `remat=True`) at 1 x 2,048 and
    1 x 16,384 tokens, `attention="eager"` against `attention="blockwise"` (XLA:CPU).
- `plan8b`: `eqx_lean.hf.plan_lora_step` of the Llama-3.1-8B-shaped NF4 LoRA step of
    `benchmarks/fused_loss.py` (rank 16, all seven projections, `remat=True`) for one
    compile-only H100 at 1 x 2,048, 2 x 2,048, 1 x 8,192 and 1 x 32,768 (the `plan` extra;
    `JAX_PLATFORMS=cpu`). It plans whatever `eqx_lean` is imported: run it on an older
    checkout (`PYTHONPATH=<checkout>`) for the figure before.

- `tpu`: `eqx_lean.nn.attention` compiled for one chip of a compile-only TPU v5e (`v5e:2x2`,
    the `plan` extra's libtpu; `JAX_PLATFORMS=cpu`), causal, 32 query heads and 8 key/value
    heads of 64, bfloat16, at 1 x 4,096 and 1 x 16,384: forward and gradient.
- `steptime`: a LoRA AdamW step of the narrow decoder in bfloat16 at 1 x 2,048 tokens, run on
    this CPU, `attention="eager"` and the default alternated (median of steps 2-6).
- `mlpchunk`: the decoder MLP's chunks (`mlp_chunk_bytes`, `--mlp-chunks`, MiB or `default`)
    on XLA:CPU: the temporaries of the narrow decoder's adapter gradient (as `decoder`,
    blockwise) at 1 x 16,384 tokens and of the LoRA AdamW step of `benchmarks/fused_loss.py`'s
    Llama-3.2-1B shape (bfloat16, rank 16 x 7, `remat=True`) at 1 x 2,048 and 1 x 8,192
    (compile only); then, with `--steps N` (N > 0), that 1B step at 1 x 2,048 run on this CPU,
    every chunk size alternated in one process (random weights built once; the median of steps
    2 to N of each).

    JAX_PLATFORMS=cpu python benchmarks/attention.py kernel decoder
    JAX_PLATFORMS=cpu python benchmarks/attention.py steptime
    JAX_PLATFORMS=cpu python benchmarks/attention.py tpu
    JAX_PLATFORMS=cpu python benchmarks/attention.py mlpchunk --mlp-chunks 32,16,8 --steps 4
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 CUDA_VISIBLE_DEVICES=-1 \\
        python benchmarks/attention.py plan8b
"""

import argparse
import time
from typing import Any

import equinox as eqx
import fused_loss  # pyright: ignore[reportMissingImports]
import jax
import jax.numpy as jnp
from fused_loss import ALL_SEVEN, NARROW, compiled, row  # pyright: ignore[reportMissingImports]

from eqx_lean import hf, lora


MiB, GiB = 2**20, 2**30
HEADER = "| attention | temporaries | arguments | outputs | compile |\n" + "| --- " * 5 + "|"


def eager(q: Any, k: Any, v: Any) -> Any:
    """Causal attention with every score held (HF's eager path: K and V repeated per group)."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    seq = q.shape[1]
    causal = jnp.arange(seq)[None, :] <= jnp.arange(seq)[:, None]
    s = jnp.where(causal, s, jnp.finfo(s.dtype).min)
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def kernel_case() -> None:
    from eqx_lean.nn import attention

    heads, kv_heads, head_dim = 4, 2, 64
    print("\nattention alone, 4 heads, 2 KV heads of 64, float32, causal")
    print(HEADER)
    for seq in (4096, 16_384):
        shapes = (
            jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((1, seq, kv_heads, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((1, seq, kv_heads, head_dim), jnp.float32),
        )
        for name, f in (("eager", eager), ("eqx_lean.nn.attention", attention)):

            def summed(q: Any, k: Any, v: Any, f: Any = f) -> Any:
                return jnp.sum(f(q, k, v))

            row(f"1 x {seq}: {name}, forward", *compiled(f, *shapes))
            row(f"1 x {seq}: {name}, gradient", *compiled(jax.grad(summed, (0, 1, 2)), *shapes))


def decoder_case() -> None:
    lora_config = lora.LoraConfig(r=16, lora_alpha=32, target_modules=ALL_SEVEN)

    def build() -> hf.Decoder:
        base = hf.init(NARROW, key=jax.random.key(0))
        return lora.add_lora(base, lora_config, key=jax.random.key(1))

    model = eqx.filter_eval_shape(build)
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    print("\nadapter gradient of next_token_loss (fused), narrow Llama-3 shape (4 heads), remat")
    print(HEADER)
    for seq in (2048, 16_384):
        ids = jax.ShapeDtypeStruct((1, seq), jnp.int32)
        for kind in ("eager", "blockwise"):

            def loss_of(adapters: Any, frozen: Any, ids: Any, kind: str = kind) -> Any:
                model = eqx.combine(adapters, frozen)
                return hf.next_token_loss(model, ids, remat=True, attention=kind)

            row(
                f'1 x {seq}: attention="{kind}"',
                *compiled(jax.grad(loss_of), adapters, frozen, ids),
            )


PLANS = [*fused_loss.PLANS_8B, (1, 32_768)]


def plan8b_case() -> None:
    fused_loss.plan8b_case(tuple(PLANS))


def steptime_case() -> None:
    """Eager and blockwise attention, alternated in one process (median of steps 2-6)."""
    median, times, losses = fused_loss.alternated_steps(
        {"eager": dict(attention="eager"), "blockwise": dict(attention="blockwise")}
    )
    print("\nLoRA step, narrow decoder, bfloat16, 1 x 2,048 tokens, this CPU (alternated)")
    print(
        f"eager: {median['eager']:.2f} s, blockwise: {median['blockwise']:.2f} s "
        f"({median['blockwise'] / median['eager']:.2f}x); last losses {losses}; "
        f"every step: {times}"
    )


MLP_CHUNKS: list[int | None] = [None]
"""`mlpchunk`'s `mlp_chunk_bytes` (`None`: the default), from `--mlp-chunks`."""
STEPS = [0]
"""`mlpchunk`'s steps of each chunk size (0: plans only), from `--steps`."""


def _mib(chunk: int | None) -> str:
    return "default" if chunk is None else f"{chunk // MiB} MiB"


def mlpchunk_case() -> None:
    """XLA:CPU's plans for each MLP chunk size, then (with steps) the 1B step's time."""
    import statistics

    import optax

    lora_config = lora.LoraConfig(r=16, lora_alpha=32, target_modules=ALL_SEVEN)
    narrow = eqx.filter_eval_shape(
        lambda: lora.add_lora(
            hf.init(NARROW, key=jax.random.key(0)), lora_config, key=jax.random.key(1)
        )
    )
    print("\nnarrow decoder's adapter gradient (fused loss, blockwise, remat), 1 x 16,384")
    print(
        "| mlp_chunk_bytes | temporaries | arguments | outputs | compile |\n" + "| --- " * 5 + "|"
    )
    for chunk in MLP_CHUNKS:

        def loss_of(adapters: Any, frozen: Any, ids: Any, chunk: int | None = chunk) -> Any:
            model = eqx.combine(adapters, frozen)
            return hf.next_token_loss(model, ids, remat=True, mlp_chunk_bytes=chunk)

        ids = jax.ShapeDtypeStruct((1, 16_384), jnp.int32)
        row(
            _mib(chunk),
            *compiled(jax.grad(loss_of), *eqx.partition(narrow, lora.lora_filter(narrow)), ids),
        )

    def build() -> Any:
        base = hf.init(fused_loss.LLAMA_1B, key=jax.random.key(0))
        return lora.add_lora(base, lora_config, key=jax.random.key(1))

    optimizer = optax.adamw(1e-4)

    def make(chunk: int | None) -> Any:
        @jax.jit
        def step(frozen: Any, adapters: Any, state: Any, ids: Any) -> Any:
            def loss_of(adapters: Any) -> Any:
                model = eqx.combine(adapters, frozen)
                return hf.next_token_loss(model, ids, remat=True, mlp_chunk_bytes=chunk)

            value, grads = jax.value_and_grad(loss_of)(adapters)
            updates, state = optimizer.update(grads, state, adapters)
            return optax.apply_updates(adapters, updates), state, value

        return step

    shapes = eqx.filter_eval_shape(build)
    adapters, frozen = eqx.partition(shapes, lora.lora_filter(shapes))
    state = jax.eval_shape(optimizer.init, adapters)
    print("\nLlama-3.2-1B-shaped LoRA AdamW step, bfloat16, XLA:CPU's plans")
    print("| tokens, mlp_chunk_bytes | temporaries | arguments | outputs | compile |")
    print("| --- " * 5 + "|")
    for seq in (2048, 8192):
        ids = jax.ShapeDtypeStruct((1, seq), jnp.int32)
        for chunk in MLP_CHUNKS:
            start = time.perf_counter()
            analysis = make(chunk).lower(frozen, adapters, state, ids).compile().memory_analysis()
            row(f"1 x {seq}, {_mib(chunk)}", analysis, time.perf_counter() - start)
    if STEPS[0] <= 0:
        return
    import os

    model = jax.block_until_ready(build())
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    ids = jax.random.randint(jax.random.key(2), (1, 2048), 0, fused_loss.LLAMA_1B.vocab_size)
    steps = {chunk: make(chunk) for chunk in MLP_CHUNKS}
    states = {chunk: (adapters, optimizer.init(adapters)) for chunk in MLP_CHUNKS}
    times: dict[int | None, list[float]] = {chunk: [] for chunk in MLP_CHUNKS}
    for i in range(STEPS[0]):
        for chunk in MLP_CHUNKS:
            start = time.perf_counter()
            new = jax.block_until_ready(steps[chunk](frozen, *states[chunk], ids))
            times[chunk].append(time.perf_counter() - start)
            states[chunk] = new[:2]
            print(
                f"step {i + 1}, {_mib(chunk)}: {times[chunk][-1]:.1f} s, loss {float(new[2]):.5f}, "
                f"load average {os.getloadavg()}",
                flush=True,
            )
    print("\n1B step at 1 x 2,048 on this CPU, alternated: median of steps 2 on")
    for chunk, seconds in times.items():
        print(f"{_mib(chunk)}: {statistics.median(seconds[1:]):.1f} s")


def tpu_case() -> None:
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from eqx_lean.nn import attention

    topology = topologies.get_topology_desc("v5e:2x2", platform="tpu")
    placed = NamedSharding(Mesh(topology.devices[:1], ("data",)), PartitionSpec())
    print("\neqx_lean.nn.attention on one TPU v5e chip, 32 heads over 8 of 64, bfloat16, causal")
    print(HEADER)
    for seq in (4096, 16_384):
        shapes = [
            jax.ShapeDtypeStruct((1, seq, heads, 64), jnp.bfloat16, sharding=placed)
            for heads in (32, 8, 8)
        ]

        def summed(q: Any, k: Any, v: Any) -> Any:
            return jnp.sum(attention(q, k, v).astype(jnp.float32))

        for name, f in (("forward", attention), ("gradient", jax.grad(summed, (0, 1, 2)))):
            start = time.perf_counter()
            analysis = jax.jit(f).trace(*shapes).lower().compile().memory_analysis()
            row(f"1 x {seq}: {name}", analysis, time.perf_counter() - start)


CASES = {
    "tpu": tpu_case,
    "kernel": kernel_case,
    "decoder": decoder_case,
    "plan8b": plan8b_case,
    "steptime": steptime_case,
    "mlpchunk": mlpchunk_case,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("cases", nargs="*", default=["kernel", "decoder"])
    parser.add_argument(
        "--plans",
        default=",".join(f"{b}x{s}" for b, s in PLANS),
        help="plan8b's batch x tokens, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--mlp-chunks",
        default="default",
        help="mlpchunk's mlp_chunk_bytes in MiB, comma-separated, or default (%(default)s)",
    )
    parser.add_argument("--steps", type=int, default=0, help="mlpchunk: steps of each (0: plans)")
    args = parser.parse_args()
    MLP_CHUNKS[:] = [
        None if chunk == "default" else int(chunk) * MiB for chunk in args.mlp_chunks.split(",")
    ]
    STEPS[:] = [args.steps]
    plans = [tuple(int(n) for n in plan.split("x")) for plan in args.plans.split(",")]
    PLANS[:] = [(batch, seq) for batch, seq in plans]
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    for name in args.cases:
        CASES[name]()


if __name__ == "__main__":
    main()
