"""Saves in other processes, for `test_io_leftovers.py`: killed, paused, or racing each other.

Usage: `python tests/save_children.py COMMAND PATH [...]`, with COMMAND one of

- `save PATH SAVER`: saves saver SAVER's model to PATH;
- `die PATH`: saves to PATH and is killed (SIGKILL) once the new weights are written, leaving
  its new directory behind;
- `pause PATH`: saves to PATH, prints `paused <its new directory>` once the new weights are
  written, waits for a line on stdin, then finishes the save;
- `race ROOT SAVERS ROUNDS`: for each round, forks SAVERS children that save at once to the
  new path `ROOT/round-<k>/ckpt` (a first save: nothing is there yet), then checks what the
  path holds; prints one JSON object per round.

Every save writes saver `n`'s model (every weight equal to `n`) and `files={"saver.json": ...}`
naming `n`. This process imports eqx_lean but never starts a JAX backend (the models hold numpy
arrays), so it can fork cheaply and safely.
"""

import json
import multiprocessing
import os
import signal
import sys
import traceback

import numpy as np
import safetensors.numpy

import eqx_lean
from eqx_lean.internal import fs


NAMES = {"w": "w.{i}"}
LAYERS = 3


def save(path: str, saver: int) -> None:
    model = {"w": np.full((LAYERS, 4, 4), saver, np.float32)}
    files = {"saver.json": json.dumps({"saver": saver}).encode()}
    eqx_lean.save_stacked(path, model, NAMES, files=files)


def weights_written(when: str, op: str, paths: tuple[str, ...]) -> bool:
    """Whether this hook call comes just after the new weight file was flushed."""
    return (when, op) == ("after", "fsync") and paths[0].endswith("/model.safetensors")


def die(path: str) -> None:
    def hook(when: str, op: str, paths: tuple[str, ...]) -> None:
        if weights_written(when, op, paths):
            os.kill(os.getpid(), signal.SIGKILL)

    fs.HOOKS.append(hook)
    save(path, 1)
    raise AssertionError("the save was not killed")


def pause(path: str) -> None:
    def hook(when: str, op: str, paths: tuple[str, ...]) -> None:
        if weights_written(when, op, paths):
            print("paused", os.path.dirname(paths[0]), flush=True)
            sys.stdin.readline()

    fs.HOOKS.append(hook)
    save(path, 2)
    print("saved", flush=True)


def what_is_there(path: str, savers: int) -> dict:
    """Which saver's complete checkpoint `path` holds (or why none), and what lies beside it."""
    parent = os.path.dirname(path)
    beside = sorted(n for n in os.listdir(parent) if n != os.path.basename(path))
    try:
        tensors = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "saver.json")) as f:
            saver = json.load(f)["saver"]
        entries = sorted(os.listdir(path))
    except (OSError, ValueError, KeyError) as error:
        return {"saver": None, "problem": repr(error), "beside": beside}
    complete = (
        entries == ["model.safetensors", "saver.json"]
        and sorted(tensors) == [f"w.{i}" for i in range(LAYERS)]
        and all(np.all(t == saver) for t in tensors.values())
        and 0 <= saver < savers
    )
    return {"saver": saver if complete else None, "entries": entries, "beside": beside}


def race(root: str, savers: int, rounds: int) -> None:
    """Rounds of first saves racing; in odd rounds every saver waits for the others just
    before its swap (they then all find the path made by the first one), in even rounds
    before the save starts."""
    context = multiprocessing.get_context("fork")
    for k in range(rounds):
        path = os.path.join(root, f"round-{k}", "ckpt")
        os.makedirs(os.path.dirname(path))
        barrier = context.Barrier(savers)
        at_swap = k % 2 == 1
        children = []
        for saver in range(savers):
            pid = os.fork()
            if pid == 0:
                racer(path, saver, barrier, at_swap)
            children.append(pid)
        exits = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
        report = {"round": k, "at_swap": at_swap, "exits": exits}
        print(json.dumps(report | what_is_there(path, savers)), flush=True)


def racer(path: str, saver: int, barrier, at_swap: bool) -> None:
    """Runs in a forked child: one save, released with the others; never returns."""
    try:
        waiting = [at_swap]
        prefix = "." + os.path.basename(path) + ".tmp-"

        def is_new(flushed: str) -> bool:  # the save's new directory itself, not one inside it
            return os.path.basename(flushed).startswith(prefix)

        def hook(when: str, op: str, paths: tuple[str, ...]) -> None:
            # The new directory's last flush, just before the save checks and swaps (which
            # saves do one at a time, under a lock on the parent directory).
            if waiting[0] and (when, op) == ("after", "fsync_dir") and is_new(paths[0]):
                waiting[0] = False
                barrier.wait(timeout=60)

        fs.HOOKS.append(hook)
        if not at_swap:
            barrier.wait(timeout=60)
        save(path, saver)
        os._exit(0)
    except BaseException:
        traceback.print_exc()
        os._exit(3)


if __name__ == "__main__":
    command, *arguments = sys.argv[1:]
    if command == "race":
        race(arguments[0], int(arguments[1]), int(arguments[2]))
    elif command == "save":
        save(arguments[0], int(arguments[1]))
    else:
        {"die": die, "pause": pause}[command](*arguments)
