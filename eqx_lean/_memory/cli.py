"""`python -m eqx_lean.memory`: plans for a target in a fresh process set up for planning.

JAX's CUDA plugin compiles for GPUs a machine lacks only if the process started with
`JAX_PLATFORMS=cpu` (or `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`); eqx_lean never sets either in a
user's process. This command starts a child process with them set (unless already set) and
plans there.
"""

import argparse
import dataclasses
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


PLANNING_ENVIRONMENT = {
    "JAX_PLATFORMS": "cpu",
    "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
    # libtpu takes a lock file for the life of the process unless told that compiling in several
    # processes at once is fine, as it is without a TPU.
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}
_CHILD_FLAG = "EQX_LEAN_PLANNING_CHILD"
PROG = "python -m eqx_lean.memory"

EXAMPLES = """\
examples:
  python -m eqx_lean.memory targets
  python -m eqx_lean.memory run my_plan.py --my-flag      # any script, planning environment set
  python -m eqx_lean.memory lora 8xh100 --config config.json --batch 4 --seq-len 1024
  python -m eqx_lean.memory lora h100 --config config.json --quantize nf4 --fit
  python -m eqx_lean.memory lora h100 --config config.json --quantize nf4 --max-seq --remat offload
  python -m eqx_lean.memory lora v5e-16 --config config.json --mesh data=2,fsdp=8
  python -m eqx_lean.memory full 2x8xh100 --config config.json --seq-len 2048 --fit

exit status: 0 the plan fits (with --fit or --max-seq: some size fits), 1 it does not, 2 a
usage error.
"""
# The largest batch `--fit` considers by default: far beyond what a decoder of any size fits
# at a useful sequence length, and the search's compiles grow only with its logarithm.
DEFAULT_MAX_BATCH = 4096
DEFAULT_SEQ = 256
_REMAT = {"none": None, "true": True, "offload": "offload"}
# `--max-seq`'s step and its longest length: the 8B searches of docs/benchmarks.md close their
# bracket to 2,048 tokens within 8 compiles; 2M tokens is beyond any GPU or TPU chip today.
DEFAULT_SEQ_STEP = 2048
MAX_SEQ = 2**21


def planning_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with what compile-only targets need."""
    env = dict(os.environ if base is None else base)
    for name, value in PLANNING_ENVIRONMENT.items():
        env.setdefault(name, value)
    return env


def _in_child(argv: Sequence[str]) -> int:
    """Runs this command again in a fresh process with the planning environment."""
    env = planning_environment()
    env[_CHILD_FLAG] = "1"
    return subprocess.call([sys.executable, "-m", "eqx_lean.memory", *argv], env=env)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Plan memory for N GPUs or a TPU slice from any machine.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("targets", help="list the known target specs and their memory")
    run = commands.add_parser("run", help="run a Python script with the planning environment")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    step = argparse.ArgumentParser(add_help=False)
    step.add_argument("target", help='a target spec, e.g. "8xh100", "2x8xh100" or "v5e-16"')
    step.add_argument("--config", required=True, help="the checkpoint's config.json")
    sizes = step.add_mutually_exclusive_group()
    sizes.add_argument(
        "--batch",
        type=int,
        default=None,
        help="sequences per step, a multiple of the devices (default: one per device)",
    )
    sizes.add_argument(
        "--fit",
        action="store_true",
        help="find the largest batch that fits instead (a multiple of the devices, searched "
        "with a few compiles)",
    )
    step.add_argument(
        "--max-seq",
        action="store_true",
        help="find the longest sequence that fits at --batch instead of planning --seq-len "
        "(a multiple of --seq-step, at most 8 compiles)",
    )
    step.add_argument(
        "--seq-step",
        type=int,
        default=None,
        help=f"with --max-seq: lengths are multiples of it (default {DEFAULT_SEQ_STEP})",
    )
    step.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help=f"with --fit: the largest batch to consider (default {DEFAULT_MAX_BATCH}, or the "
        "number of devices if larger)",
    )
    step.add_argument(
        "--seq-len", type=int, default=None, help=f"tokens per sequence (default {DEFAULT_SEQ})"
    )
    step.add_argument(
        "--remat",
        default="true",
        choices=("none", "true", "offload"),
        help="none: keep every activation; true: recompute each layer's; offload: as true, each "
        "layer's input kept in host memory (default: true)",
    )
    step.add_argument(
        "--mesh",
        default=None,
        help="axes as name=size,...: both shard the batch, 'fsdp' the weights too "
        "(default: fsdp over every device)",
    )
    step.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="the weights' dtype (default: bfloat16)",
    )
    step.add_argument(
        "--memory-fraction",
        type=float,
        default=None,
        help="GPU only: the fraction of each GPU's memory a process can use (default: "
        "XLA_CLIENT_MEM_FRACTION, or JAX's 0.75)",
    )
    lora = commands.add_parser(
        "lora",
        parents=[step],
        help="plan a LoRA step of a Hugging Face decoder (Mistral, Llama, Qwen2, Qwen3, Gemma 2, "
        "Gemma 3)",
    )
    lora.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    lora.add_argument(
        "--quantize",
        default=None,
        help="quantise the frozen base's linears as load_hf(quantize=...) does: nf4 or int8 "
        "(QLoRA; default: none)",
    )
    commands.add_parser(
        "full",
        parents=[step],
        help="plan a full-parameter AdamW step of a Hugging Face decoder (every weight trained)",
    )
    return parser


def _targets() -> int:
    from .table import format_bytes, table
    from .targets import target

    specs = ["cpu", "h100", "8xh100", "a100-40gb", "a100-80gb", "v4-8", "v5e-16", "v5p-128"]
    specs += ["v6e-256"]
    rows = []
    for spec in specs:
        try:
            t = target(spec)
        except (ImportError, RuntimeError) as error:
            rows.append((spec, "-", "-", "-", str(error).split(":")[0]))
            continue
        rows.append(
            (
                spec,
                str(len(t.devices)),
                t.device_kind,
                format_bytes(t.device_memory),
                format_bytes(t.hbm_bytes),
            )
        )
    print(table(("spec", "devices", "kind", "usable per device", "per device"), rows))
    print('GPUs also as "<N>x<gpu>" and "<H>x<N>x<gpu>"; TPU slices by MaxText\'s names.')
    return 0


def _run_script(script: str, script_args: Sequence[str]) -> int:
    import runpy

    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if os.environ.get(_CHILD_FLAG) != "1":
        return _in_child(argv)
    if args.command == "targets":
        return _targets()
    if args.command == "run":
        return _run_script(args.script, args.script_args)
    try:
        request = _request(args)
    except _UsageError as error:
        # argparse's style for a usage error: one line, exit status 2, no traceback.
        print(f"{PROG} {args.command}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    if args.max_seq:
        return _max_seq(request)
    return _fit(request) if args.fit else _plan(request, request.batch)


class _UsageError(Exception):
    """A value on the command line that the planners' argument checks refused."""


