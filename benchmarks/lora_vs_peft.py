"""A LoRA training step of eqx_lean against torch + PEFT on the same checkpoint and tokens.

Each run is a fresh process. The runs alternate (eqx_lean, torch, eqx_lean, torch, ...), so
that a change in the machine's load hits both alike, and each round ends with a third process
that measures the machine's limit: the rate of a bfloat16 product with float32 accumulation,
in JAX and in torch, at the step's own largest shape.

Both steps are the same computation:

- the checkpoint's weights in bfloat16, frozen;
- LoRA of rank 16 (`lora_alpha` 32, no dropout) on all seven projections of every layer;
- one row of `--seq` tokens (random ids, drawn once from a fixed seed and shared);
- the mean next-token cross-entropy (HF's `labels=input_ids`);
- each layer's activations recomputed in the backward pass (eqx_lean `remat=True`;
  transformers `gradient_checkpointing_enable`, non-reentrant);
- AdamW on the adapters (learning rate 1e-4, weight decay 0).

The adapters start with `B = 0`, so the first loss of each is the loss of the base model: they
must agree (up to bfloat16 rounding), which checks that the two steps compute the same thing.

    PYTHONPATH=. python benchmarks/lora_vs_peft.py --checkpoint /work/ckpt1b --rounds 3

Reported: per run, the wall and CPU seconds of each step and the first loss; per round, the
ratio of the mean of torch's steps after the first to eqx_lean's (above 1: eqx_lean is
faster), and the fraction of the limit each step reaches. A step's work is counted as
`3 * 2 * T * P` for the layers' projections (the forward pass, its recomputation, and the
input gradient; the frozen weights get no gradient), `4 * 2 * T * T * H` for the attention
products and `2 * 2 * T * V * H` for the output head (forward and input gradient), with `T`
tokens, `P` projection weights, `H` the hidden size and `V` the vocabulary.
"""

import argparse
import json
import os
import sys
import time

from _worker_runs import run_json, tokens


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LEARNING_RATE = 1e-4


def _config(checkpoint: str) -> dict:
    with open(os.path.join(checkpoint, "config.json")) as f:
        return json.load(f)


def eqx_worker(checkpoint: str, seq: int, steps: int) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from eqx_lean import lora
    from eqx_lean.hf import adamw, load_hf, make_lora_step

    model = load_hf(checkpoint)
    lora_config = lora.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)
    model = lora.add_lora(model, lora_config, key=jax.random.key(0))
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    optimizer = adamw(LEARNING_RATE, weight_decay=0.0)
    opt_state = optimizer.init(adapters)
    step = make_lora_step(optimizer, remat=True)
    batch = jnp.asarray([tokens(model.config.vocab_size, seq)], dtype=jnp.int32)
    wall, cpu, losses = [], [], []
    for _ in range(steps):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        adapters, opt_state, loss = step(frozen, adapters, opt_state, batch, None)
        losses.append(float(loss))  # waits for the step
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
    return {"wall": wall, "cpu": cpu, "losses": losses}


def torch_worker(checkpoint: str, seq: int, steps: int) -> dict:
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora_config = peft.LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(TARGETS)
    )
    model = peft.get_peft_model(model, lora_config)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LEARNING_RATE, weight_decay=0.0)
    batch = torch.tensor([tokens(model.config.vocab_size, seq)], dtype=torch.long)
    wall, cpu, losses = [], [], []
    for _ in range(steps):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
    return {"wall": wall, "cpu": cpu, "losses": losses, "threads": torch.get_num_threads()}


