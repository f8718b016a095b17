"""`python -m eqx_lean.memory`: plans for a target in a fresh process set up for planning.

JAX's CUDA plugin compiles for GPUs a machine lacks only if the process started with
`JAX_PLATFORMS=cpu` (or `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`); eqx_lean never sets either in a
user's process. This command starts a child process with them set (unless already set) and
plans there.
"""

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence


PLANNING_ENVIRONMENT = {
    "JAX_PLATFORMS": "cpu",
    "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
    # libtpu takes a lock file for the life of the process unless told that compiling in several
    # processes at once is fine, as it is without a TPU.
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}
_CHILD_FLAG = "EQX_LEAN_PLANNING_CHILD"

EXAMPLES = """\
examples:
  python -m eqx_lean.memory targets
  python -m eqx_lean.memory run my_plan.py --my-flag      # any script, planning environment set
  python -m eqx_lean.memory lora 8xh100 --config config.json --batch 4 --seq-len 1024
  python -m eqx_lean.memory lora v5e-16 --config config.json --mesh data=2,fsdp=8
"""


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
        prog="python -m eqx_lean.memory",
        description="Plan memory for N GPUs or a TPU slice from any machine.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("targets", help="list the known target specs and their memory")
    run = commands.add_parser("run", help="run a Python script with the planning environment")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    lora = commands.add_parser(
        "lora", help="plan a LoRA step of a Hugging Face decoder (Mistral, Llama, Qwen2)"
    )
    lora.add_argument("target", help='a target spec, e.g. "8xh100" or "v5e-16"')
    lora.add_argument("--config", required=True, help="the checkpoint's config.json")
    lora.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    lora.add_argument(
        "--batch",
        type=int,
        default=None,
        help="sequences per step, a multiple of the devices (default: one per device)",
    )
    lora.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    lora.add_argument("--remat", default="true", choices=("none", "true"), help="default: true")
    lora.add_argument(
        "--mesh",
        default=None,
        help="axes as name=size,...: both shard the batch, 'fsdp' the weights too "
        "(default: fsdp over every device)",
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
    return _plan_lora(args)


def _mesh_axes(text: str | None) -> list[tuple[str, int]] | None:
    if text is None:
        return None
    axes = []
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not size.isdigit():
            raise SystemExit(f"--mesh must be name=size,...; got {text!r}.")
        axes.append((name.strip(), int(size)))
    return axes


def _plan_lora(args: argparse.Namespace) -> int:
    # The HF layer sits above `eqx_lean.memory`; only this command needs it.
    from eqx_lean import hf

    from .targets import target

    config = hf.MistralConfig.from_json(args.config)
    remat = args.remat == "true"
    where = target(args.target)
    batch = len(where.devices) if args.batch is None else args.batch
    plan = hf.plan_lora_step(
        config,
        where,
        batch_size=batch,
        seq_len=args.seq_len,
        lora_config=hf.lora_config_of_rank(args.rank),
        remat=remat,
        mesh_axes=_mesh_axes(args.mesh),
    )
    print(
        f"LoRA step (rank {args.rank}, all seven projections, remat {args.remat}) of "
        f"{args.config}, batch {batch} x {args.seq_len} tokens"
    )
    print(plan)
    return 0 if plan.fits else 1
