"""Command line: `python -m examples.mistral7b {build,generate,train}` (from the repository root).

- `build --preset v0.1 --dtype bfloat16`: random-init build of the full model, with the memory
    report (peak RSS over idle versus the model's size), then a forward of 8 tokens and 4
    greedy decode steps. `--layers N` builds a shallower model of the same width.
- `load --checkpoint DIR`: the same report for a HF checkpoint read with `load_hf`: peak
    anonymous memory (the mapped checkpoint pages are page cache), forward and decode.
- `generate --checkpoint DIR --prompt TEXT` (needs `DIR/tokenizer.json`) or `--ids 1,2,3`.
- `train`: the small byte-level training run on the bundled text.
"""

import argparse
import dataclasses
import os
import threading
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _gib(kib: float) -> str:
    return f"{kib / 2**20:.2f} GiB"


class _AnonymousPeak(threading.Thread):
    """Samples `RssAnon` every few milliseconds: the kernel keeps no high-water mark for it.

    Anonymous memory is what the process itself holds; memory-mapped checkpoint pages are
    page cache (`RssFile`), which the kernel reclaims under pressure.
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_kib = _status_kib("RssAnon")
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.003):
            self.peak_kib = max(self.peak_kib, _status_kib("RssAnon"))

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        return max(self.peak_kib, _status_kib("RssAnon"))


def _forward_and_decode(model: Any) -> None:
    from . import generate

    prompt = jnp.asarray(np.arange(1, 9, dtype=np.int32)[None])
    start = time.perf_counter()
    logits = eqx.filter_jit(lambda m, ids: m(ids))(model, prompt)
    jax.block_until_ready(logits)
    print(
        f"forward of 8 tokens: {time.perf_counter() - start:.1f} s (compile included), "
        f"logits {logits.shape} {logits.dtype}"
    )
    del logits
    start = time.perf_counter()
    ids = generate(model, prompt, 4)
    new_tokens = np.asarray(ids)[0, 8:].tolist()
    print(f"4 greedy tokens: {new_tokens} in {time.perf_counter() - start:.1f} s")


def _model_kib(model: Any) -> float:
    return sum(x.nbytes for x in jax.tree.leaves(model)) / 1024


def _report_totals(sampler: _AnonymousPeak) -> None:
    print(
        f"whole run: peak RSS {_gib(_status_kib('VmHWM'))}, peak anonymous {_gib(sampler.stop())}"
    )


def _step_line(step: str, what: str, peak_kib: float, final_kib: float, seconds: float) -> str:
    return (
        f"{step}: final {_gib(final_kib)}, {what} {_gib(peak_kib)}, "
        f"ratio {peak_kib / final_kib:.3f}, {seconds:.1f} s"
    )


def _run_and_save(model: Any, sampler: "_AnonymousPeak", save: str) -> None:
    """Forward and decode with the whole run's memory report, then `save_hf` if asked."""
    _forward_and_decode(model)
    _report_totals(sampler)
    if save:
        _save_with_report(model, save)


def _save_with_report(model: Any, path: str) -> None:
    from . import save_hf

    sampler = _AnonymousPeak()
    sampler.start()
    start = time.perf_counter()
    save_hf(model, path)
    seconds = time.perf_counter() - start
    print(
        f"saved to {path} in {seconds:.1f} s: peak anonymous {_gib(sampler.stop())} "
        f"for a model of {_gib(_model_kib(model))}"
    )


def build(args: argparse.Namespace) -> None:
    from . import MistralConfig, init

    config = MistralConfig.preset(args.preset)
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers)
    config = dataclasses.replace(config, dtype=args.dtype)
    key = jax.random.key(args.seed)
    jax.devices()
    idle = _status_kib("VmRSS")
    sampler = _AnonymousPeak()
    sampler.start()
    start = time.perf_counter()
    model = init(config, key=key, progress=True)
    jax.block_until_ready(model)
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM") - idle
    final = _model_kib(model)
    print(f"config: {args.preset}, {config.num_hidden_layers} layers, {args.dtype}")
    print(_step_line("build", "peak RSS over idle", peak, final, seconds))
    _run_and_save(model, sampler, args.save)


def load_command(args: argparse.Namespace) -> None:
    from . import load_hf

    jax.devices()
    idle_anon = _status_kib("RssAnon")
    sampler = _AnonymousPeak()
    sampler.start()
    start = time.perf_counter()
    model = load_hf(args.checkpoint, dtype=args.dtype)
    jax.block_until_ready(model)
    seconds = time.perf_counter() - start
    load_peak = sampler.peak_kib - idle_anon
    final = _model_kib(model)
    print(_step_line("load", "peak anonymous over idle", load_peak, final, seconds))
    _run_and_save(model, sampler, args.save)


def generate_command(args: argparse.Namespace) -> None:
    from . import generate, load_hf

    model = load_hf(args.checkpoint, dtype=args.dtype)
    tokenizer = None
    tokenizer_path = os.path.join(args.checkpoint, "tokenizer.json")
    if args.ids:
        ids = [int(t) for t in args.ids.split(",")]
    elif os.path.exists(tokenizer_path):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(tokenizer_path)
        ids = tokenizer.encode(args.prompt).ids
    else:
        raise SystemExit(f"--ids is needed: {tokenizer_path} does not exist.")
    key = jax.random.key(args.seed) if args.temperature > 0 else None
    out = generate(
        model,
        jnp.asarray([ids], jnp.int32),
        args.max_new_tokens,
        key=key,
        temperature=args.temperature,
        top_k=args.top_k,
    )
    new_ids = np.asarray(out)[0, len(ids) :].tolist()
    print(tokenizer.decode(new_ids) if tokenizer else new_ids)


def train_command(args: argparse.Namespace) -> None:
    from .train import TrainSettings, load_text, split_text, train, unigram_entropy

    settings = TrainSettings(steps=args.steps, seed=args.seed)
    _, losses, held_out = train(settings=settings)
    entropy = unigram_entropy(split_text(load_text())[1])
    print(f"held-out loss {held_out:.4f} nats/byte; unigram entropy {entropy:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m examples.mistral7b",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("build", help="random-init build with a memory report")
    p.add_argument("--preset", default="v0.1", choices=["v0.1", "v0.3"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--layers", type=int, default=0, help="override the number of layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default="", help="also write the model here with save_hf")
    p.set_defaults(run=build)

    p = commands.add_parser("load", help="load a HF checkpoint with the memory report")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--dtype", default=None)
    p.add_argument("--save", default="", help="also write the model here with save_hf")
    p.set_defaults(run=load_command)

    p = commands.add_parser("generate", help="generate from a HF checkpoint directory")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompt", default="The")
    p.add_argument("--ids", default="", help="comma-separated token ids instead of --prompt")
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=generate_command)

    p = commands.add_parser("train", help="train a small model on the bundled text")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=train_command)

    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
