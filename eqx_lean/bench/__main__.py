"""`python -m eqx_lean.bench`: builds the same stacked model with each method, side by side.

Every method runs in a fresh subprocess (the protocol of the project's design notes): idle is
the resident size after imports and inputs, peak is `VmHWM`, and the ratio is
(peak - idle) / final bytes. After the table, a sweep over smaller numbers of layers (again a
fresh process per point) feeds a PNG plot of peak memory against the number of layers, written
to `bench-out/peak_memory.png` unless `--out` or `--no-plot` says otherwise.
"""

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
from typing import Any

import jax.numpy as jnp

from . import _plot
from ._measure import available_bytes
from ._models import PRESETS, BlockConfig
from ._predict import Sizes, sizes
from ._worker import METHODS


GiB = 2**30
MiB = 2**20


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m eqx_lean.bench",
        description="Peak memory of building stacked layers: filter_vmap versus build_stacked.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--layers", type=int, help="number of stacked blocks")
    parser.add_argument("--dim", type=int, help="model width")
    parser.add_argument("--hidden", type=int, help="MLP hidden width")
    parser.add_argument("--heads", type=int, help="attention heads")
    parser.add_argument("--kv-heads", type=int, help="key/value heads")
    parser.add_argument("--dtype", default="bfloat16", help="target dtype (default bfloat16)")
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated subset of: {', '.join(METHODS)}",
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON (table rows and sweep) instead of tables"
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("bench-out"),
        help="directory the plot is written to (default: ./bench-out, created if missing)",
    )
    parser.add_argument(
        "--no-plot",
        action="store_true",
        help="write no plot, and skip the sweep that feeds it unless --sweep-layers is given",
    )
    parser.add_argument(
        "--sweep-layers",
        help="comma-separated numbers of layers measured for the plot besides --layers "
        "(default: a quarter and a half of it); 'none' for no sweep",
    )
    parser.add_argument(
        "--sweep-methods",
        help="comma-separated methods measured at every --sweep-layers point (default: those "
        f"of {', '.join(_plot.HEADLINE_METHODS)} in --methods); the others appear at --layers only",
    )
    args = parser.parse_args(argv)
    args.methods = _parse_methods(parser, "--methods", args.methods)
    if args.sweep_methods is None:
        args.sweep_methods = [m for m in _plot.HEADLINE_METHODS if m in args.methods]
    else:
        args.sweep_methods = _parse_methods(parser, "--sweep-methods", args.sweep_methods)
    args.sweep_layers = _parse_sweep_layers(parser, args.sweep_layers)
    return args


