"""Loading a Mistral-shaped stacked model from safetensors: memory and throughput.

Writes a stacked model of Mistral-shaped blocks in bfloat16 with `eqx_lean.save_stacked` (one
tensor per layer, Hugging Face names, several files and an index), then loads it with each
method below, each in a fresh process, and reports:

- the peak anonymous resident memory over idle (`RssAnon`, sampled every ~2 ms from
  `/proc/<pid>/status` by this parent process, so the child's GIL cannot hide a peak): pages of a
  memory-mapped checkpoint are page cache and do not count here;
- the peak total resident memory over idle (`VmHWM`, exact, read by the child);
- the load time and throughput (loaded GiB per second, compilation included), with the page
  cache warm for every method (the files are read once before the first method), and the time
  of a second load in the same process (compilations cached; memory not measured).

Methods:

- `eqx_lean`: `eqx_lean.load_stacked` into preallocated buffers, one layer at a time.
- `safetensors_numpy`: `safetensors.numpy.load_file` of every file (a dict of NumPy arrays, not
  stacked, not on a JAX device): the throughput baseline.
- `safetensors_flax`: `safetensors.flax.load_file` of every file (a dict of JAX arrays).
- `naive_stack`: `safetensors.numpy.load_file`, then `jnp.stack` of each leaf's layers: what an
  Equinox user writes today.

Usage (the default is the issue's configuration: 40 blocks, d=2048, hidden 7168, 16 heads, 4 KV
heads, 4.06 GiB in bfloat16; it needs ~14 GiB of memory at its peak, in `naive_stack` (3.4 x);
the other methods stay under ~5.5 GiB):

    python benchmarks/io_load.py            # full size
    python benchmarks/io_load.py --small    # 0.30 GiB, a quick check
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


CONFIGS = {
    # Mistral-shaped blocks: RMSNorm, attention with grouped KV heads, gated MLP.
    "issue": dict(num_layers=40, dim=2048, hidden=7168, heads=16, kv_heads=4, shard_gib=2.0),
    "small": dict(num_layers=12, dim=1024, hidden=3584, heads=8, kv_heads=2, shard_gib=0.125),
}
METHODS = ("eqx_lean", "safetensors_numpy", "safetensors_flax", "naive_stack")
BAR = 1.10  # peak anonymous memory over idle, as a multiple of the loaded bytes

HF_BLOCK = {
    ".attn_norm": "model.layers.{i}.input_layernorm.weight",
    ".q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    ".k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    ".v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    ".o.weight": "model.layers.{i}.self_attn.o_proj.weight",
    ".mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    ".gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    ".up.weight": "model.layers.{i}.mlp.up_proj.weight",
    ".down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The memory lines of /proc/<pid>/status, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


# ------------------------------------------------------------------------------------------
# Child side: one method in a fresh process.


def child_setup(config: dict):
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import eqx_lean

    class Block(eqx.Module):
        attn_norm: jax.Array
        q: eqx.nn.Linear
        k: eqx.nn.Linear
        v: eqx.nn.Linear
        o: eqx.nn.Linear
        mlp_norm: jax.Array
        gate: eqx.nn.Linear
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, dim, hidden, heads, kv_heads, *, key):
            head_dim = dim // heads
            kq, kk, kv, ko, kg, ku, kd = jax.random.split(key, 7)
            self.attn_norm = jnp.ones(dim)
            self.q = eqx.nn.Linear(dim, heads * head_dim, use_bias=False, key=kq)
            self.k = eqx.nn.Linear(dim, kv_heads * head_dim, use_bias=False, key=kk)
            self.v = eqx.nn.Linear(dim, kv_heads * head_dim, use_bias=False, key=kv)
            self.o = eqx.nn.Linear(heads * head_dim, dim, use_bias=False, key=ko)
            self.mlp_norm = jnp.ones(dim)
            self.gate = eqx.nn.Linear(dim, hidden, use_bias=False, key=kg)
            self.up = eqx.nn.Linear(dim, hidden, use_bias=False, key=ku)
            self.down = eqx.nn.Linear(hidden, dim, use_bias=False, key=kd)

    def make_block(key):
        return Block(config["dim"], config["hidden"], config["heads"], config["kv_heads"], key=key)

    def names(path, leaf):
        return HF_BLOCK[jax.tree_util.keystr(path)]

    jax.devices()
    keys = jax.random.split(jax.random.key(0), config["num_layers"])
    like = eqx.filter_eval_shape(eqx_lean.build_stacked, make_block, keys, jnp.bfloat16)
    return make_block, keys, like, names


def nbytes(tree) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def report(tag: str, **values):
    print(tag, json.dumps(values), flush=True)


def wait_for_parent():
    sys.stdin.readline()


def child_write(config: dict, directory: Path):
    import jax
    import jax.numpy as jnp

    import eqx_lean

    make_block, keys, _, names = child_setup(config)
    idle = proc_status()
    report("idle", **idle)
    start = time.perf_counter()
    stacked = eqx_lean.build_stacked(make_block, keys, jnp.bfloat16)
    jax.block_until_ready(stacked)
    built = time.perf_counter()
    hwm_built = proc_status()["VmHWM"]
    shard_bytes = int(config["shard_gib"] * 2**30)
    eqx_lean.save_stacked(directory, stacked, names, max_shard_bytes=shard_bytes)
    saved = time.perf_counter()
    report(
        "done",
        idle=idle,
        end=proc_status(),
        hwm_built=hwm_built,
        loaded_bytes=nbytes(stacked),
        build_s=built - start,
        save_s=saved - built,
    )


def load_with(method: str, directory: Path, like, names, num_layers: int):
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import eqx_lean

    files = sorted(directory.glob("*.safetensors"))
    if method == "eqx_lean":
        return eqx_lean.load_stacked(directory, like, names)
    if method == "safetensors_numpy":
        import safetensors.numpy

        return {k: v for f in files for k, v in safetensors.numpy.load_file(f).items()}
    if method == "safetensors_flax":
        import safetensors.flax

        return {k: v for f in files for k, v in safetensors.flax.load_file(f).items()}
    if method == "naive_stack":
        import safetensors.numpy

        tensors = {k: v for f in files for k, v in safetensors.numpy.load_file(f).items()}
        params, static = eqx.partition(like, lambda x: isinstance(x, jax.ShapeDtypeStruct))
        stacked = jax.tree_util.tree_map_with_path(
            lambda path, _: jnp.stack(
                [tensors[names(path, None).format(i=i)] for i in range(num_layers)]
            ),
            params,
        )
        del tensors
        return eqx.combine(stacked, static)
    raise ValueError(f"unknown method {method!r}")


def verify(method: str, loaded, directory: Path, names, num_layers: int):
    """Layers 0 and L-1 of every leaf against safetensors' own reader, bitwise."""
    import equinox as eqx
    import jax
    import numpy as np
    from safetensors import safe_open

    if method != "eqx_lean" and method != "naive_stack":
        return
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(loaded, eqx.is_array))[0]
    for path, leaf in leaves:
        for layer in (0, num_layers - 1):
            name = names(path, None).format(i=layer)
            with safe_open(directory / index[name], "numpy") as f:
                reference = f.get_tensor(name)
            found = np.asarray(leaf[layer])
            assert found.dtype == reference.dtype, (name, found.dtype, reference.dtype)
            assert (found.view(np.uint16) == reference.view(np.uint16)).all(), name


