"""Loading a whole Mistral-shaped checkpoint: memory over the loaded bytes, and throughput.

Writes a random Mistral checkpoint in Hugging Face's layout (`config.json`, safetensors shards
of at most 2 GiB, `model.safetensors.index.json`), streamed to disk by a small writer here so
that no model is ever held in memory, then loads it with each method in a fresh process,
alternating the methods, `--repeat` times:

- `eqx_lean`: the Mistral example's `load_hf(dir)`, which is `eqx_lean.load_tensors` of the
  whole model (strict: every tensor mapped) straight into its final buffers. With
  `--devices 8` the load is sharded over 8 forced CPU devices with `eqx_lean.fsdp(mesh)`.
- `safetensors_flax`: `safetensors.flax.load_file` of every file (a dict of JAX arrays, not a
  model): the throughput baseline.
- `safetensors_numpy`: `safetensors.numpy.load_file` of every file (host arrays only).

Memory follows the project's protocol (`/work/shared/design.md`): idle is the child's
`RssAnon` / `VmRSS` after its imports, `jax.devices()` and the config; the checkpoint is
memory-mapped, so its pages are page cache, and the peak that counts is the anonymous one,
`RssAnon` sampled every ~2 ms from `/proc/<pid>/status` by this parent process (the child's
GIL cannot hide a peak). The bar of issue 13: peak anonymous over idle, minus the bytes the
process holds once loaded (every device's shards), is at most 40 MiB, compilation included.
`file_rss_drop` is how far `RssFile` fell below its idle value during the load (pages of shared
libraries evicted by memory pressure from other processes lower a measured peak: re-run a
figure taken with a large drop). `compiles` counts XLA compilations during the load
(`jax.monitoring`). After the measurement, the child checks the loaded model bitwise against
`safetensors.safe_open` (every tensor at `small`, layers 0, L/2 and L-1 and the plain tensors
above it).

Usage (the page cache is warmed before the first method, for every method alike):

    python benchmarks/io_load.py --size small               # 0.43 GiB (12 layers, d=1024)
    python benchmarks/io_load.py --size 4gib                # 4.3 GiB (40 layers, d=2048)
    python benchmarks/io_load.py --size small --devices 8   # sharded over 8 forced devices
    python benchmarks/io_load.py --size 7b --methods eqx_lean --repeat 1   # 13.5 GiB: needs
        # ~15 GiB free for the load plus the page cache of the files; run it on a quiet machine

`--writes compiled` runs the compiled chunk writes that GPUs and TPUs use on CPU too
(`eqx_lean.internal.chunks.HOST_WRITES = False`); the default is CPU's host writes. `--code DIR`
loads with the `eqx_lean` and example of another checkout (for before/after figures).

`--offsets hf` (default) writes tensors at offsets that are not 64-byte aligned, as most
checkpoints written by the `safetensors` library are; `--offsets aligned` pads the header so
every tensor starts 64-byte aligned, as `eqx_lean.save_tensors` and the example's `save_hf`
write them. `--dir DIR --keep` keeps the checkpoint for later runs (`--reuse`).
"""

import argparse
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
GIB, MIB = 2**30, 2**20
BAR_MIB = 40  # anonymous memory over idle, beyond the loaded bytes

SIZES = {
    # Mistral-shaped: the 0.43 GiB checkpoint, the 4 GiB one, and Mistral-7B-v0.1.
    "small": dict(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
    "4gib": dict(
        hidden_size=2048,
        intermediate_size=7168,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
    "7b": {},  # DecoderConfig's defaults are Mistral-7B-v0.1
}
METHODS = ("eqx_lean", "safetensors_flax", "safetensors_numpy")
SHARD_BYTES = 2 * GIB


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The memory lines of /proc/<pid>/status, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def mistral_config(size: str):
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))  # after PYTHONPATH, which `--code` sets in the children
    from eqx_lean.hf import DecoderConfig

    return DecoderConfig(**SIZES[size], dtype="bfloat16")


