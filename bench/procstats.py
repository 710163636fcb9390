"""What a bench reads of a process from Linux ``/proc``: its CPU time and its memory.

Each reader answers None where the file is not there (another OS, a process gone), so that
a bench reports the figure as missing; a bench that needs it says so.
"""

from __future__ import annotations

import os

__all__ = ["cpu_seconds", "memory_mb"]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far, all its threads
    (``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command, which may hold ")"
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mb(pid: int, field: str = "VmRSS") -> float | None:
    """Memory field ``field`` of process ``pid`` in MiB (``/proc/<pid>/status``): ``VmRSS``
    its resident set now, ``VmHWM`` its peak; None also for a field it does not have."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == field:
                    return int(value.split()[0]) / 1024
    except OSError:
        return None
    return None
