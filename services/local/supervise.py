"""Local supervision: restart child processes that die (the local stand-in for a restart policy).

A :class:`Supervisor` thread polls its processes; one that exits while supervision is on is
started again by the ``restart(index)`` callback, which returns the new process once it is
ready. Each restart is recorded (``restarts``) with when the death was seen and when the
replacement was ready, so recovery time can be measured.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common.commands import debug_enabled

__all__ = ["Restart", "Supervisor"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Restart:
    index: int
    exit_code: int
    died_at: float     # time.monotonic() when the death was seen
    ready_at: float    # time.monotonic() when the replacement was ready


class Supervisor:
    """Keeps ``procs[i]`` alive: ``procs`` is updated in place with each replacement."""

    def __init__(self, procs: list[subprocess.Popen[Any]],
                 restart: Callable[[int], subprocess.Popen[Any]], *, poll_s: float = 0.05,
                 max_restarts: int = 10) -> None:
        self.procs = procs
        self._restart = restart
        self.poll_s = poll_s
        self.max_restarts = max_restarts
        self.restarts: list[Restart] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="supervisor")

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop supervising (before the processes are terminated on purpose)."""
        self._stop.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            for index, proc in enumerate(self.procs):
                code = proc.poll()
                if code is None or self._stop.is_set():
                    continue
                if len(self.restarts) >= self.max_restarts:
                    log.error("process %d exited (%s); restart limit %d reached", index, code,
                              self.max_restarts)
                    return
                died = time.monotonic()
                log.warning("process %d exited with %s; restarting", index, code)
                try:
                    self.procs[index] = self._restart(index)
                except Exception as exc:  # tried again at the next poll
                    log.error("restarting process %d failed: %s", index, exc,
                              exc_info=debug_enabled())
                    continue
                self.restarts.append(Restart(index, code, died, time.monotonic()))
