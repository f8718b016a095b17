"""Time to first logits: load a checkpoint and run one 16-token forward pass, against
`transformers`, each in a fresh process, alternated, with the page cache warm.

Methods (each a fresh process; the timer starts after the imports):

- `transformers`: `AutoModelForCausalLM.from_pretrained(hf_checkpoint, dtype=bfloat16)`, then
  a forward pass under `torch.no_grad()` (transformers 5 maps the file and reads it lazily);
- `eqx_lean`: `load_hf(hf_checkpoint)` (every tensor copied into memory of its own), then
  the jitted forward pass;
- `eqx_lean file_backed`: `load_hf(eqx_checkpoint, file_backed=True)` (the arrays are the
  file's pages), then the jitted forward pass.

eqx_lean's forward pass is compiled in each fresh process unless the persistent compilation
cache holds it; both cases are measured: `--compilation-cache DIR` makes each eqx_lean process
call `eqx_lean.use_compilation_cache(DIR)` after one warm-up run has filled it.

Also measured, in its own process: the rate of a plain copy of the checkpoint's bytes (from
its memory-mapped files, page cache warm) into freshly allocated memory, first touch included
(`np.copyto` into `np.empty`), beside which eqx_lean's copying load rate is reported.

    PYTHONPATH=. python benchmarks/first_logits.py --hf /work/ckpt1b_hf --eqx /work/ckpt1b_eqx

The 1.1B checkpoints there: the Mistral shape of `docs/benchmarks.md`, random bfloat16 weights,
`--hf` written by `transformers` (`save_pretrained`), `--eqx` by `eqx_lean.hf.save_hf`.
"""

import argparse
import functools
import json
import mmap
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _worker_runs import run_json, tokens


SEQ = 16


def _rss_kib() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def _weight_files(checkpoint: str) -> list[Path]:
    return sorted(Path(checkpoint).glob("*.safetensors"))


def _result(times: tuple[float, float, float], logits, nbytes: int, anon_before: int) -> dict:
    """A run's figures: `times` are the start, the end of the load and the first logits."""
    start, loaded, done = times
    return {
        "load": loaded - start,
        "first_logits": done - start,
        "logit": float(logits[0, -1, 0]),
        "bytes": nbytes,
        "anon_before": anon_before,
    } | _rss_kib()


def eqx_worker(checkpoint: str, file_backed: bool, cache: str | None) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import eqx_lean
    from eqx_lean.hf import load_hf
    from eqx_lean.internal import tree_bytes

    if cache:
        eqx_lean.use_compilation_cache(cache)
    jnp.zeros(1).block_until_ready()  # JAX's runtime up before the timer, as torch's is
    before = _rss_kib()["RssAnon"]
    start = time.perf_counter()
    model = load_hf(checkpoint, file_backed=file_backed)
    jax.block_until_ready(model)
    loaded = time.perf_counter()
    ids = jnp.asarray([tokens(model.config.vocab_size, SEQ)], dtype=jnp.int32)
    logits = np.asarray(eqx.filter_jit(lambda m, i: m(i))(model, ids))
    done = time.perf_counter()
    nbytes = tree_bytes(model)
    return _result((start, loaded, done), logits, nbytes, before)


