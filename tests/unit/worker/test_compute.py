"""The compute thread's own thread, its clocks and GIL setting: ComputeThread.start,
StepPhases (each phase's wall and CPU time, from the mark before it, averaged per step) and
gil_switch_interval."""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
import time

import pytest

from services.worker.compute import DONE, ComputeThread, StepPhases, gil_switch_interval


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


_CALLER = contextvars.ContextVar("caller", default="none")


async def test_steps_run_on_a_thread_of_their_own_never_an_executor_thread_that_ran_work() -> None:
    """The loop's executor thread that ran earlier work (a fit's warm-up pass) sits idle: a
    compute thread borrowed from the executor would be that very thread, with whatever
    per-thread state the earlier work left on it. Steps run on a new thread, with the caller's context,
    in order, and the future is done once the feed ended."""
    earlier = await asyncio.to_thread(threading.get_ident)
    _CALLER.set("fit")
    seen: list[tuple[int, str, int]] = []
    compute: ComputeThread[int] = ComputeThread(
        lambda item: seen.append((threading.get_ident(), _CALLER.get(), item)) or item * 10,
        room=None, eval_every=0, pause_each_step=False)
    done = compute.start(0)
    for item in (1, 2, 3):
        await compute.put(item)
    await compute.put(None)
    results = [await compute.results.get() for _ in range(4)]
    await asyncio.wait_for(done, 5)
    assert results == [(1, 10), (2, 20), (3, 30), DONE]
    threads = {ident for ident, _, _ in seen}
    assert len(threads) == 1 and earlier not in threads and threading.get_ident() not in threads
    assert [(caller, item) for _, caller, item in seen] == [("fit", 1), ("fit", 2), ("fit", 3)]


async def test_an_error_of_a_step_ends_the_results_and_the_thread() -> None:
    def step(item: int) -> int:
        raise ValueError(f"step of {item}")

    compute: ComputeThread[int] = ComputeThread(step, room=None, eval_every=0,
                                                pause_each_step=False)
    done = compute.start(0)
    await compute.put(7)
    got = await asyncio.wait_for(compute.results.get(), 5)
    await asyncio.wait_for(done, 5)
    assert isinstance(got, ValueError) and str(got) == "step of 7"


def test_each_phase_is_timed_from_the_mark_before_and_averaged_over_the_steps() -> None:
    """Clocks that the test moves: each phase gets what passed since the mark before it
    (a phase timed from the step's start would hold the wait too), averaged per step."""
    now = {"wall": 0.0, "cpu": 0.0}
    phases = StepPhases((lambda: now["wall"], lambda: now["cpu"]))
    for _ in range(2):
        phases.start()
        now["wall"] += 0.050  # waits: wall time, no CPU
        phases.mark("wait")
        now["wall"] += 0.012
        now["cpu"] += 0.010
        phases.mark("work")
        now["wall"] += 1.0  # between steps: in no phase
    per_step = phases.per_step(2)
    assert list(per_step) == ["wait", "work"]
    assert per_step["wait"] == {"wall_ms": pytest.approx(50), "cpu_ms": 0}
    assert per_step["work"] == {"wall_ms": pytest.approx(12), "cpu_ms": pytest.approx(10)}
    phases.reset()
    assert phases.per_step(1) == {}


def test_a_step_phases_reads_its_thread_cpu_time() -> None:
    """With the real clocks, CPU work shows as the phase's CPU and sleeping does not."""
    phases = StepPhases()
    phases.start()
    time.sleep(0.05)
    phases.mark("wait")
    _busy(0.01)
    phases.mark("work")
    per_step = phases.per_step(1)
    assert per_step["wait"]["wall_ms"] >= 49 and per_step["wait"]["cpu_ms"] < 10
    assert per_step["work"]["cpu_ms"] >= 9.5


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
