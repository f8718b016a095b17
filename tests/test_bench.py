"""`python -m eqx_lean.bench`: the sweep over the number of layers, its plot, and the flags."""

import json
import pathlib
import re
import struct
import subprocess
import sys
from typing import Any

import pytest

from eqx_lean.internal import BlockConfig, bench_cli, bench_main, sweep_table, write_plot


MiB = 2**20
README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
TINY = ["--dim", "64", "--hidden", "128", "--heads", "2", "--kv-heads", "1"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: pathlib.Path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk, read without matplotlib."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _row(method: str, num_layers: int, peak_mib: int, final_mib: int) -> dict[str, Any]:
    return {
        "method": method,
        "num_layers": num_layers,
        "peak_over_idle_bytes": peak_mib * MiB,
        "final_bytes": final_mib * MiB,
        "ratio": peak_mib / final_mib,
        "seconds": 1.0,
    }


def _fake_worker(calls: list[tuple[str, int]]):
    """Stands in for the fresh-process worker: 1 MiB per layer, peak 3x (4x for filter_vmap)."""

    def run(method: str, config: BlockConfig, dtype: str) -> dict[str, Any]:
        calls.append((method, config.num_layers))
        factor = 4 if method == "filter_vmap" else 3
        row = _row(method, config.num_layers, factor * config.num_layers, config.num_layers)
        del row["num_layers"]  # the worker does not report it; the sweep adds it
        return row

    return run


# --- the plot and the sweep table, from given rows ----------------------------------------------


SWEEP_ROWS = [
    _row("filter_vmap", 6, 620, 156),
    _row("build_stacked", 6, 280, 156),
    _row("filter_vmap", 24, 2313, 624),
    _row("build_stacked", 24, 758, 624),
    _row("filter_jit(filter_vmap)", 24, 3881, 624),
    {"method": "list + jnp.stack", "num_layers": 24, "skipped": "refused: too big"},
]


def test_write_plot_writes_a_png(tmp_path):
    path = tmp_path / "new" / "plot.png"
    write_plot(SWEEP_ROWS, path, title="a title")
    assert _png_size(path) == (750, 480)  # figsize (7.5, 4.8) at 100 dpi
    assert 20_000 < path.stat().st_size < 100_000


def test_write_plot_needs_a_measured_run(tmp_path):
    with pytest.raises(ValueError, match="`rows` must hold at least one measured run"):
        write_plot(SWEEP_ROWS[-1:], tmp_path / "plot.png", title="t")


def test_sweep_table():
    lines = sweep_table(SWEEP_ROWS).splitlines()
    assert re.split(r"\s{2,}", lines[1]) == ["method", "L=6", "L=24"]
    assert re.split(r"\s{2,}", lines[2]) == ["filter_vmap", "620 MiB 3.97x", "2313 MiB 3.71x"]
    assert re.split(r"\s{2,}", lines[3]) == ["build_stacked", "280 MiB 1.79x", "758 MiB 1.21x"]
    assert re.split(r"\s{2,}", lines[4]) == ["filter_jit(filter_vmap)", "3881 MiB 6.22x"]
    assert re.split(r"\s{2,}", lines[5]) == ["list + jnp.stack", "refused"]
    assert re.split(r"\s{2,}", lines[6]) == ["final stack", "156 MiB", "624 MiB"]


# --- the command's flags, with the worker stood in for ------------------------------------------


def test_default_sweep_is_a_quarter_and_a_half(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(bench_cli, "_run_worker", _fake_worker(calls))
    argv = ["--layers", "8", *TINY, "--methods", "filter_vmap,list + jnp.stack"]
    assert bench_main([*argv, "--out", str(tmp_path)]) == 0
    # Only the headline methods among --methods are swept by default.
    assert calls == [
        ("filter_vmap", 8),
        ("list + jnp.stack", 8),
        ("filter_vmap", 2),
        ("filter_vmap", 4),
    ]
    out = capsys.readouterr().out
    assert f"Plot written to {tmp_path / 'peak_memory.png'}" in out
    assert re.search(r"filter_vmap\s+8 MiB 4.00x\s+16 MiB 4.00x\s+32 MiB 4.00x", out)
    assert _png_size(tmp_path / "peak_memory.png") == (750, 480)


def test_no_plot_skips_the_plot_and_the_sweep(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(bench_cli, "_run_worker", _fake_worker(calls))
    argv = ["--layers", "8", *TINY, "--methods", "filter_vmap", "--no-plot"]
    assert bench_main([*argv, "--out", str(tmp_path / "out")]) == 0
    assert calls == [("filter_vmap", 8)]
    assert not (tmp_path / "out").exists()
    assert "Plot written" not in capsys.readouterr().out

    # An explicit sweep still runs without a plot.
    calls.clear()
    assert bench_main([*argv, "--sweep-layers", "3", "--out", str(tmp_path / "out")]) == 0
    assert calls == [("filter_vmap", 8), ("filter_vmap", 3)]
    assert not (tmp_path / "out").exists()


def test_sweep_methods(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(bench_cli, "_run_worker", _fake_worker(calls))
    argv = ["--layers", "4", *TINY, "--methods", "filter_vmap", "--sweep-layers", "2,4,6"]
    argv += ["--sweep-methods", "filter_vmap,list + jnp.stack", "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    # L=4 is the table's run; only the other points are new runs.
    assert calls == [
        ("filter_vmap", 4),
        ("filter_vmap", 2),
        ("list + jnp.stack", 2),
        ("filter_vmap", 6),
        ("list + jnp.stack", 6),
    ]


def test_sweep_layers_none(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(bench_cli, "_run_worker", _fake_worker(calls))
    argv = ["--layers", "8", *TINY, "--methods", "filter_vmap", "--sweep-layers", "none"]
    assert bench_main([*argv, "--out", str(tmp_path)]) == 0
    assert calls == [("filter_vmap", 8)]
    assert (tmp_path / "peak_memory.png").exists()


def test_without_matplotlib_a_note_and_no_plot(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setattr(bench_cli, "_run_worker", _fake_worker([]))
    argv = ["--layers", "4", *TINY, "--methods", "filter_vmap", "--out", str(tmp_path / "out")]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "matplotlib is not installed, so no plot was written" in out
    assert "Plot written" not in out
    assert not (tmp_path / "out").exists()

    # With --json the note goes to stderr and stdout stays one JSON document.
    assert bench_main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert "matplotlib is not installed" in captured.err
    assert json.loads(captured.out)["plot"] is None


@pytest.mark.parametrize("text", ["0", "4,x", ",", "-2"])
def test_bad_sweep_layers(text, capsys):
    with pytest.raises(SystemExit):
        bench_main(["--sweep-layers", text])
    assert "--sweep-layers must be comma-separated positive integers or 'none'" in (
        capsys.readouterr().err
    )


def test_bad_sweep_methods(capsys):
    with pytest.raises(SystemExit):
        bench_main(["--sweep-methods", "filter_vmap,vmapp"])
    assert "--sweep-methods: unknown ['vmapp']" in capsys.readouterr().err


# --- the real command, end to end ---------------------------------------------------------------


def test_json_includes_the_sweep_and_the_plot_is_written(tmp_path):
    argv = [*TINY, "--layers", "2", "--sweep-layers", "1", "--out", str(tmp_path), "--json"]
    argv += ["--methods", "filter_vmap"]  # two fresh processes: L=2 for the table, L=1
    proc = subprocess.run(
        [sys.executable, "-m", "eqx_lean.bench", *argv],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(proc.stdout)
    assert result["plot"] == str(tmp_path / "peak_memory.png")
    assert _png_size(tmp_path / "peak_memory.png") == (750, 480)

    sweep = {(row["method"], row["num_layers"]): row for row in result["sweep"]}
    assert sorted(sweep) == [("filter_vmap", 1), ("filter_vmap", 2)]
    # The point at --layers is the table's own run, not a new one.
    assert [{**row, "num_layers": 2} for row in result["rows"]] == [sweep["filter_vmap", 2]]
    one, two = sweep["filter_vmap", 1], sweep["filter_vmap", 2]
    assert two["final_bytes"] == 2 * one["final_bytes"]
    assert one["peak_over_idle_bytes"] > 0


# --- the README's main job ------------------------------------------------------------------------
