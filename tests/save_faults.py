"""Kills eqx_lean saves at chosen points, in forked children (a helper of `test_io_save.py`).

Usage: `python tests/save_faults.py SPEC.json`. Prints one JSON object per line, one per case:
first an uninterrupted save (whose `steps` are the trace of every hook call), then the kills.

This process imports eqx_lean but never starts a JAX backend (the models hold numpy arrays, so
saving them runs no JAX computation): it can then fork cheaply and safely, once per case. Each
case is a copy of the layout template (`cp -a`, which keeps hard and symbolic links); a forked
child saves over the destination in the copy and is killed with SIGKILL, either by a hook of
`eqx_lean._io.fs` at its k-th call ("before" or "after" an operation) or by this process after
a delay. The test then checks every copy.

SPEC keys: `kind` ("stacked" or "hf"), `model` (a pickle of the new model and, for "stacked",
its names), `template` (a directory), `destination` (relative to it), `cases` (a directory for the
copies), `steps` (the hook calls to kill at: see `select_steps`), `delays` (seconds),
`delay_fractions` (of the uninterrupted save's time), `no_exchange` (force the fallback
without `renameat2`), `save` (the save's keyword arguments).
"""

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback

import eqx_lean
from eqx_lean.internal import fs


def save(spec: dict, model, world: str) -> None:
    destination = os.path.join(world, spec["destination"])
    if spec["kind"] == "hf":
        from eqx_lean.hf import save_hf

        save_hf(model, destination, **spec["save"])
    else:
        stacked, names = model
        eqx_lean.save_stacked(destination, stacked, names, **spec["save"])


def child(spec: dict, model, world: str, progress: str, kill_at: int | None) -> None:
    """Runs in the forked child: one save, killed at hook call `kill_at`; never returns."""
    try:
        if spec["no_exchange"]:
            fs._renameat2 = lambda: None  # pyright: ignore[reportAttributeAccessIssue]
        log = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        start = time.perf_counter()
        count = 0

        def hook(when: str, op: str, paths: tuple[str, ...]) -> None:
            nonlocal count
            count += 1
            step = [when, op, os.path.relpath(paths[0], world), time.perf_counter() - start]
            os.write(log, (json.dumps(step) + "\n").encode())
            if count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        fs.HOOKS.append(hook)
        save(spec, model, world)
        os._exit(0)
    except BaseException:
        traceback.print_exc()
        os._exit(3)


def run_case(spec: dict, model, name: str, kill_at: int | None, delay: float | None) -> dict:
    world = os.path.join(spec["cases"], name)
    subprocess.run(["cp", "-a", spec["template"], world], check=True)
    progress = os.path.join(spec["cases"], name + ".steps")
    sys.stdout.flush()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        child(spec, model, world, progress, kill_at)
    if delay is not None:
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    seconds = time.perf_counter() - start
    steps = []
    if os.path.exists(progress):
        with open(progress) as f:
            steps = [json.loads(line) for line in f]
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    outcome = (
        "killed" if killed else "completed" if os.waitstatus_to_exitcode(status) == 0 else "error"
    )
    return {
        "case": name,
        "world": world,
        "kill_at": kill_at,
        "delay": delay,
        "outcome": outcome,
        "steps": steps,
        "seconds": seconds,
    }


def select_steps(trace: list, policy: str | list[int]) -> list[int]:
    """The hook calls to kill at (1-based): a list as given; "all"; or "sample:N", every call
    that is not a `write` and N of the `write` calls, evenly spread."""
    if not isinstance(policy, str):
        return list(policy)
    every = list(range(1, len(trace) + 1))
    if policy == "all":
        return every
    count = int(policy.removeprefix("sample:"))
    writes = [k for k in every if trace[k - 1][1] == "write"]
    chosen = {writes[round(i * (len(writes) - 1) / max(count - 1, 1))] for i in range(count)}
    return [k for k in every if trace[k - 1][1] != "write" or k in chosen]


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    with open(spec["model"], "rb") as f:
        model = pickle.load(f)
    trace = run_case(spec, model, "trace", None, None)
    print(json.dumps(trace), flush=True)
    for k in select_steps(trace["steps"], spec["steps"]):
        print(json.dumps(run_case(spec, model, f"step-{k}", k, None)), flush=True)
    delays = list(spec["delays"])
    delays += [f * trace["seconds"] for f in spec.get("delay_fractions", [])]
    for i, delay in enumerate(delays):
        print(json.dumps(run_case(spec, model, f"delay-{i}", None, delay)), flush=True)


if __name__ == "__main__":
    main()
