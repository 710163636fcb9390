"""The bound each mode gives a run's lookups (services.worker.embedding.bound)."""

from __future__ import annotations

import pytest

from services.common.errors import ConfigError
from services.worker.embedding.bound import StalenessBound, staleness_bound


@pytest.mark.parametrize(("mode", "window", "workers", "gate", "expected"), [
    ("hybrid", 8, 4, True, StalenessBound(own=7, any_worker=8)),    # the step gate: SSP
    ("hybrid", 8, 4, False, StalenessBound(own=7, any_worker=None)),  # own pushes only
    ("hybrid", 8, 1, True, StalenessBound(own=7, any_worker=7)),    # one worker: its own
    ("sync", 1, 4, True, StalenessBound(own=0, any_worker=1)),      # the others' latest push
    ("sync", 1, 1, True, StalenessBound(own=0, any_worker=0)),
    ("global_sync", 1, 4, True, StalenessBound(own=0, any_worker=0)),
])
def test_each_mode_has_its_bound(mode: str, window: int, workers: int, gate: bool,
                                 expected: StalenessBound) -> None:
    assert staleness_bound(mode, window=window, workers=workers, global_bound=gate) == expected


def test_async_has_no_bound_and_says_so() -> None:
    assert staleness_bound("async", window=None, workers=4, global_bound=True) is None
    assert "not bounded across" in StalenessBound(own=7, any_worker=None).describe()
    assert "at most 8 of any worker's" in StalenessBound(own=7, any_worker=8).describe()


@pytest.mark.parametrize(("mode", "window", "workers", "field"), [
    ("hybrid", None, 2, "window"), ("sync", 0, 2, "window"), ("hybrid", True, 2, "window"),
    ("lockstep", 1, 2, "mode"), ("hybrid", 2, 0, "workers")])
def test_bad_settings_are_clear_errors(mode: str, window: object, workers: int,
                                       field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        staleness_bound(mode, window=window, workers=workers,  # type: ignore[arg-type]
                        global_bound=True)