@dataclasses.dataclass(frozen=True)
class _Request:
    """A plan's arguments, each checked as the planners check it."""

    args: argparse.Namespace
    config: Any
    target: Any
    batch: int  # with --fit, the batches' multiple
    max_batch: int
    mesh_axes: list[tuple[str, int]] | None
    quantize: Any
    seq_len: int  # with --max-seq, the first length planned
    seq_step: int


def _mesh_axes(text: str | None) -> list[tuple[str, int]] | None:
    if text is None:
        return None
    axes = []
    for part in text.split(","):
        name, _, size = part.partition("=")
        try:
            axes.append((name.strip(), int(size)))
        except ValueError:
            raise _UsageError(f"--mesh must be name=size,...; got {text!r}.") from None
    return axes


def _request(args: argparse.Namespace) -> _Request:
    """Every argument checked before any compile, by the checks the planners themselves make
    (so the CLI says what the API would): a `ValueError` or `TypeError` from one of them, or
    an unreadable config file, is a usage error. Failures after this point are real ones and
    keep their traceback."""
    # The HF layer sits above `eqx_lean.memory`; only this command needs it.
    from eqx_lean import _arguments as arguments, hf
    from eqx_lean._io.quantized import quant_config
    from eqx_lean.hf._plan import check_step_arguments

    from .targets import target

    try:
        if args.max_seq and args.fit:
            raise _UsageError("--max-seq and --fit search different sizes: give one of them.")
        if args.max_seq and args.seq_len is not None:
            raise _UsageError("--max-seq searches the sequence length: leave out --seq-len.")
        if args.seq_step is not None and not args.max_seq:
            raise _UsageError("--seq-step applies with --max-seq only.")
        seq_step = DEFAULT_SEQ_STEP if args.seq_step is None else args.seq_step
        seq_len = DEFAULT_SEQ if args.seq_len is None else args.seq_len
        for option, value in (
            ("--seq-len", seq_len),
            ("--seq-step", seq_step),
            ("--rank", getattr(args, "rank", 1)),
        ):
            arguments.integer(value, option, minimum=1)
        if args.batch is not None:
            arguments.integer(args.batch, "--batch", minimum=1)
        if args.max_batch is not None:
            if not args.fit:
                raise _UsageError("--max-batch applies with --fit only.")
            arguments.integer(args.max_batch, "--max-batch", minimum=1)
        mesh_axes = _mesh_axes(args.mesh)
        quantize = quant_config(getattr(args, "quantize", None))
        where = target(args.target, memory_fraction=args.memory_fraction)
        devices = len(where.devices)
        batch = devices if args.batch is None else args.batch
        max_batch = max(DEFAULT_MAX_BATCH, devices) if args.max_batch is None else args.max_batch
        if args.fit and max_batch < devices:
            raise _UsageError(
                f"--max-batch must be at least the number of devices ({devices}): batches are "
                f"multiples of it; got {max_batch}."
            )
        check_step_arguments(where, batch, seq_len, mesh_axes)
        config = hf.DecoderConfig.from_json(args.config)
    except (ValueError, TypeError) as error:
        raise _UsageError(str(error)) from None
    except OSError as error:  # argparse's own words for a file it cannot open
        raise _UsageError(f"can't open '{args.config}': {error}") from None
    return _Request(args, config, where, batch, max_batch, mesh_axes, quantize, seq_len, seq_step)


