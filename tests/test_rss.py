"""`eqx_lean/_rss.py`, the one reader of a process's resident memory: the parsing of
`/proc/<pid>/status` against a written-out file, and the figures of this process against each
other."""

import resource
import sys

import pytest

from eqx_lean.internal import (
    MEMORY_FIELDS,
    file_rss_bytes,
    memory_status,
    peak_rss_bytes,
    rss_bytes,
    rss_high_water_mark,
    rss_reader,
    sampled_rss_bytes,
    status_kib,
)


STATUS = """\
Name:\tpython
VmPeak:\t 9000000 kB
VmHWM:\t  123456 kB
VmRSS:\t  100000 kB
RssAnon:\t   70000 kB
RssFile:\t   29000 kB
RssShmem:\t    1000 kB
Threads:\t8
"""


@pytest.fixture
def status(monkeypatch):
    read = []
    monkeypatch.setattr(rss_reader, "_status_text", lambda pid: read.append(pid) or STATUS)
    return read


def test_status_lines_in_kib_and_in_bytes(status):
    assert status_kib("VmHWM") == 123456
    assert status_kib("RssShmem", pid=42) == 1000
    assert status == ["self", 42]
    assert (rss_bytes(), peak_rss_bytes(), file_rss_bytes()) == (
        100000 * 1024,
        123456 * 1024,
        29000 * 1024,
    )
    assert memory_status(7) == {
        "VmHWM": 123456 * 1024,
        "VmRSS": 100000 * 1024,
        "RssAnon": 70000 * 1024,
        "RssFile": 29000 * 1024,
    }
    with pytest.raises(RuntimeError, match="VmSwap not found in /proc/self/status"):
        status_kib("VmSwap")


def test_high_water_mark_falls_back_to_getrusage(monkeypatch, status):
    assert rss_high_water_mark() == 123456 * 1024

    def no_proc(pid):
        raise FileNotFoundError(f"/proc/{pid}/status")

    monkeypatch.setattr(rss_reader, "_status_text", no_proc)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    expected = maxrss if sys.platform == "darwin" else maxrss * 1024
    # The mark only rises, and nothing large is allocated between the two reads.
    assert expected <= rss_high_water_mark() <= expected + 16 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_this_process_figures_agree():
    rss, sampled, peak = rss_bytes(), sampled_rss_bytes(), peak_rss_bytes()
    assert sampled is not None
    # `statm` and `status` count the same pages; nothing large is allocated between the reads.
    assert abs(sampled - rss) <= 4 * 2**20
    assert 0 < rss <= peak
    assert file_rss_bytes() < rss
    status = memory_status()
    assert set(status) == set(MEMORY_FIELDS)
    assert status["RssAnon"] + status["RssFile"] <= status["VmRSS"] + 4 * 2**20
