"""Huge-tensor initialisation: `jax.nn.initializers.lecun_normal()` versus `eqx_lean.init.chunked`.

An 8192 x 65536 float32 `lecun_normal` tensor (2 GiB), as in jax-ml/jax#19893. Three measurements:

1. XLA temporaries per device, from `jax.jit(...).lower(...).compile().memory_analysis()`, on one
   device and on 8 forced CPU devices with the output sharded over the 8 along rows or columns.
   Compilation only: nothing is allocated.
2. Peak resident memory over idle and wall time of a whole fresh process that creates the tensor,
   one process per method (the protocol in the project's design notes), on one device.
3. The same on 8 forced CPU devices with the output sharded along rows (`jax.jit` only: the eager
   plain initializer with a sharded output peaked at 32x the tensor there).

Every measurement runs in its own subprocess, one at a time. `--scale` multiplies the number of
rows (use `--scale 0.25`, a 512 MiB tensor, on small machines: the plain initializer needs about
four times the tensor).

    python benchmarks/huge_init.py              # the 2 GiB tensor; needs about 9 GiB free
    python benchmarks/huge_init.py --scale 0.25
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from _worker_runs import run_json


ROWS, COLUMNS = 8192, 65536
REPO = Path(__file__).resolve().parents[1]


#
# Workers: each runs in a fresh process
#


def _setup(config: dict):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    import eqx_lean

    shape = (config["rows"], COLUMNS)
    sharding = None
    if config["devices"] > 1:
        assert len(jax.devices()) == config["devices"], jax.devices()
        mesh = jax.make_mesh((config["devices"],), ("d",))
        spec = PartitionSpec("d", None) if config["axis"] == "rows" else PartitionSpec(None, "d")
        sharding = NamedSharding(mesh, spec)
    plain = jax.nn.initializers.lecun_normal()
    if config["method"] == "chunked":
        initializer = eqx_lean.init.chunked(plain)
    else:
        initializer = plain
    return jax, shape, sharding, initializer


def _mesh_context(jax, sharding):
    # The plain initializer's `out_sharding` needs the mesh set when the mesh axes are Explicit.
    import contextlib

    return jax.set_mesh(sharding.mesh) if sharding is not None else contextlib.nullcontext()


def worker_temp(config: dict) -> dict:
    jax, shape, sharding, initializer = _setup(config)
    key = jax.random.key(0)
    with _mesh_context(jax, sharding):
        compiled = (
            jax.jit(lambda k: initializer(k, shape, out_sharding=sharding)).lower(key).compile()
        )
    stats = compiled.memory_analysis()
    return {"temp": stats.temp_size_in_bytes, "output": stats.output_size_in_bytes}


def worker_process(config: dict) -> dict:
    from eqx_lean.internal import peak_rss_bytes, rss_bytes

    jax, shape, sharding, initializer = _setup(config)
    key = jax.random.key(0)
    jax.block_until_ready(key)
    idle = rss_bytes()
    with _mesh_context(jax, sharding):
        jitted = jax.jit(lambda k: initializer(k, shape, out_sharding=sharding))

        def create():
            if config["method"] == "plain_eager":
                return initializer(key, shape, out_sharding=sharding)
            return jitted(key)

        start = time.perf_counter()
        x = jax.block_until_ready(create())
        first = time.perf_counter() - start
        peak = peak_rss_bytes()
        final = x.nbytes
        del x
        # Steady state, without compilation: delete each result before the next.
        again = []
        for _ in range(2):
            start = time.perf_counter()
            x = jax.block_until_ready(create())
            again.append(time.perf_counter() - start)
            del x
    return {"idle": idle, "peak": peak, "final": final, "first_s": first, "run_s": min(again)}


def _run_worker(kind: str, config: dict) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    flags = [
        flag
        for flag in env.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={config['devices']}")
    env["XLA_FLAGS"] = " ".join(flags)
    return run_json([sys.executable, __file__, "--worker", kind, json.dumps(config)], env)


#
# The driver
#


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def run(scale: float, skip_processes: bool) -> None:
    rows = int(ROWS * scale)
    output = rows * COLUMNS * 4
    print(f"# {rows} x {COLUMNS} float32 lecun_normal ({_mib(output)} MiB)\n")

    print("## XLA temporaries per device (memory_analysis)\n")
    print(
        "| devices | output sharded | method | output / device (MiB) | temp / device (MiB) "
        "| temp / output |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    layouts = [(1, "-"), (8, "rows"), (8, "columns")]
    for devices, axis in layouts:
        for method in ["plain", "chunked"]:
            config = {"rows": rows, "devices": devices, "axis": axis, "method": method}
            found = _run_worker("temp", config)
            ratio = found["temp"] / found["output"]
            print(
                f"| {devices} | {axis} | {method} | {_mib(found['output'])} | "
                f"{_mib(found['temp'])} | {ratio:.3f} |",
                flush=True,
            )
    if skip_processes:
        return

    print("\n## Whole process: peak RSS over idle, and wall time\n")
    print(
        "| devices | method | final (MiB) | peak - idle (MiB) | (peak - idle) / final | "
        "first call, with compilation (s) | later calls (s) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    # The eager plain initializer is measured on one device only: with 8 forced CPU devices and
    # a sharded output it peaked at 32x the tensor (16 GiB for a 512 MiB tensor).
    for devices, axis, methods in [
        (1, "-", ["plain_eager", "plain", "chunked"]),
        (8, "rows", ["plain", "chunked"]),
    ]:
        for method in methods:
            config = {"rows": rows, "devices": devices, "axis": axis, "method": method}
            found = _run_worker("process", config)
            over_idle = found["peak"] - found["idle"]
            print(
                f"| {devices} | {method} | {_mib(found['final'])} | {_mib(over_idle)} | "
                f"{over_idle / found['final']:.3f} | {found['first_s']:.2f} | "
                f"{found['run_s']:.2f} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description="Huge-tensor initialisation benchmark.")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the 8192 rows")
    parser.add_argument(
        "--temp-only", action="store_true", help="only the memory_analysis table (no allocation)"
    )
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, config = args.worker
        worker = {"temp": worker_temp, "process": worker_process}[kind]
        print(json.dumps(worker(json.loads(config))))
        return
    run(args.scale, args.temp_only)


if __name__ == "__main__":
    main()