def _describe(request: _Request, batch: str, seq: str | None = None) -> str:
    args = request.args
    if args.command == "full":
        what = f"Full-parameter step (AdamW on every weight, remat {args.remat})"
    else:
        base = "" if request.quantize is None else f", {request.quantize.scheme} base"
        what = f"LoRA step (rank {args.rank}, all seven projections{base}, remat {args.remat})"
    dtype = "" if args.dtype == "bfloat16" else f", {args.dtype} weights"
    seq = f"{request.seq_len}" if seq is None else seq
    return f"{what} of {args.config}{dtype}, batch {batch} x {seq} tokens"


def _planned(request: _Request, batch: int, seq_len: int | None = None) -> Any:
    import jax.numpy as jnp

    from eqx_lean import hf

    args = request.args
    remat = _REMAT[args.remat]
    seq_len = request.seq_len if seq_len is None else seq_len
    dtype = jnp.dtype(args.dtype)
    if args.command == "full":
        return hf.plan_train_step(
            request.config,
            request.target,
            batch_size=batch,
            seq_len=seq_len,
            remat=remat,
            mesh_axes=request.mesh_axes,
            dtype=dtype,
        )
    return hf.plan_lora_step(
        request.config,
        request.target,
        batch_size=batch,
        seq_len=seq_len,
        lora_config=hf.lora_config_of_rank(args.rank),
        remat=remat,
        mesh_axes=request.mesh_axes,
        dtype=dtype,
        quantize=request.quantize,
    )


def _plan(request: _Request, batch: int) -> int:
    plan = _planned(request, batch)
    print(_describe(request, str(batch)))
    print(plan)
    return 0 if plan.fits else 1


def _fit(request: _Request) -> int:
    from .table import format_bytes
    from .training import _fit_one

    multiple = request.batch
    found = _fit_one(
        lambda batch: _planned(request, batch), multiple, request.max_batch, request.args.remat
    )
    tried = ", ".join(
        f"{batch} {'fits' if fits else 'does not'} ({format_bytes(peak)})"
        for batch, peak, fits in found.tried
    )
    print(_describe(request, "<largest>"))
    print(
        f"largest batch that fits: {found.batch_size} (multiples of {multiple} up to "
        f"{request.max_batch}; {found.compiles} compiles: {tried})"
    )
    if found.batch_size:
        print(found.plan)
    else:
        print(f"not even {multiple}, one sequence per device:")
        print(found.plan)
    return 0 if found.batch_size else 1


def _max_seq(request: _Request) -> int:
    import jax.numpy as jnp

    from eqx_lean import hf

    from .search import longest

    args, step = request.args, request.seq_step
    maximum, first = max(MAX_SEQ, step), 16 * step if 16 * step <= MAX_SEQ else step
    if args.command == "lora":
        found = hf.longest_context(
            request.config,
            request.target,
            batch_size=request.batch,
            multiple=step,
            max_seq_len=maximum,
            first=first,
            lora_config=hf.lora_config_of_rank(args.rank),
            remat=_REMAT[args.remat],
            mesh_axes=request.mesh_axes,
            dtype=jnp.dtype(args.dtype),
            quantize=request.quantize,
        )
    else:
        found = longest(
            lambda seq_len: _planned(request, request.batch, seq_len),
            maximum=maximum,
            multiple=step,
            first=first,
        )
    print(_describe(request, str(request.batch), "<longest>"))
    if found.size:
        print(f"longest sequence that fits: {found.size:,} tokens (multiples of {step:,})")
    else:
        print(f"not even {step:,} tokens per sequence fits:")
    print(found)
    return 0 if found.size else 1
