"""Byte counts and aligned text tables, for the memory reports."""

from collections.abc import Sequence


MiB = 2**20
GiB = 2**30


def format_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An aligned text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        parts = [str(first).ljust(widths[0])]
        parts += [str(x).rjust(w) for x, w in zip(rest, widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])
