"""A 7B LoRA step on an NF4 base against the same step on a bfloat16 base, the runs alternated.

Each run is a fresh process that loads the checkpoint (`load_hf(..., quantize=...)`), adds the
adapters of `docs/fine-tuning.md` (rank 16, all seven projections), and times `--steps` steps
of one 256-token row with remat, as `python -m examples.mistral7b finetune` does. It reports,
per run, the wall and CPU seconds (process CPU time over all threads, steadier than wall time
on a shared machine) of each step, and the process's peak RSS. The bases alternate
(bf16, nf4, bf16, nf4, ...), so that a change in the machine's load hits both alike.

    PYTHONPATH=. python benchmarks/qlora_step.py --checkpoint /work/ckpt7b --rounds 2

The ratio reported is the mean over rounds of (NF4 mean of the steps after the first) over
(bfloat16 mean of the steps after the first), in wall and in CPU time.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time


DATA = "examples/mistral7b/data/declaration_of_independence.txt"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def worker(checkpoint: str, quantize: str | None, steps: int) -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from eqx_lean import lora
    from eqx_lean.hf import FinetuneSettings, adamw, load_hf, load_rows, make_lora_step

    settings = FinetuneSettings(steps=steps)
    model = load_hf(checkpoint, quantize=quantize)
    config = model.config
    eos = config.eos_token_id
    rows = load_rows(
        DATA,
        checkpoint,
        vocab_size=config.vocab_size,
        eos_token_id=eos[0] if isinstance(eos, tuple) else eos,
        seq_len=256,
    )
    lora_config = lora.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)
    model = lora.add_lora(model, lora_config, key=jax.random.key(0))
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    optimizer = adamw(settings.learning_rate, weight_decay=settings.weight_decay)
    opt_state = optimizer.init(adapters)
    step = make_lora_step(optimizer, remat=settings.remat)
    wall, cpu, losses = [], [], []
    for i in range(steps):
        # Rows in order: the step's time does not depend on which row it trains on.
        batch = jnp.asarray(rows[i % rows.shape[0]][None])
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        adapters, opt_state, loss = step(frozen, adapters, opt_state, batch, None)
        losses.append(float(loss))  # waits for the step
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "wall": wall,
                "cpu": cpu,
                "losses": losses,
                "peak_kib": peak_kib,
                "dtype": str(model.dtype),
            }
        )
    )


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quantize", default="nf4")
    parser.add_argument("--worker", choices=["bf16", "nf4", "int8"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.checkpoint, None if args.worker == "bf16" else args.worker, args.steps)
        return
    ratios_wall, ratios_cpu = [], []
    for round_ in range(args.rounds):
        means = {}
        for base in ("bf16", args.quantize):
            command = [sys.executable, __file__, "--checkpoint", args.checkpoint]
            command += ["--steps", str(args.steps), "--worker", base]
            done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
            if done.returncode:
                raise SystemExit(f"{base} run failed:\n{done.stderr[-4000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            wall, cpu = mean(result["wall"][1:]), mean(result["cpu"][1:])
            means[base] = (wall, cpu)
            print(
                f"round {round_ + 1} {base:5}: steps after the first {wall:6.1f} s wall, "
                f"{cpu:6.1f} s CPU (each: {', '.join(f'{s:.1f}' for s in result['wall'][1:])}); "
                f"first {result['wall'][0]:.1f} s; loss {result['losses'][0]:.4f} -> "
                f"{result['losses'][-1]:.4f}; {result['dtype']}; "
                f"peak RSS {result['peak_kib'] / 2**20:.2f} GiB",
                flush=True,
            )
        ratios_wall.append(means[args.quantize][0] / means["bf16"][0])
        ratios_cpu.append(means[args.quantize][1] / means["bf16"][1])
    print(
        f"{args.quantize} / bf16 step time: {mean(ratios_wall):.2f}x wall "
        f"({', '.join(f'{r:.2f}' for r in ratios_wall)}), {mean(ratios_cpu):.2f}x CPU "
        f"({', '.join(f'{r:.2f}' for r in ratios_cpu)})"
    )


if __name__ == "__main__":
    main()
