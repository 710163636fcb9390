"""StepPhases: each phase's wall and CPU time, from the mark before it, averaged per step."""

from __future__ import annotations

import time

from services.worker.compute import StepPhases


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_each_phase_is_timed_from_the_mark_before_and_averaged_over_the_steps() -> None:
    phases = StepPhases()
    for _ in range(2):
        phases.start()
        time.sleep(0.05)
        phases.mark("wait")
        _busy(0.01)
        phases.mark("work")
    per_step = phases.per_step(2)
    assert list(per_step) == ["wait", "work"]
    assert per_step["wait"]["wall_ms"] >= 49 and per_step["wait"]["cpu_ms"] < 10
    assert per_step["work"]["cpu_ms"] >= 9.5
    assert per_step["work"]["wall_ms"] < 45  # the sleep before its mark is not in it
    phases.reset()
    assert phases.per_step(1) == {}
