"""The embedding window sized from what it hides: ``--staleness auto``.

A window of S batches lets a lookup start while the S - 1 batches before it are still being
computed and pushed: it hides a PS round trip behind their compute, and costs accuracy
(every windowed row read may miss up to S - 1 pushes). So ``auto`` measures the round trip
to the rows at the start of a job (:func:`probe_round_trip_ms`: the median of a few
requests) and picks the smallest window that hides it behind the compute of a step
(:func:`auto_window`): 1 — no staleness — where the shards are embedded in the worker's
process or answer within :data:`NO_ROUND_TRIP_MS`, else one batch in flight
per :data:`STEP_FLOOR_MS` of round trip, at most :data:`MAX_AUTO_WINDOW`. A number given
for the staleness pins the window instead.

As the job runs, :class:`WindowTuner` measures again, after :data:`FIRST_RETUNE_STEPS` steps
and then every :data:`RETUNE_STEPS`, what
the window hides and what hides it: the median wall time of the batches' own lookups (their
rows, queueing and payloads included, which a probe of the tables' description does not
carry) against the compute of a step as the compute thread timed it, and sizes the window
(:func:`window_for`) to hide the one behind the other. Each measurement goes to the summary's
``window_choice["remeasured"]`` and to the live page.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from services.worker.embedding.rows import DirectRows, RowsClient

__all__ = ["FIRST_RETUNE_STEPS", "MAX_AUTO_WINDOW", "NO_ROUND_TRIP_MS", "RETUNE_STEPS",
           "STEP_FLOOR_MS",
           "WindowChoice", "WindowTuner", "auto_window", "choose_window", "probe_round_trip_ms",
           "window_for"]

# a round trip this short is a call in this process: there is nothing to hide
NO_ROUND_TRIP_MS = 0.05
# the least compute of a step the window is sized against: a round trip of k times this is
# hidden by k batches in flight (steps of the bench's models take 5-30 ms on 2 cores, so a
# longer step hides more and the window is then larger than it needs to be, never smaller)
STEP_FLOOR_MS = 2.0
MAX_AUTO_WINDOW = 8
PROBES = 16
RETUNE_STEPS = 200  # steps between two measurements of a running job
FIRST_RETUNE_STEPS = 16  # the first measurement: as soon as a median of lookups means something


@dataclass(frozen=True, slots=True)
class WindowChoice:
    """What ``auto`` measured and chose: the summary's ``window_choice``."""

    window: int
    round_trip_ms: float
    reason: str
    remeasured: list[dict[str, float]] = field(default_factory=list)  # WindowTuner's

    def as_dict(self) -> dict[str, object]:
        return {"window": self.window, "round_trip_ms": round(self.round_trip_ms, 4),
                "reason": self.reason, "remeasured": list(self.remeasured)}


def auto_window(round_trip_ms: float) -> int:
    """The smallest window that hides a round trip of ``round_trip_ms`` behind steps of at
    least :data:`STEP_FLOOR_MS` (1 where there is no round trip)."""
    if not round_trip_ms >= 0:
        raise ValueError(f"round_trip_ms must be >= 0, got {round_trip_ms!r}")
    if round_trip_ms < NO_ROUND_TRIP_MS:
        return 1
    return min(MAX_AUTO_WINDOW, 1 + math.ceil(round_trip_ms / STEP_FLOOR_MS))


def window_for(round_trip_ms: float, step_ms: float, *, most: int = MAX_AUTO_WINDOW) -> int:
    """The smallest window whose ``window - 1`` steps of ``step_ms`` compute hide a round trip
    of ``round_trip_ms`` (1 where there is none), at most ``most``."""
    if not round_trip_ms >= 0 or not step_ms > 0:
        raise ValueError(f"round_trip_ms must be >= 0 and step_ms > 0, got {round_trip_ms!r} "
                         f"and {step_ms!r}")
    if round_trip_ms < NO_ROUND_TRIP_MS:
        return 1
    return max(1, min(most, 1 + math.ceil(round_trip_ms / step_ms)))


class WindowTuner:
    """The window of a running job, measured again after its first :data:`FIRST_RETUNE_STEPS`
    steps, then every ``every`` steps (see the module
    doc): ``lookup_took`` gets each batch lookup's wall seconds, ``measure`` the compute
    thread's steps and wall seconds so far, and returns the window to use from now on when
    it changes. Each measurement is appended to ``choice.remeasured``."""

    def __init__(self, choice: WindowChoice, *, most: int = MAX_AUTO_WINDOW,
                 every: int | None = None) -> None:
        every = RETUNE_STEPS if every is None else every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        self.choice, self.most, self.every = choice, most, every
        self.window = choice.window
        self.round_trip_ms = choice.round_trip_ms
        self._trips: list[float] = []
        self._last = (0, 0.0)  # (steps, compute wall seconds) at the last measurement

    def lookup_took(self, seconds: float) -> None:
        self._trips.append(seconds * 1e3)

    def measure(self, steps: int, wall_s: float) -> int | None:
        """The new window after ``steps`` steps of ``wall_s`` compute (both since the job's
        start) where it is time to measure and the window changes, else None."""
        done, spent = steps - self._last[0], wall_s - self._last[1]
        due = self.every if self.choice.remeasured else min(FIRST_RETUNE_STEPS, self.every)
        if done < due or not self._trips or spent <= 0:
            return None
        self._last = (steps, wall_s)
        self.round_trip_ms = statistics.median(self._trips)
        self._trips.clear()
        step_ms = spent * 1e3 / done
        window = window_for(self.round_trip_ms, step_ms, most=self.most)
        entry: dict[str, Any] = {"step": steps, "round_trip_ms": round(self.round_trip_ms, 4),
                                 "step_ms": round(step_ms, 4), "window": window}
        self.choice.remeasured.append(entry)
        changed, self.window = window != self.window, window
        return window if changed else None


async def probe_round_trip_ms(rows: RowsClient, probes: int = PROBES) -> float:
    """The median wall time of ``probes`` small requests to the rows (their tables'
    description: one round trip to every shard)."""
    took = []
    for _ in range(probes):
        started = time.perf_counter()
        await rows.tables()
        took.append((time.perf_counter() - started) * 1e3)
    return statistics.median(took)


async def choose_window(rows: RowsClient) -> WindowChoice:
    """:func:`auto_window` of the measured round trip to ``rows``, with the reason; no round
    trip (window 1) for rows in this process (a :class:`DirectRows`, e.g. embedded shards)."""
    if isinstance(rows, DirectRows) and rows.direct:
        return WindowChoice(window=1, round_trip_ms=0.0,
                            reason="the shards are in this process: no round trip to hide")
    rtt = await probe_round_trip_ms(rows)
    window = auto_window(rtt)
    reason = ("the rows answer at once: no round trip to hide" if window == 1 else
              f"a {rtt:.2f} ms round trip hidden behind {window - 1} step(s) of compute")
    return WindowChoice(window=window, round_trip_ms=rtt, reason=reason)
