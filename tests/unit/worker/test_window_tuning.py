"""``staleness auto`` measured again as a job runs: the window each measurement picks
(:func:`window_for`, :class:`WindowTuner`) and the slots resized under running batches
(:meth:`Slots.resize`: a larger window frees slots at once, a smaller one never lets a lookup
start beyond the size it started under)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import InvalidArgument
from services.worker.embedding.slots import Slots
from services.worker.embedding.window import WindowChoice, WindowTuner, window_for


def test_the_window_hides_the_round_trip_behind_whole_steps() -> None:
    assert window_for(0.0, 5.0) == window_for(0.01, 5.0) == 1  # nothing to hide
    assert window_for(5.0, 5.0) == 2  # one step in flight hides one step's round trip
    assert window_for(5.1, 5.0) == 3
    assert window_for(12.5, 5.0) == 4
    assert window_for(1e6, 5.0, most=6) == 6
    for rtt, step in ((-1.0, 5.0), (float("nan"), 5.0), (1.0, 0.0)):
        with pytest.raises(ValueError, match="round_trip_ms|step_ms"):
            window_for(rtt, step)


def _tuner(window: int = 2, every: int = 10) -> WindowTuner:
    return WindowTuner(WindowChoice(window=window, round_trip_ms=3.0, reason="probed"),
                       most=8, every=every)


def test_the_tuner_measures_every_so_many_steps_with_the_median_trip() -> None:
    tuner = _tuner()
    for ms in (9.0, 9.5, 10.0, 400.0):  # one stalled lookup does not size the window
        tuner.lookup_took(ms / 1e3)
    assert tuner.measure(9, 0.045) is None and not tuner.choice.remeasured  # too early
    assert tuner.measure(10, 0.050) == 3  # 9.75 ms behind steps of 5 ms: 2 in flight
    assert tuner.choice.remeasured == [{"step": 10, "round_trip_ms": 9.75, "step_ms": 5.0,
                                        "window": 3}]
    for _ in range(3):
        tuner.lookup_took(0.0098)
    assert tuner.measure(20, 0.100) is None  # measured again: the same window
    assert len(tuner.choice.remeasured) == 2
    for _ in range(3):  # the step got slower: fewer steps hide the same trip
        tuner.lookup_took(0.0098)
    assert tuner.measure(30, 0.300) == 2  # 10 steps of 20 ms since the last measurement
    assert tuner.choice.as_dict()["remeasured"][-1]["step_ms"] == pytest.approx(20.0)


def test_no_lookups_timed_means_no_measurement() -> None:
    tuner = _tuner()
    assert tuner.measure(100, 1.0) is None and tuner.choice.remeasured == []
    with pytest.raises(ValueError, match="every"):
        _tuner(every=0)


async def _taken(slots: Slots) -> int | None:
    """The staleness of a take that gets a slot now, else None (it would wait)."""
    task = asyncio.ensure_future(slots.take())
    await asyncio.sleep(0)
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def test_a_larger_window_frees_its_new_slots_at_once() -> None:
    slots = Slots(1)
    assert await _taken(slots) == 0
    waiting = asyncio.ensure_future(slots.take())
    await asyncio.sleep(0)
    assert not waiting.done()
    await slots.resize(3)
    await asyncio.sleep(0)
    assert waiting.done() and waiting.result() == 1
    assert await _taken(slots) == 2 and await _taken(slots) is None  # three in flight


async def test_a_smaller_window_takes_its_slots_back_as_they_come_back() -> None:
    slots = Slots(3)
    for staleness in range(3):
        assert await _taken(slots) == staleness
    await slots.resize(1)  # three in flight: two slots owed
    slots.acknowledged(None, None)
    assert await _taken(slots) is None  # the freed slot paid the debt
    slots.acknowledged(None, None)
    assert await _taken(slots) is None
    slots.acknowledged(None, None)  # the last of the three: one slot for one batch
    assert await _taken(slots) == 0
    assert await _taken(slots) is None and slots.size == 1


async def test_a_smaller_window_takes_free_slots_at_once_and_lets_no_rider_ride() -> None:
    slots = Slots(4)
    assert await _taken(slots) == 0
    await slots.resize(2)  # two of the three free slots taken back now
    assert await _taken(slots) == 1
    assert await _taken(slots) is None
    slots = Slots(2)
    await _taken(slots)
    await _taken(slots)
    rider = slots.wait_as_rider(plan=None)  # type: ignore[arg-type]
    await slots.resize(1)
    assert slots.carry() is None  # the next freed slot pays the debt: nobody rides on it
    slots.acknowledged(None, None)
    assert not rider.future.done()
    assert slots.carry() is rider  # debt paid: the next push carries the rider


async def test_resizing_refuses_a_bad_size_and_an_unbounded_window() -> None:
    slots = Slots(2)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidArgument, match="window"):
            await slots.resize(bad)  # type: ignore[arg-type]
    assert slots.size == 2 and await _taken(slots) == 0 and await _taken(slots) == 1
    with pytest.raises(InvalidArgument, match="unbounded"):
        await Slots(None).resize(2)


def test_the_first_measurement_comes_early_then_every_so_many_steps() -> None:
    tuner = _tuner(every=200)
    for step in (15, 16, 215, 216):
        tuner.lookup_took(0.004)
        tuner.measure(step, step * 0.004)
    assert [m["step"] for m in tuner.choice.remeasured] == [16, 216]