def limit_worker(checkpoint: str, seq: int) -> dict:
    """GFLOP/s of `x @ w.T` in bfloat16 with float32 accumulation, `x: [seq, hidden]`,
    `w: [intermediate, hidden]` (the gate and up projections), best of 20 calls."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    config = _config(checkpoint)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    flops = 2 * seq * hidden * inter
    rng = np.random.default_rng(0)
    x = rng.standard_normal((seq, hidden), dtype=np.float32)
    w = rng.standard_normal((inter, hidden), dtype=np.float32)

    product = jax.jit(
        lambda x, w: jnp.einsum("mi,oi->mo", x, w, preferred_element_type=jnp.float32)
    )
    jx, jw = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    product(jx, jw).block_until_ready()
    best_jax = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        product(jx, jw).block_until_ready()
        best_jax = min(best_jax, time.perf_counter() - start)

    tx, tw = torch.from_numpy(x).bfloat16(), torch.from_numpy(w).bfloat16()
    torch.nn.functional.linear(tx, tw)
    best_torch = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        torch.nn.functional.linear(tx, tw)
        best_torch = min(best_torch, time.perf_counter() - start)
    return {"jax": flops / best_jax / 1e9, "torch": flops / best_torch / 1e9}


def step_gflop(checkpoint: str, seq: int) -> float:
    config = _config(checkpoint)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = hidden * (2 * q + 2 * kv) + 3 * hidden * inter
    layers = config["num_hidden_layers"]
    projections = 3 * 2 * seq * per_layer * layers
    attention = 4 * 2 * seq * seq * q * layers
    head = 2 * 2 * seq * config["vocab_size"] * hidden
    return (projections + attention + head) / 1e9


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _run(args: argparse.Namespace, worker: str) -> dict:
    command = [sys.executable, __file__, "--checkpoint", args.checkpoint, "--worker", worker]
    command += ["--seq", str(args.seq), "--steps", str(args.steps)]
    return run_json(command)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--worker", choices=["eqx_lean", "torch", "limit"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.worker == "limit":
            result = limit_worker(args.checkpoint, args.seq)
        else:
            worker = eqx_worker if args.worker == "eqx_lean" else torch_worker
            result = worker(args.checkpoint, args.seq, args.steps)
        print(json.dumps(result))
        return
    gflop = step_gflop(args.checkpoint, args.seq)
    print(f"one step: {gflop:.0f} GFLOP (products)", flush=True)
    ratios_wall, ratios_cpu, fractions = [], [], []
    for round_ in range(args.rounds):
        means = {}
        for worker in ("eqx_lean", "torch"):
            result = _run(args, worker)
            wall, cpu = mean(result["wall"][1:]), mean(result["cpu"][1:])
            means[worker] = wall, cpu
            print(
                f"round {round_ + 1} {worker:8}: steps after the first {wall:5.2f} s wall, "
                f"{cpu:5.2f} s CPU (each: {', '.join(f'{s:.2f}' for s in result['wall'][1:])}); "
                f"first {result['wall'][0]:.2f} s; loss {result['losses'][0]:.5f} -> "
                f"{result['losses'][-1]:.5f}",
                flush=True,
            )
        limit = _run(args, "limit")
        rate = {worker: gflop / means[worker][0] for worker in means}
        fractions.append(rate["eqx_lean"] / limit["jax"])
        print(
            f"round {round_ + 1} limit: {limit['jax']:.0f} GFLOP/s in JAX, "
            f"{limit['torch']:.0f} in torch; steps reach {rate['eqx_lean']:.0f} GFLOP/s "
            f"(eqx_lean, {rate['eqx_lean'] / limit['jax']:.0%} of JAX's) and "
            f"{rate['torch']:.0f} (torch, {rate['torch'] / limit['torch']:.0%} of torch's)",
            flush=True,
        )
        ratios_wall.append(means["torch"][0] / means["eqx_lean"][0])
        ratios_cpu.append(means["torch"][1] / means["eqx_lean"][1])
    print(
        f"torch + PEFT / eqx_lean step time: {mean(ratios_wall):.2f}x wall "
        f"({', '.join(f'{r:.2f}' for r in ratios_wall)}), {mean(ratios_cpu):.2f}x CPU "
        f"({', '.join(f'{r:.2f}' for r in ratios_cpu)}); eqx_lean at "
        f"{mean(fractions):.0%} of the limit"
    )


if __name__ == "__main__":
    main()
