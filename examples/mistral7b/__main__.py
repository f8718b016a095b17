"""Command line: `python -m examples.mistral7b {build,generate,train}` (from the repository root).

- `build --preset v0.1 --dtype bfloat16`: random-init build of the full model, with the memory
    report (peak RSS over idle versus the model's size), then a forward of 8 tokens and 4
    greedy decode steps. `--layers N` builds a shallower model of the same width; `--preset
    tiny` a 2-layer, width-128 byte-level model (1.8 MiB) that runs every command in seconds.
- `load --checkpoint DIR`: the same report for a HF checkpoint read with `load_hf`: peak
    anonymous memory (the mapped checkpoint pages are page cache), forward and decode.
- `generate --checkpoint DIR --prompt TEXT` (needs `DIR/tokenizer.json`) or `--ids 1,2,3`.
- `train`: the small byte-level training run on the bundled text.
- `finetune --checkpoint DIR --data FILE --rank R --targets q k v o gate up down --steps N
    --save-adapters OUT`: LoRA fine-tuning (optax AdamW on the adapters only, remat), adapters
    written in PEFT's format; prints the peak RSS and the seconds per step. `--grad-accum N`
    runs each batch as N micro-batches; `--save-state DIR [--save-every K]` saves the run
    (adapters, optimizer state, step, dropout key) atomically, and `--resume DIR` continues it
    exactly.
- `merge --checkpoint DIR --adapters AD --out OUT`: folds PEFT adapters into the base, layer by
    layer in place, and writes a HF checkpoint. With `--quantize nf4|int8` (adapters trained
    on a quantised base), the base is loaded quantised and each layer is dequantised and
    merged as it is written.
- `lora-memory --layers 4 --rank 16`: XLA's memory plan for one LoRA step of a full-width
    model (compiled only, nothing allocated), to extrapolate to the full depth.

Every command keeps the programs it compiles in JAX's persistent compilation cache
(`eqx_lean.use_compilation_cache()`: `~/.cache/eqx_lean/xla/<machine>`, or the directory in
`EQX_LEAN_COMPILATION_CACHE`), so running it again compiles nothing; `--no-compilation-cache`
or `EQX_LEAN_COMPILATION_CACHE=off` turns that off. Where that directory cannot be used (a
read-only home, a file in its place), a command warns in one line naming it and runs without
the cache.
"""

import argparse
import dataclasses
import os
import sys
import threading
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_lean
from eqx_lean.internal import status_kib, tree_bytes


def _gib(kib: float) -> str:
    # MiB below 1 GiB, so that the tiny model's 1.5 MiB does not read "0.00 GiB".
    return f"{kib / 2**20:.2f} GiB" if kib >= 2**20 else f"{kib / 1024:.1f} MiB"


