"""The benchmark's sweep over the number of layers, as a table and as a PNG plot.

Every figure comes from one fresh-process run (a row of the benchmark, with its `num_layers`);
matplotlib is imported only when a plot is written, so the benchmark runs without it.
"""

import pathlib
from collections.abc import Sequence
from typing import Any


GiB = 2**30
MiB = 2**20

HEADLINE_METHODS = ("filter_vmap", "build_stacked")
_COLOURS = {
    "filter_vmap": "tab:red",
    "filter_jit(filter_vmap)": "tab:orange",
    "list + jnp.stack": "tab:purple",
    "build_stacked": "tab:blue",
}


class MatplotlibMissing(ImportError):
    """matplotlib is not installed: the benchmark prints this note and writes no plot."""


def measured(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of runs that completed (neither refused nor failed)."""
    return [row for row in rows if "peak_over_idle_bytes" in row]


def _methods(rows: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(row["method"] for row in rows))


def final_bytes_by_layers(rows: Sequence[dict[str, Any]]) -> dict[int, int]:
    """The final stacked bytes measured at each number of layers (equal for every method)."""
    return {row["num_layers"]: row["final_bytes"] for row in measured(rows)}


def sweep_table(rows: Sequence[dict[str, Any]]) -> str:
    """Peak RSS over idle of each method (rows) at each number of layers (columns).

    **Arguments:**

    - `rows`: benchmark rows, each with `method` and `num_layers`, and either
        `peak_over_idle_bytes` and `final_bytes` or a `skipped`/`error` entry.

    **Returns:**

    The table as text, ending with the final stacked bytes at each number of layers.
    """
    layers = sorted({row["num_layers"] for row in rows})
    cells = {(row["method"], row["num_layers"]): sweep_cell(row) for row in rows}
    width = max(10, *(len(cell) + 2 for cell in cells.values()))
    lines = [
        "peak RSS over idle, by number of layers (each a fresh process):",
        f"{'method':<26}" + "".join(f"{f'L={n}':>{width}}" for n in layers),
    ]
    for method in _methods(rows):
        lines.append(
            f"{method:<26}" + "".join(f"{cells.get((method, n), ''):>{width}}" for n in layers)
        )
    finals = final_bytes_by_layers(rows)
    lines.append(
        f"{'final stack':<26}"
        + "".join(f"{_mib(finals[n]) if n in finals else '':>{width}}" for n in layers)
    )
    return "\n".join(lines)


def _mib(nbytes: int) -> str:
    return f"{nbytes / MiB:.0f} MiB"


def sweep_cell(row: dict[str, Any]) -> str:
    """One run's peak RSS over idle and its ratio to the final bytes, or why it has none."""
    if "peak_over_idle_bytes" in row:
        return f"{_mib(row['peak_over_idle_bytes'])} {row['ratio']:.2f}x"
    return "refused" if "skipped" in row else "failed"


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise MatplotlibMissing(
            "matplotlib is not installed, so no plot was written "
            '(from the root of the eqx_lean checkout, `pip install ".[bench]"` adds it, as does '
            "`pip install matplotlib`)."
        ) from error
    return Figure


def write_plot(rows: Sequence[dict[str, Any]], path: str | pathlib.Path, *, title: str) -> None:
    """Writes a PNG of peak RSS over idle against the number of layers, one line per method.

    `filter_vmap` and `build_stacked` are drawn bold, the other methods thin; a dashed line
    shows the final stacked bytes. Refused or failed runs are left out.

    **Arguments:**

    - `rows`: benchmark rows as for [`sweep_table`][], each with `method` and `num_layers`.
    - `path`: the PNG file to write; missing parent directories are created.
    - `title`: the plot's title.

    **Returns:**

    Nothing. Raises `MatplotlibMissing` (an `ImportError`) when matplotlib is not installed.
    """
    runs = measured(rows)
    if not runs:
        raise ValueError("`rows` must hold at least one measured run to plot; none was measured.")
    figure_class = _figure_class()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure = figure_class(figsize=(7.5, 4.8), dpi=100, layout="constrained")
    axes = figure.subplots()
    unit, unit_name = (GiB, "GiB") if max(_peaks(runs)) >= GiB else (MiB, "MiB")

    # Headline methods first, so that they lead the legend and are drawn on top.
    methods = sorted(_methods(runs), key=lambda method: method not in HEADLINE_METHODS)
    for method in methods:
        points = sorted(
            (row["num_layers"], row["peak_over_idle_bytes"] / unit, row["ratio"])
            for row in runs
            if row["method"] == method
        )
        xs, ys, _ = zip(*points, strict=True)
        headline = method in HEADLINE_METHODS
        axes.plot(
            xs,
            ys,
            marker="o",
            markersize=6 if headline else 4,
            linewidth=2.5 if headline else 1.0,
            alpha=1.0 if headline else 0.7,
            color=_COLOURS.get(method),
            label=method,
            zorder=3 if headline else 2,
        )
        for x, y, ratio in points:
            # Headline labels sit above-left of their point, the others to its right, so that
            # labels at the same L do not cover each other.
            axes.annotate(
                f"{ratio:.2f}x",
                (x, y),
                textcoords="offset points",
                xytext=(-6, 7) if headline else (7, -3),
                ha="right" if headline else "left",
                fontsize=8,
                color=_COLOURS.get(method),
            )

    finals = sorted(final_bytes_by_layers(runs).items())
    axes.plot(
        [n for n, _ in finals],
        [nbytes / unit for _, nbytes in finals],
        linestyle="--",
        color="black",
        linewidth=1.2,
        label="final stacked bytes",
        zorder=1,
    )

    axes.set_xlim(0, max(n for n, _ in finals) * 1.12)
    axes.set_ylim(0, max(_peaks(runs)) / unit * 1.15)
    axes.set_xlabel("number of stacked layers L")
    axes.set_ylabel(f"peak RSS over idle ({unit_name})")
    axes.xaxis.get_major_locator().set_params(integer=True)
    figure.suptitle(title, fontsize=10)
    axes.set_title(
        "each point: a fresh process, peak RSS (VmHWM) minus idle; labels: peak over final bytes",
        fontsize=8,
        color="dimgrey",
    )
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", fontsize=9)
    figure.savefig(path)


def _peaks(rows: Sequence[dict[str, Any]]) -> list[int]:
    return [row["peak_over_idle_bytes"] for row in rows]
