"""Resident memory (RSS) of a process, read from `/proc`: every reader of the package, the
benchmarks and the example.

`/proc/<pid>/status` gives `VmRSS` (resident now), `VmHWM` (its high-water mark), `RssAnon`
(what the process itself holds) and `RssFile` (mapped files: libraries, memory maps) in KiB;
`/proc/self/statm` gives the resident pages in one short line, cheap enough to sample every few
milliseconds.
"""

import pathlib
import resource
import sys


MEMORY_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
"""The memory lines of `/proc/<pid>/status` that `memory_status` reads."""

_PAGE_SIZE = resource.getpagesize()


# Test seam: tests/test_rss.py reads a written-out status file instead.
def _status_text(pid: int | str) -> str:
    return pathlib.Path(f"/proc/{pid}/status").read_text()


def status_kib(field: str, pid: int | str = "self") -> int:
    """One line of `/proc/<pid>/status`, in KiB (the file's own unit).

    **Arguments:**

    - `field`: the line's name, such as `"VmHWM"` or `"RssAnon"`.
    - `pid`: the process; `"self"` by default.

    **Returns:**

    The line's value in KiB. Raises `RuntimeError` where the file has no such line, and
    `OSError` where it cannot be read (no `/proc`, or no such process).
    """
    for line in _status_text(pid).splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/{pid}/status")


def memory_status(pid: int | str = "self") -> dict[str, int]:
    """The memory lines of `/proc/<pid>/status` (`MEMORY_FIELDS`), in bytes.

    **Arguments:**

    - `pid`: the process; `"self"` by default.

    **Returns:**

    A dict from each line's name to its value in bytes, for those of `MEMORY_FIELDS` the file
    has. Raises `OSError` where it cannot be read (no `/proc`, or no such process).
    """
    found = {}
    for line in _status_text(pid).splitlines():
        name, _, value = line.partition(":")
        if name in MEMORY_FIELDS:
            found[name] = int(value.split()[0]) * 1024
    return found


def rss_bytes() -> int:
    """This process's resident memory now (`VmRSS`), in bytes; see `status_kib` for errors."""
    return status_kib("VmRSS") * 1024


def file_rss_bytes() -> int:
    """This process's resident pages of mapped files (`RssFile`: libraries, memory maps), in
    bytes; see `status_kib` for errors."""
    return status_kib("RssFile") * 1024


def peak_rss_bytes() -> int:
    """The high-water mark of this process's resident memory (`VmHWM`), in bytes; see
    `status_kib` for errors (`rss_high_water_mark` falls back off Linux instead)."""
    return status_kib("VmHWM") * 1024


def rss_high_water_mark() -> int:
    """The largest resident memory this process has had, in bytes, wherever it runs.

    **Returns:**

    `VmHWM` where `/proc` has it (as `peak_rss_bytes`), else `getrusage`'s `ru_maxrss`
    (kibibytes on Linux, bytes on macOS).
    """
    try:
        return peak_rss_bytes()
    except (OSError, RuntimeError):
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def sampled_rss_bytes() -> int | None:
    """This process's resident memory now, from `/proc/self/statm`: the same figure as
    `rss_bytes` in a shorter read, for sampling every few milliseconds.

    **Returns:**

    The resident pages times the page size, in bytes; `None` without `/proc`.
    """
    try:
        fields = pathlib.Path("/proc/self/statm").read_text().split()
    except OSError:
        return None
    return int(fields[1]) * _PAGE_SIZE
