"""The benches' shared measures: a process's CPU time and memory from /proc
(bench/procstats.py) and latency quantiles (bench.latency_quantiles)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import latency_quantiles
from bench.procstats import cpu_seconds, memory_mb


def _absent_pid() -> int:
    """A pid no process can have: one above the kernel's largest."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def test_cpu_seconds_grows_with_the_work_a_process_does():
    before = cpu_seconds(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:  # busy: 0.3 s of this process's CPU
        pass
    after = cpu_seconds(os.getpid())
    assert before is not None and after is not None
    assert 0.2 <= after - before <= 5.0  # clock ticks of 10 ms; the whole process counts


def test_cpu_seconds_counts_a_child_process_by_its_pid():
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nend = time.process_time() + 0.5\n"
                              "while time.process_time() < end: pass\ninput()"],
                             stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while (cpu_seconds(child.pid) or 0.0) < 0.4:
            assert time.monotonic() < deadline, "the child never used its CPU time"
            time.sleep(0.01)
        assert cpu_seconds(os.getpid()) != cpu_seconds(child.pid)
    finally:
        child.communicate(b"\n", timeout=30)


def test_memory_reads_the_resident_set_and_its_peak():
    rss, peak = memory_mb(os.getpid()), memory_mb(os.getpid(), "VmHWM")
    assert rss is not None and peak is not None
    assert 10 < rss <= peak  # an interpreter with numpy holds more than 10 MiB
    # 64 MiB of fresh anonymous memory, every page written: a bytearray could be carved out
    # of heap pages this process already holds (freed by earlier tests), leaving RSS flat
    block = mmap.mmap(-1, 64 << 20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    grown = memory_mb(os.getpid())
    assert grown is not None and grown >= rss + 60
    block.close()


def test_readers_answer_none_for_a_missing_process_or_field():
    assert cpu_seconds(_absent_pid()) is None
    assert memory_mb(_absent_pid()) is None
    assert memory_mb(os.getpid(), "VmNothing") is None


def test_latency_quantiles_are_in_milliseconds():
    seconds = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    q = latency_quantiles(seconds)
    assert q == pytest.approx({"p50_ms": 50.5, "p99_ms": 99.01})
    assert latency_quantiles([0.002]) == {"p50_ms": 2.0, "p99_ms": 2.0}
