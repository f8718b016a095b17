"""Loads racing saves: how many loads return one whole checkpoint, a mix of two, or an error.

One process saves a small checkpoint in a loop (`eqx_lean.save_tensors`; the order of the
tensors in the files and, with sharded files, the shard boundaries change at every save),
while another loads it in a loop (`eqx_lean.load_tensors`) and checks each load: every tensor
holds a value that names the save it came from and the tensor itself, so a load is `whole`
(one save), `mixed` (tensors of two saves, or a tensor read at another's offset), `replaced`
(`eqx_lean.CheckpointReplacedError`: a save replaced the checkpoint at each of a load's tries)
or `other` (any other error). The worker is `tests/io_race.py`, as in `tests/test_io_race.py`.

Usage:

    python benchmarks/load_race.py                      # 20 s each, single and sharded files
    python benchmarks/load_race.py --code ../old --seconds 10   # another checkout's eqx_lean

The counts depend on the machine's speed and load; `mixed` must be 0.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "io_race.py"


def race(code: Path, files: str, seconds: float) -> dict:
    """Runs a saver and a loader for `seconds`; returns the loader's counts and the saves."""
    env = dict(os.environ, PYTHONPATH=str(code), JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as directory:
        path = str(Path(directory) / "checkpoint")
        saver = subprocess.Popen(
            [sys.executable, str(WORKER), "save", path, files, str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert saver.stdout is not None
        if not saver.stdout.readline().startswith("first save done"):
            raise RuntimeError(f"the saver of {code} failed")
        loader = subprocess.run(
            [sys.executable, str(WORKER), "load", path, str(seconds)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        saves = json.loads(saver.communicate()[0].strip().splitlines()[-1])["saves"]
    return {"saves": saves, **json.loads(loader.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description="Loads racing saves in another process.")
    parser.add_argument("--seconds", type=float, default=20.0, help="per kind of files")
    parser.add_argument("--code", type=Path, default=REPO, help="checkout whose eqx_lean runs")
    args = parser.parse_args()
    print(f"code {args.code.resolve()}, {args.seconds:g} s per kind of files")
    print("| files | saves | loads | whole | mixed | replaced | other errors |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for files in ("single", "sharded"):
        r = race(args.code, files, args.seconds)
        loads = r["whole"] + r["mixed"] + r["replaced"] + r["other"]
        print(
            f"| {files} | {r['saves']} | {loads} | {r['whole']} | {r['mixed']} | "
            f"{r['replaced']} | {r['other']} |",
            flush=True,
        )
        for error in r["errors"][:1]:
            print(f"  first other error: {error.strip().splitlines()[-1]}")


if __name__ == "__main__":
    main()