def _parse_methods(parser: argparse.ArgumentParser, flag: str, text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; choose from {list(METHODS)}")
    return methods


def _parse_sweep_layers(parser: argparse.ArgumentParser, text: str | None) -> list[int] | None:
    if text is None or text.strip().lower() == "none":
        return None if text is None else []
    try:
        layers = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        layers = [0]
    if not layers or min(layers) < 1:
        parser.error(
            f"--sweep-layers must be comma-separated positive integers or 'none'; got {text!r}"
        )
    return layers


def _config(args: argparse.Namespace) -> BlockConfig:
    overrides = {
        "num_layers": args.layers,
        "dim": args.dim,
        "hidden": args.hidden,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
    }
    return dataclasses.replace(
        PRESETS[args.preset], **{k: v for k, v in overrides.items() if v is not None}
    )


# Test seam: tests/test_bench.py stands in for the worker processes.
def _run_worker(method: str, config: BlockConfig, dtype: str) -> dict[str, Any]:
    payload = json.dumps({**dataclasses.asdict(config), "dtype": dtype})
    proc = subprocess.run(
        [sys.executable, "-m", "eqx_lean.bench._worker", method, payload],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return {"method": method, "error": proc.stderr.strip().splitlines()[-1:] or "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_or_refuse(
    method: str, config: BlockConfig, dtype: str, predicted: Sizes
) -> dict[str, Any]:
    """Runs `method` in a fresh worker, unless `predicted` says its peak would not fit."""
    need = predicted.predicted_peak(method)
    free = available_bytes()
    if need > free:
        return {
            "method": method,
            "skipped": f"refused: predicted peak {need / GiB:.1f} GiB exceeds the "
            f"{free / GiB:.1f} GiB available (the float32 layers alone need "
            f"{predicted.float32_model / GiB:.1f} GiB)",
            "predicted_peak_bytes": need,
            "available_bytes": free,
        }
    return _run_worker(method, config, dtype)


def _sweep_layers(args: argparse.Namespace, num_layers: int) -> list[int]:
    if args.sweep_layers is not None:
        return sorted(set(args.sweep_layers) - {num_layers})
    if args.no_plot:
        return []
    # A point costs about one import and compilation (~8 s at the default) whatever its L:
    # two small ones show the growth with L within the two-minute budget.
    return sorted({max(1, num_layers // 4), max(1, num_layers // 2)} - {num_layers})


def _sweep(
    args: argparse.Namespace,
    config: BlockConfig,
    dtype: str,
    rows: list[dict[str, Any]],
    predicted: Sizes,
) -> list[dict[str, Any]]:
    """The table's rows at `config.num_layers`, plus a fresh run per sweep point and method.

    Sweep points have fewer layers than `config`, so its prediction bounds theirs.
    """
    sweep = [{**row, "num_layers": config.num_layers} for row in rows]
    for num_layers in _sweep_layers(args, config.num_layers):
        smaller = dataclasses.replace(config, num_layers=num_layers)
        for method in args.sweep_methods:
            row = {**_run_or_refuse(method, smaller, dtype, predicted), "num_layers": num_layers}
            sweep.append(row)
            if not args.json:
                print(f"sweep L={num_layers:<5}{_plot.sweep_cell(row)}  {method}", flush=True)
    return sweep


def _plot_title(config: BlockConfig, dtype: str) -> str:
    return (
        f"Building stacked Mistral-shaped blocks: d={config.dim}, hidden {config.hidden}, "
        f"{config.heads} heads, {config.kv_heads} KV heads, {dtype}"
    )


def _write_plot(
    args: argparse.Namespace, sweep: list[dict[str, Any]], config: BlockConfig, dtype: str
) -> pathlib.Path | None:
    if not _plot.measured(sweep):
        print("No plot: no run was measured.", file=sys.stderr if args.json else sys.stdout)
        return None
    path = args.out / "peak_memory.png"
    try:
        _plot.write_plot(sweep, path, title=_plot_title(config, dtype))
    except _plot.MatplotlibMissing as note:
        print(note, file=sys.stderr if args.json else sys.stdout)
        return None
    return path


def _format_table(rows: list[dict[str, Any]]) -> str:
    header = f"{'method':<26}{'final':>11}{'peak-idle':>12}{'ratio':>8}{'time':>9}  note"
    lines = [header, "-" * len(header)]
    for row in rows:
        if "error" in row or "skipped" in row:
            note = row.get("skipped") or f"failed: {row['error']}"
            lines.append(f"{row['method']:<26}{'':>11}{'':>12}{'':>8}{'':>9}  {note}")
            continue
        lines.append(
            f"{row['method']:<26}{row['final_bytes'] / MiB:>8.0f} MiB"
            f"{row['peak_over_idle_bytes'] / MiB:>8.0f} MiB{row['ratio']:>7.2f}x"
            f"{row['seconds']:>8.1f}s  {row.get('note', '')}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    config = _config(args)
    dtype = jnp.dtype(args.dtype).name
    predicted = sizes(config, dtype)
    if not args.json:
        print(
            f"{config.num_layers} blocks, d={config.dim}, hidden={config.hidden}, "
            f"{config.heads} heads, {config.kv_heads} KV heads"
            + (f", vocab {config.vocab}" if config.vocab else "")
            + f"; {predicted.final / MiB:.0f} MiB in {dtype}, "
            f"{predicted.construction / MiB:.0f} MiB at construction precision",
            flush=True,
        )

    rows = []
    for method in args.methods:
        rows.append(_run_or_refuse(method, config, dtype, predicted))
        if not args.json:
            print(_format_table(rows[-1:]).splitlines()[-1], flush=True)

    for row in rows:
        if row["method"] == "build_stacked" and "ratio" in row:
            overhead = row["peak_over_idle_bytes"] - row["final_bytes"]
            temp = predicted.largest_write_temp
            row["overhead_bytes"] = overhead
            row["largest_write_temp_bytes"] = temp
            row["note"] = (
                f"overhead {overhead / MiB:.0f} MiB; largest write's XLA temp {temp / MiB:.0f} MiB"
            )

    if not args.json:
        print()
        print(_format_table(rows), flush=True)

    sweep = _sweep(args, config, dtype, rows, predicted)
    plot = None if args.no_plot else _write_plot(args, sweep, config, dtype)
    if args.json:
        print(
            json.dumps(
                {
                    "config": dataclasses.asdict(config),
                    "dtype": dtype,
                    "rows": rows,
                    "sweep": sweep,
                    "plot": None if plot is None else str(plot),
                }
            )
        )
        return 0
    if len({row["num_layers"] for row in sweep}) > 1:
        print()
        print(_plot.sweep_table(sweep))
    if plot is not None:
        print(f"\nPlot written to {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
