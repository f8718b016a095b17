"""Memory a new process can use, read from `/proc` and the cgroup. (A process's own resident
memory is read by `eqx_lean._rss`.)"""

import pathlib


def _read_int(path: pathlib.Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def _cgroup_headroom() -> int | None:
    v2 = pathlib.Path("/sys/fs/cgroup")
    limit, usage = _read_int(v2 / "memory.max"), _read_int(v2 / "memory.current")
    if limit is None:
        v1 = v2 / "memory"
        limit = _read_int(v1 / "memory.limit_in_bytes")
        usage = _read_int(v1 / "memory.usage_in_bytes")
        # cgroup v1 reports "no limit" as a huge page-aligned number.
        if limit is not None and limit >= 2**60:
            limit = None
    if limit is None or usage is None:
        return None
    return limit - usage


def available_bytes() -> int:
    """Memory a new process can use: `MemAvailable`, capped by the cgroup's remaining limit."""
    available = None
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        raise RuntimeError("MemAvailable not found in /proc/meminfo")
    headroom = _cgroup_headroom()
    return available if headroom is None else min(available, headroom)