def torch_worker(checkpoint: str) -> dict:
    import torch
    import transformers

    before = _rss_kib()["RssAnon"]
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    loaded = time.perf_counter()
    ids = torch.tensor([tokens(model.config.vocab_size, SEQ)], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().numpy()
    done = time.perf_counter()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return _result((start, loaded, done), logits, nbytes, before)


def _copy_piece(target, source, piece: int, start: int) -> None:
    np.copyto(target[start : start + piece], source[start : start + piece])


def _timed_copy(file: Path, pool, piece: int = 16 * 2**20) -> tuple[int, float]:
    """Bytes and seconds of copying `file` (freshly mapped) into fresh memory over `pool`."""

    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        source = np.frombuffer(m, np.uint8)
        start = time.perf_counter()
        target = np.empty_like(source)  # untouched pages: the copy faults each one in
        pieces = range(0, source.nbytes, piece)
        list(pool.map(functools.partial(_copy_piece, target, source, piece), pieces))
        seconds = time.perf_counter() - start
        del source
        return target.nbytes, seconds


def copy_worker(checkpoint: str, threads: int, repeats: int = 3) -> dict:
    """GB/s of copying the checkpoint's files (freshly mapped, page cache warm) into freshly
    allocated memory with `threads` threads, `repeats` times in one process: the first (a fresh
    process's first large allocation, as a load's is) and the best."""
    from concurrent.futures import ThreadPoolExecutor

    rates, total = [], 0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            copies = [_timed_copy(file, pool) for file in _weight_files(checkpoint)]
            total = sum(n for n, _ in copies)
            rates.append(total / sum(t for _, t in copies) / 1e9)
    return {"bytes": total, "first": rates[0], "best": max(rates)}


def _warm(checkpoint: str) -> None:
    for file in _weight_files(checkpoint):
        with open(file, "rb") as f:
            while f.read(64 * 2**20):
                pass


def _run(args: argparse.Namespace, worker: str, cache: str | None = None) -> dict:
    command = [sys.executable, __file__, "--hf", args.hf, "--eqx", args.eqx, "--worker", worker]
    if cache:
        command += ["--compilation-cache", cache]
    return run_json(command)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hf", required=True, help="a checkpoint transformers wrote")
    parser.add_argument("--eqx", required=True, help="the same weights, saved by eqx_lean")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compilation-cache")
    workers = ["transformers", "eqx_lean", "file_backed", "copy1", "copy2"]
    parser.add_argument("--worker", choices=workers, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cache = args.compilation_cache
    if args.worker:
        workers = {
            "transformers": lambda: torch_worker(args.hf),
            "eqx_lean": lambda: eqx_worker(args.hf, False, cache),
            "file_backed": lambda: eqx_worker(args.eqx, True, cache),
            "copy1": lambda: copy_worker(args.hf, 1),
            "copy2": lambda: copy_worker(args.hf, 2),
        }
        print(json.dumps(workers[args.worker]()))
        return
    with tempfile.TemporaryDirectory() as cache_dir:
        _warm(args.hf)
        _warm(args.eqx)
        _run(args, "file_backed", cache_dir)  # fills the compilation cache
        for round_ in range(args.rounds):
            _warm(args.hf)
            _warm(args.eqx)
            for threads in (1, 2):
                copy = _run(args, f"copy{threads}")
                print(
                    f"round {round_ + 1} copy of {copy['bytes'] / 2**30:.2f} GiB into fresh "
                    f"memory, {threads} thread(s): first in its process {copy['first']:.2f} GB/s, "
                    f"best of 3 {copy['best']:.2f} GB/s",
                    flush=True,
                )
            runs = [("transformers", None), ("eqx_lean", None), ("eqx_lean", cache_dir)]
            runs += [("file_backed", None), ("file_backed", cache_dir)]
            for worker, with_cache in runs:
                r = _run(args, worker, with_cache)
                label = worker + (" (compilation cache)" if with_cache else "")
                added = r["RssAnon"] - r["anon_before"]
                rate = f", {r['bytes'] / r['load'] / 1e9:.2f} GB/s" if worker == "eqx_lean" else ""
                print(
                    f"round {round_ + 1} {label:34}: first logits {r['first_logits']:5.2f} s "
                    f"(load {r['load']:5.2f} s{rate}); anonymous memory added "
                    f"{added / 2**20:5.2f} GiB ({added * 1024 / r['bytes']:5.1%} of the model's "
                    f"{r['bytes'] / 2**30:.2f} GiB; {r['RssAnon'] / 2**20:.2f} GiB in all), "
                    f"file-backed {r['RssFile'] / 2**20:5.2f} GiB; logit {r['logit']:.4f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
