"""The compute thread's clocks and GIL setting: StepPhases (each phase's wall and CPU time,
from the mark before it, averaged per step) and gil_switch_interval."""

from __future__ import annotations

import sys
import time

from services.worker.compute import StepPhases, gil_switch_interval


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


def test_the_switch_interval_is_lowered_while_any_body_runs_and_then_restored() -> None:
    before = sys.getswitchinterval()
    with gil_switch_interval(None):
        assert sys.getswitchinterval() == before
    outer = gil_switch_interval(0.0005)
    outer.__enter__()
    assert sys.getswitchinterval() == 0.0005
    with gil_switch_interval(0.001):  # a second compute thread: never raised while one runs
        assert sys.getswitchinterval() == 0.0005
    assert sys.getswitchinterval() == 0.0005  # the first still runs
    outer.__exit__(None, None, None)
    assert sys.getswitchinterval() == before
