"""`eqx_lean/_rss.py`, the one reader of a process's resident memory: the parsing of
`/proc/<pid>/status` against a written-out file, and the figures of this process against each
other."""

import resource
import sys

import pytest

from eqx_lean import _rss


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
    monkeypatch.setattr(_rss, "_status_text", lambda pid: read.append(pid) or STATUS)
    return read


def test_status_lines_in_kib_and_in_bytes(status):
    assert _rss.status_kib("VmHWM") == 123456
    assert _rss.status_kib("RssShmem", pid=42) == 1000
    assert status == ["self", 42]
    assert (_rss.rss_bytes(), _rss.peak_rss_bytes(), _rss.file_rss_bytes()) == (
        100000 * 1024,
        123456 * 1024,
        29000 * 1024,
    )
    assert _rss.memory_status(7) == {
        "VmHWM": 123456 * 1024,
        "VmRSS": 100000 * 1024,
        "RssAnon": 70000 * 1024,
        "RssFile": 29000 * 1024,
    }
    with pytest.raises(RuntimeError, match="VmSwap not found in /proc/self/status"):
        _rss.status_kib("VmSwap")


def test_high_water_mark_falls_back_to_getrusage(monkeypatch, status):
    assert _rss.rss_high_water_mark() == 123456 * 1024

    def no_proc(pid):
        raise FileNotFoundError(f"/proc/{pid}/status")

    monkeypatch.setattr(_rss, "_status_text", no_proc)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    expected = maxrss if sys.platform == "darwin" else maxrss * 1024
    # The mark only rises, and nothing large is allocated between the two reads.
    assert expected <= _rss.rss_high_water_mark() <= expected + 16 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_this_process_figures_agree():
    rss, sampled, peak = _rss.rss_bytes(), _rss.sampled_rss_bytes(), _rss.peak_rss_bytes()
    assert sampled is not None
    # `statm` and `status` count the same pages; nothing large is allocated between the reads.
    assert abs(sampled - rss) <= 4 * 2**20
    assert 0 < rss <= peak
    assert _rss.file_rss_bytes() < rss
    status = _rss.memory_status()
    assert set(status) == set(_rss.MEMORY_FIELDS)
    assert status["RssAnon"] + status["RssFile"] <= status["VmRSS"] + 4 * 2**20