class _AnonymousPeak(threading.Thread):
    """Samples `RssAnon` every few milliseconds: the kernel keeps no high-water mark for it.

    Anonymous memory is what the process itself holds; memory-mapped checkpoint pages are
    page cache (`RssFile`), which the kernel reclaims under pressure.
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_kib = status_kib("RssAnon")
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.003):
            self.peak_kib = max(self.peak_kib, status_kib("RssAnon"))

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        return max(self.peak_kib, status_kib("RssAnon"))


def _forward_and_decode(model: Any) -> None:
    from eqx_lean.hf import generate

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
    return tree_bytes(model) / 1024


def _report_totals(sampler: _AnonymousPeak) -> None:
    print(f"whole run: peak RSS {_gib(status_kib('VmHWM'))}, peak anonymous {_gib(sampler.stop())}")


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
    from eqx_lean.hf import save_hf

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
    from eqx_lean.hf import DecoderConfig, init

    config = DecoderConfig.preset(args.preset)
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers)
    if args.dtype:
        config = dataclasses.replace(config, dtype=args.dtype)
    key = jax.random.key(args.seed)
    jax.devices()
    idle = status_kib("VmRSS")
    sampler = _AnonymousPeak()
    sampler.start()
    start = time.perf_counter()
    model = init(config, key=key, progress=True)
    jax.block_until_ready(model)
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM") - idle
    final = _model_kib(model)
    print(f"config: {args.preset}, {config.num_hidden_layers} layers, {config.dtype}")
    print(_step_line("build", "peak RSS over idle", peak, final, seconds))
    _run_and_save(model, sampler, args.save)


def load_command(args: argparse.Namespace) -> None:
    from eqx_lean.hf import load_hf

    if args.quantize and args.save:
        raise SystemExit("--save writes a full-precision checkpoint: not with --quantize.")
    jax.devices()
    idle_anon = status_kib("RssAnon")
    sampler = _AnonymousPeak()
    sampler.start()
    start = time.perf_counter()
    model = load_hf(args.checkpoint, dtype=args.dtype, quantize=args.quantize)
    jax.block_until_ready(model)
    seconds = time.perf_counter() - start
    load_peak = sampler.peak_kib - idle_anon
    final = _model_kib(model)
    print(_step_line("load", "peak anonymous over idle", load_peak, final, seconds))
    _run_and_save(model, sampler, args.save)


def generate_command(args: argparse.Namespace) -> None:
    from eqx_lean.hf import generate, load_hf

    model = load_hf(args.checkpoint, dtype=args.dtype)
    tokenizer = None
    tokenizer_path = os.path.join(args.checkpoint, "tokenizer.json")
    if args.ids:
        ids = [int(t) for t in args.ids.split(",")]
    elif os.path.exists(tokenizer_path):
        from eqx_lean.hf import HFTokenizer

        tokenizer = HFTokenizer(tokenizer_path)
        ids = tokenizer.encode(args.prompt)
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


def finetune_command(args: argparse.Namespace) -> None:
    from eqx_lean.hf import FinetuneSettings, finetune, load_hf, load_rows, save_adapters
    from eqx_lean.lora import LoraConfig

    lora_config = LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha if args.alpha is not None else 2 * args.rank,
        target_modules=_target_modules(args.targets),
        use_rslora=args.rslora,
        lora_dropout=args.dropout,
    )
    model = load_hf(args.checkpoint, dtype=args.dtype, quantize=args.quantize)
    config = model.config
    # Documents are separated by the first end id (the tokenizer's `eos_token`), where a
    # checkpoint lists several.
    eos = config.eos_token_id
    rows = load_rows(
        args.data,
        args.checkpoint,
        vocab_size=config.vocab_size,
        eos_token_id=eos[0] if isinstance(eos, tuple) else eos,
        seq_len=args.seq_len,
    )
    print(f"data: {rows.shape[0]} rows of {rows.shape[1]} tokens; model {model.dtype}")
    settings = FinetuneSettings(
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        seed=args.seed,
        grad_accum=args.grad_accum,
    )
    if args.resume:
        print(f"resumed from {args.resume}")
    model, losses, seconds = finetune(
        model,
        rows,
        lora_config,
        settings,
        progress=True,
        save_state=args.save_state or None,
        save_every=args.save_every,
        resume=args.resume or None,
    )
    if not losses:
        raise SystemExit(f"nothing to run: the state is already at step {args.steps}.")
    later = seconds[1:] or seconds
    print(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; first step {seconds[0]:.2f} s (with "
        f"compilation), then {sum(later) / len(later):.3f} s/step; "
        f"peak RSS {_gib(status_kib('VmHWM'))}"
    )
    if args.save_state:
        print(f"state written to {args.save_state} (resume with --resume)")
    if args.save_adapters:
        save_adapters(model, args.save_adapters)
        print(f"adapters written to {args.save_adapters} (PEFT format)")


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)


def merge_command(args: argparse.Namespace) -> None:
    from eqx_lean.hf import load_adapters, load_hf, save_hf
    from eqx_lean.lora import merge_lora

    # The base's weights, config and tokenizer files are read from one checkpoint opened whole
    # (a save replacing it meanwhile cannot mix two), and the tokenizer files go into the same
    # atomic directory as the merged weights.
    files = ["config.json", *_TOKENIZER_FILES]
    with eqx_lean.open_checkpoint(args.checkpoint, files=files) as base:
        loaded = load_hf(base, dtype=args.dtype, quantize=args.quantize)
        model = load_adapters(loaded, args.adapters)
        tokenizer_files = {
            name: content for name in _TOKENIZER_FILES if (content := base.file(name)) is not None
        }
    if args.quantize:
        # Into the dequantised base the adapters were trained on, one layer at a time.
        save_hf(model, args.out, files=tokenizer_files, merge_adapters=True)
    else:
        # The base weights were loaded for this merge alone, so they are updated in place.
        save_hf(merge_lora(model, donate=True), args.out, files=tokenizer_files)
    print(f"merged checkpoint written to {args.out}; peak RSS {_gib(status_kib('VmHWM'))}")


def lora_memory_command(args: argparse.Namespace) -> None:
    from eqx_lean.hf import DecoderConfig, step_memory
    from eqx_lean.lora import LoraConfig

    config = dataclasses.replace(
        DecoderConfig.preset(args.preset), num_hidden_layers=args.layers, dtype=args.dtype
    )
    lora_config = LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, target_modules=_target_modules(args.targets)
    )
    plan = step_memory(
        config, lora_config, batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype
    )
    print(
        f"{args.preset} width, {args.layers} layers, {args.dtype}, LoRA rank {args.rank} on "
        f"{', '.join(lora_config.target_modules)}, batch {args.batch_size} x {args.seq_len}:"
    )
    for name, nbytes in plan.items():
        print(f"  {name:10} {nbytes / 2**20:10.1f} MiB")


_ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


def _target_modules(targets: list[str]) -> tuple[str, ...]:
    """PEFT's module names for the command line's short ones (`q` -> `q_proj`): `LoraConfig`'s
    `target_modules` are path suffixes, which `q` alone would not match."""
    return tuple(f"{t}_proj" if t in _ALL_TARGETS else t for t in targets)


_QUANTIZE_HELP = "quantise the decoder's linear layers as they load (QLoRA's base: nf4)"


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m examples.mistral7b",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("build", help="random-init build with a memory report")
    p.add_argument("--preset", default="v0.1", choices=["v0.1", "v0.3", "tiny"])
    p.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float32", "float16"],
        help="default: the preset's (bfloat16 for v0.1 and v0.3, float32 for tiny)",
    )
    p.add_argument("--layers", type=int, default=0, help="override the number of layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default="", help="also write the model here with save_hf")
    p.set_defaults(run=build)

    p = commands.add_parser("load", help="load a HF checkpoint with the memory report")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--dtype", default=None)
    p.add_argument("--save", default="", help="also write the model here with save_hf")
    p.add_argument("--quantize", default=None, choices=["nf4", "int8"], help=_QUANTIZE_HELP)
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

    p = commands.add_parser("finetune", help="LoRA fine-tuning of a HF checkpoint (PEFT format)")
    p.add_argument("--checkpoint", required=True, help="HF checkpoint directory (load_hf)")
    p.add_argument("--data", required=True, help="a text file, or JSONL with a `text` field")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=None, help="lora_alpha (default 2 x rank)")
    p.add_argument("--targets", nargs="+", default=_ALL_TARGETS, help="q k v o gate up down")
    p.add_argument("--rslora", action="store_true", help="scale by alpha / sqrt(rank)")
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", default=None, help="the base's dtype (default: the checkpoint's)")
    p.add_argument("--quantize", default=None, choices=["nf4", "int8"], help=_QUANTIZE_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-adapters", default="", help="write the adapters here (PEFT format)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per batch")
    p.add_argument(
        "--save-state", default="", help="save the run here (atomically), to --resume it"
    )
    p.add_argument("--save-every", type=int, default=0, help="steps between saves (0: at end)")
    p.add_argument("--resume", default="", help="continue the run saved in this directory")
    p.set_defaults(run=finetune_command)

    p = commands.add_parser("merge", help="fold PEFT adapters into a HF checkpoint")
    p.add_argument("--checkpoint", required=True, help="the base HF checkpoint directory")
    p.add_argument("--adapters", required=True, help="a PEFT adapter directory")
    p.add_argument("--out", required=True, help="where to write the merged HF checkpoint")
    p.add_argument("--dtype", default=None, help="the merged dtype (default: the checkpoint's)")
    p.add_argument(
        "--quantize",
        default=None,
        choices=["nf4", "int8"],
        help="the adapters were trained on a base quantised so: merge into its dequantised "
        "weights (they are what the adapters were trained against)",
    )
    p.set_defaults(run=merge_command)

    p = commands.add_parser("lora-memory", help="XLA's memory plan of one LoRA training step")
    p.add_argument("--preset", default="v0.1", choices=["v0.1", "v0.3"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", nargs="+", default=_ALL_TARGETS)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.set_defaults(run=lora_memory_command)

    for command in commands.choices.values():
        command.add_argument(
            "--no-compilation-cache",
            action="store_true",
            help="compile every program afresh (default: keep compiled programs in "
            "eqx_lean.use_compilation_cache()'s directory, so a second run compiles nothing)",
        )
    args = parser.parse_args()
    if not args.no_compilation_cache:
        try:
            eqx_lean.use_compilation_cache()
        except OSError as e:
            # The cache only saves compilation time: a directory it cannot use (a read-only
            # home, a file where the directory should be) is no reason to fail the command.
            print(f"warning: running without a compilation cache. {e}", file=sys.stderr)
    args.run(args)


if __name__ == "__main__":
    main()