def child_load(config: dict, directory: Path, method: str):
    import jax

    _, _, like, names = child_setup(config)
    import safetensors.numpy  # noqa: F401  (in every method's idle, whether it uses it or not)

    idle = proc_status()
    report("idle", **idle)
    start = time.perf_counter()
    loaded = load_with(method, directory, like, names, config["num_layers"])
    jax.block_until_ready(loaded)
    seconds = time.perf_counter() - start
    report("done", idle=idle, end=proc_status(), loaded_bytes=nbytes(loaded), load_s=seconds)
    wait_for_parent()  # the parent stops sampling before the check below allocates anything
    verify(method, loaded, directory, names, config["num_layers"])
    report("verified")
    # Again in the same process: compilations are cached now (memory is not measured here).
    del loaded
    start = time.perf_counter()
    loaded = load_with(method, directory, like, names, config["num_layers"])
    jax.block_until_ready(loaded)
    report("again", load_s=time.perf_counter() - start)


# ------------------------------------------------------------------------------------------
# Parent side: run each method in a fresh process and sample its memory.


class Sampler(threading.Thread):
    def __init__(self, pid: int, interval: float = 0.002):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_anon = self.peak_rss = 0
        self.samples = 0
        self.running = True

    def run(self):
        while self.running:
            try:
                status = proc_status(self.pid)
            except (FileNotFoundError, ProcessLookupError, ValueError):
                break
            self.peak_anon = max(self.peak_anon, status.get("RssAnon", 0))
            self.peak_rss = max(self.peak_rss, status.get("VmRSS", 0))
            self.samples += 1
            time.sleep(self.interval)