def hf_tensors(config) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a HF Mistral checkpoint, in HF's order, with its shape."""
    d, kv = config.hidden_size, config.num_key_value_heads * config.resolved_head_dim
    q, hidden = config.num_attention_heads * config.resolved_head_dim, config.intermediate_size
    block = [
        ("input_layernorm.weight", (d,)),
        ("self_attn.q_proj.weight", (q, d)),
        ("self_attn.k_proj.weight", (kv, d)),
        ("self_attn.v_proj.weight", (kv, d)),
        ("self_attn.o_proj.weight", (d, q)),
        ("post_attention_layernorm.weight", (d,)),
        ("mlp.gate_proj.weight", (hidden, d)),
        ("mlp.up_proj.weight", (hidden, d)),
        ("mlp.down_proj.weight", (d, hidden)),
    ]
    tensors: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (config.vocab_size, d))
    ]
    for i in range(config.num_hidden_layers):
        tensors += [(f"model.layers.{i}.{name}", shape) for name, shape in block]
    return tensors + [("model.norm.weight", (d,)), ("lm_head.weight", (config.vocab_size, d))]


# ------------------------------------------------------------------------------------------
# The writer: random bfloat16 tensors streamed into safetensors shards, never all in memory.


def write_checkpoint(directory: Path, config, aligned: bool, seed: int = 0) -> int:
    import numpy as np

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in hf_tensors(config):
        nbytes = math.prod(shape) * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in shard:
            nbytes = math.prod(shape) * 2
            header[name] = {
                "dtype": "BF16",
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            weight_map[name] = file
        raw = json.dumps(header, separators=(",", ":")).encode()
        # Padded with spaces as the safetensors library pads (to 8 bytes); `aligned` pads the
        # data start to 64 bytes, `hf` offsets make sure it is not 64-byte aligned.
        raw += b" " * (-(8 + len(raw)) % 8)
        if aligned:
            raw += b" " * (-(8 + len(raw)) % 64)
        elif (8 + len(raw)) % 64 == 0:
            raw += b" " * 8
        with open(directory / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for _, shape in shard:
                count = math.prod(shape)
                for start in range(0, count, 16 * MIB):
                    # Finite, positive bfloat16 values of moderate size (bits 0x3c00..0x3fff).
                    bits = rng.integers(0x3C00, 0x4000, min(16 * MIB, count - start), np.uint16)
                    f.write(bits.tobytes())
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def warm_page_cache(directory: Path) -> None:
    for file in sorted(directory.iterdir()):
        with open(file, "rb") as f:
            while f.read(64 * MIB):
                pass


# ------------------------------------------------------------------------------------------
# Child side: one method in a fresh process.


def report(tag: str, **values) -> None:
    print(tag, json.dumps(values), flush=True)


def held_bytes(tree) -> int:
    """Bytes the process holds for `tree`: every addressable shard (replicas count each time)."""
    import jax

    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            total += sum(s.data.nbytes for s in x.addressable_shards)
        elif hasattr(x, "nbytes"):
            total += x.nbytes
    return total


def load_with(method: str, directory: Path, devices: int, writes: str):
    import jax

    files = sorted(directory.glob("*.safetensors"))
    if method == "eqx_lean":
        import eqx_lean
        from eqx_lean.hf import load_hf

        if writes == "compiled":
            try:
                from eqx_lean.internal import chunks
            except ImportError:  # a `--code` checkout older than `eqx_lean.internal`
                from eqx_lean._core import chunks

            chunks.HOST_WRITES = False
        sharding = None
        if devices > 1:
            sharding = eqx_lean.fsdp(jax.make_mesh((devices,), ("data",)))
        return load_hf(directory, sharding=sharding)
    if method == "safetensors_flax":
        import safetensors.flax

        return {k: v for f in files for k, v in safetensors.flax.load_file(f).items()}
    if method == "safetensors_numpy":
        import safetensors.numpy

        return {k: v for f in files for k, v in safetensors.numpy.load_file(f).items()}
    raise ValueError(f"unknown method {method!r}")


def verify(loaded, directory: Path, config, full: bool) -> int:
    """The loaded model against `safe_open`, bitwise; returns the number of tensors checked."""
    import jax
    import numpy as np
    from safetensors import safe_open

    def hf_name(path) -> str:
        # The example's leaves follow HF's attribute names (see its `hf.py`).
        key = jax.tree_util.keystr(path)
        if key.startswith(".layers."):
            return "model.layers.{i}." + key.removeprefix(".layers.")
        return {
            ".embed_tokens.weight": "model.embed_tokens.weight",
            ".norm.weight": "model.norm.weight",
            ".lm_head.weight": "lm_head.weight",
        }[key]

    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    last = config.num_hidden_layers - 1
    layers = range(last + 1) if full else sorted({0, last // 2, last})
    checked = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(loaded):
        if not isinstance(leaf, jax.Array):
            continue
        template = hf_name(path)
        for layer in layers if "{i}" in template else [None]:
            name = template if layer is None else template.format(i=layer)
            with safe_open(directory / index[name], "numpy") as f:
                reference = f.get_tensor(name)
            found = np.asarray(leaf if layer is None else leaf[layer])
            assert found.dtype == reference.dtype, (name, found.dtype, reference.dtype)
            assert (found.view(np.uint16) == reference.view(np.uint16)).all(), name
            checked += 1
    return checked


def child_load(directory: Path, method: str, size: str, devices: int, writes: str) -> None:
    import jax
    import safetensors.flax  # noqa: F401  (imported by every method, so every idle has it)

    import eqx_lean  # noqa: F401
    from eqx_lean.hf import load_hf  # noqa: F401

    config = mistral_config(size)
    jax.devices()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration_secs, **_: (
            compiles.append(duration_secs)
            if event == "/jax/core/compile/backend_compile_duration"
            else None
        )
    )
    idle = proc_status()
    report("idle", **idle)
    start = time.perf_counter()
    loaded = load_with(method, directory, devices, writes)
    jax.block_until_ready(loaded)
    seconds = time.perf_counter() - start
    report(
        "done",
        idle=idle,
        end=proc_status(),
        held_bytes=held_bytes(loaded),
        load_s=seconds,
        compiles=len(compiles),
        loadavg=os.getloadavg()[0],
    )
    sys.stdin.readline()  # the parent stops sampling before the check allocates anything
    if method == "eqx_lean":
        report("verified", tensors=verify(loaded, directory, config, full=size == "small"))


# ------------------------------------------------------------------------------------------
# Parent side: each method in a fresh process, its memory sampled from here.


class Sampler(threading.Thread):
    def __init__(self, pid: int, interval: float = 0.002):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_anon = 0
        self.min_file: int | None = None
        self.samples = 0
        self.running = True

    def run(self) -> None:
        while self.running:
            try:
                status = proc_status(self.pid)
            except (FileNotFoundError, ProcessLookupError, ValueError):
                break
            self.peak_anon = max(self.peak_anon, status.get("RssAnon", 0))
            file = status.get("RssFile", 0)
            self.min_file = file if self.min_file is None else min(self.min_file, file)
            self.samples += 1
            time.sleep(self.interval)


def run_child(
    directory: Path, method: str, size: str, devices: int, writes: str, code: Path
) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(code))
    env.pop("XLA_FLAGS", None)
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    args = ["--child", method, str(directory), "--size", size, "--devices", str(devices)]
    args += ["--writes", writes]
    child = subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    sampler: Sampler | None = None
    result: dict = {"loadavg_before": os.getloadavg()[0]}
    assert child.stdout is not None and child.stdin is not None
    for line in child.stdout:
        tag, _, payload = line.partition(" ")
        if tag == "idle":
            sampler = Sampler(child.pid)
            sampler.start()
        elif tag == "done":
            assert sampler is not None
            sampler.running = False
            sampler.join()
            result |= json.loads(payload)
            child.stdin.write("go\n")
            child.stdin.flush()
        elif tag == "verified":
            result["verified_tensors"] = json.loads(payload)["tensors"]
        else:
            print(line, end="")
    if child.wait() != 0:
        raise RuntimeError(f"child {args} failed with exit code {child.returncode}")
    assert sampler is not None
    idle, held = result["idle"], result["held_bytes"]
    anon = sampler.peak_anon - idle["RssAnon"]
    return {
        "method": method,
        "held_gib": held / GIB,
        "load_s": result["load_s"],
        "gib_per_s": held / GIB / result["load_s"],
        "anon_over_idle_mib": anon / MIB,
        "overhead_mib": (anon - held) / MIB,
        "anon_ratio": anon / held,
        "rss_over_idle_mib": (result["end"]["VmHWM"] - idle["VmRSS"]) / MIB,
        "file_rss_drop_mib": max(0, idle["RssFile"] - (sampler.min_file or 0)) / MIB,
        "compiles": result["compiles"],
        "loadavg": (result["loadavg_before"], result["loadavg"]),
        "samples": sampler.samples,
        "verified_tensors": result.get("verified_tensors"),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| run | method | load time | throughput | anonymous over idle | minus loaded bytes "
        "| compiles | file RSS drop | load avg |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, r in enumerate(rows):
        lines.append(
            f"| {k + 1} | `{r['method']}` | {r['load_s']:.2f} s | {r['gib_per_s']:.2f} GiB/s | "
            f"{r['anon_over_idle_mib']:.0f} MiB ({r['anon_ratio']:.3f} x) | "
            f"{r['overhead_mib']:.1f} MiB | {r['compiles']} | {r['file_rss_drop_mib']:.1f} MiB | "
            f"{r['loadavg'][0]:.1f} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    lines = []
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        speed = [r["gib_per_s"] for r in mine]
        over = [r["overhead_mib"] for r in mine]
        lines.append(
            f"{method}: throughput median {statistics.median(speed):.2f} GiB/s "
            f"(min {min(speed):.2f}, max {max(speed):.2f}); over idle minus loaded bytes "
            f"median {statistics.median(over):.1f} MiB (max {max(over):.1f})"
        )
        if method == "eqx_lean":
            verdict = "meets" if max(over) <= BAR_MIB else "MISSES"
            lines.append(f"  {verdict} the bar of {BAR_MIB} MiB in every run")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--devices", type=int, default=1, help="forced CPU devices (eqx_lean)")
    parser.add_argument("--offsets", choices=("hf", "aligned"), default="hf")
    parser.add_argument("--writes", choices=("host", "compiled"), default="host")
    parser.add_argument("--code", type=Path, default=REPO, help="checkout whose eqx_lean loads")
    parser.add_argument("--methods", nargs="+", default=["eqx_lean", "safetensors_flax"])
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds")
    parser.add_argument("--dir", type=Path, help="where to write the checkpoint (default: temp)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    parser.add_argument("--reuse", action="store_true", help="load the checkpoint in --dir as is")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_load(Path(args.child[1]), args.child[0], args.size, args.devices, args.writes)
        return
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")

    base = args.dir or Path(tempfile.mkdtemp(prefix="eqx_lean_io_"))
    directory = base / f"mistral-{args.size}-{args.offsets}"
    config = mistral_config(args.size)
    try:
        if not args.reuse:
            shutil.rmtree(directory, ignore_errors=True)
            start = time.perf_counter()
            total = write_checkpoint(directory, config, aligned=args.offsets == "aligned")
            print(
                f"wrote {total / GIB:.2f} GiB ({args.size}, {args.offsets} offsets) in "
                f"{time.perf_counter() - start:.1f} s to {directory}",
                flush=True,
            )
        warm_page_cache(directory)
        rows = []
        for _ in range(args.repeat):
            for method in args.methods:
                devices = args.devices if method == "eqx_lean" else 1
                rows.append(
                    run_child(directory, method, args.size, devices, args.writes, args.code)
                )
                print(json.dumps(rows[-1]), flush=True)
        print(
            f"\nsize {args.size}, offsets {args.offsets}, eqx_lean on {args.devices} device(s), "
            f"{args.writes} writes, code {args.code}"
        )
        print(table(rows))
        print(summary(rows))
        if args.json:
            args.json.write_text(
                json.dumps(
                    {"args": vars(args) | {"dir": str(base)}, "rows": rows}, indent=2, default=str
                )
            )
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
            if args.dir is None:
                shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