def run_child(args: list[str]) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    child = subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    sampler = Sampler(child.pid)
    sampler.start()
    result: dict = {}
    assert child.stdout is not None and child.stdin is not None
    for line in child.stdout:
        tag, _, payload = line.partition(" ")
        if tag == "done":
            sampler.running = False
            sampler.join()
            result = json.loads(payload)
            child.stdin.write("go\n")
            child.stdin.flush()
        elif tag == "verified":
            result["verified"] = True
        elif tag == "again":
            result["again_s"] = json.loads(payload)["load_s"]
        elif tag != "idle":
            print(line, end="")
    if child.wait() != 0:
        raise RuntimeError(f"child {args} failed with exit code {child.returncode}")
    result["peak_anon"] = sampler.peak_anon
    result["peak_rss_sampled"] = sampler.peak_rss
    result["samples"] = sampler.samples
    return result


def warm_page_cache(directory: Path):
    for file in sorted(directory.iterdir()):
        with open(file, "rb") as f:
            while f.read(64 * 2**20):
                pass


GIB = 2**30


def summarise(method: str, r: dict) -> dict:
    idle, loaded = r["idle"], r["loaded_bytes"]
    anon = r["peak_anon"] - idle["RssAnon"]
    rss = r["end"]["VmHWM"] - idle["VmRSS"]
    return {
        "method": method,
        "loaded_gib": loaded / GIB,
        "load_s": r["load_s"],
        "gib_per_s": loaded / GIB / r["load_s"],
        "again_s": r["again_s"],
        "again_gib_per_s": loaded / GIB / r["again_s"],
        "anon_over_idle_gib": anon / GIB,
        "anon_ratio": anon / loaded,
        "rss_over_idle_gib": rss / GIB,
        "rss_ratio": rss / loaded,
        "samples": r["samples"],
        "verified": r.get("verified", False),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| method | load time | throughput | again, same process | peak anonymous over idle "
        "| peak total RSS over idle |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| `{r['method']}` | {r['load_s']:.2f} s | {r['gib_per_s']:.2f} GiB/s | "
            f"{r['again_s']:.2f} s, {r['again_gib_per_s']:.2f} GiB/s | "
            f"{r['anon_over_idle_gib']:.2f} GiB ({r['anon_ratio']:.3f} x) | "
            f"{r['rss_over_idle_gib']:.2f} GiB ({r['rss_ratio']:.3f} x) |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a quick 0.3 GiB configuration")
    parser.add_argument("--dir", type=Path, help="where to write the checkpoint (default: temp)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", nargs=2, metavar=("ROLE", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    config_name = "small" if args.small else "issue"
    config = CONFIGS[config_name]

    if args.child:
        role, directory = args.child
        if role == "write":
            child_write(config, Path(directory))
        else:
            child_load(config, Path(directory), role)
        return

    flags = ["--small"] if args.small else []
    base = args.dir or Path(tempfile.mkdtemp(prefix="eqx_lean_io_"))
    directory = base / "checkpoint"
    print(f"config {config_name}: {config}; checkpoint in {directory}", flush=True)
    try:
        w = run_child([*flags, "--child", "write", str(directory)])
        files = sorted(p.name for p in directory.iterdir())
        print(
            f"wrote {w['loaded_bytes'] / GIB:.2f} GiB in {len(files) - 1} files + index; build "
            f"{w['build_s']:.1f} s, save {w['save_s']:.1f} s "
            f"({w['loaded_bytes'] / GIB / w['save_s']:.2f} GiB/s); save peak RSS over idle "
            f"{(w['end']['VmHWM'] - w['idle']['VmRSS']) / GIB:.2f} GiB vs "
            f"{(w['hwm_built'] - w['idle']['VmRSS']) / GIB:.2f} GiB after building",
            flush=True,
        )
        warm_page_cache(directory)
        rows = []
        for method in args.methods:
            r = run_child([*flags, "--child", method, str(directory)])
            rows.append(summarise(method, r))
            print(json.dumps(rows[-1]), flush=True)
        print()
        print(table(rows))
        for row in rows:
            if row["method"] == "eqx_lean":
                verdict = "meets" if row["anon_ratio"] <= BAR else "MISSES"
                print(
                    f"\neqx_lean: peak anonymous over idle {row['anon_ratio']:.3f} x the loaded "
                    f"bytes; {verdict} the bar of {BAR} x. Verified bitwise against safe_open: "
                    f"{row['verified']}."
                )
        if args.json:
            args.json.write_text(json.dumps({"config": config, "write": w, "rows": rows}, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
            if args.dir is None:
                shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
