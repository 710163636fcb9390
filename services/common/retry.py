"""Persimmon's one retry policy: exponential backoff with full jitter under a deadline.

Every retry loop of the project waits through this module. A :class:`RetryPolicy` is the
caller's config (the deadline is the caller's own ``retry_s``-like setting); ``begin()``
starts one streak of failures, and :meth:`Retrying.wait` is called with each failure: it
raises that error at once when the predicate says it is not retryable or the deadline has
passed, else sleeps a jittered delay (never past the deadline) and returns, so the caller
tries again. :func:`retry` wraps the common case, one awaitable tried until it succeeds::

    policy = RetryPolicy(deadline_s=config.retry_s)
    reply = await retry(lambda: stub.call(request), policy, retryable=is_unavailable)

The n-th delay (n = 0, 1, …) is uniform in ``[0, min(max_delay_s, first_delay_s * 2**n))``
("full jitter"): clients that failed together do not retry together.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from services.common.errors import ConfigError

__all__ = ["RetryPolicy", "Retrying", "retry", "retry_any"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Sleep = Callable[[float], Awaitable[object]]


def retry_any(exc: BaseException) -> bool:
    """The default predicate: every error the caller hands over is retryable."""
    return True


@dataclass(kw_only=True, slots=True, frozen=True)
class RetryPolicy:
    """How long and how often to retry.

    ``deadline_s``: seconds from :meth:`begin` after which a failure is final (0: never
    retry; None: retry forever). ``first_delay_s``/``max_delay_s``: the bound of the first
    delay and the cap of every one; the bound doubles after each failure (``multiplier``).
    """

    deadline_s: float | None = 0.0
    first_delay_s: float = 0.05
    max_delay_s: float = 1.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.deadline_s is not None and not self.deadline_s >= 0:
            raise ConfigError(f"retry deadline_s must be >= 0 or None, got {self.deadline_s}")
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ConfigError("retry delays need 0 < first_delay_s <= max_delay_s, got "
                              f"first_delay_s={self.first_delay_s}, "
                              f"max_delay_s={self.max_delay_s}")
        if not self.multiplier >= 1:
            raise ConfigError(f"retry multiplier must be >= 1, got {self.multiplier}")

    def bound(self, failures: int) -> float:
        """The upper bound of the delay after the ``failures``-th failure (1-based)."""
        exponent = min(failures - 1, 64)  # past the cap long before; keeps the float finite
        return min(self.max_delay_s, self.first_delay_s * self.multiplier ** exponent)

    def begin(self, *, retryable: Callable[[BaseException], bool] = retry_any,
              what: str = "", sleep: Sleep = asyncio.sleep,
              clock: Callable[[], float] = time.monotonic,
              jitter: Callable[[], float] = random.random,
              started: float | None = None) -> Retrying:
        """Start a streak of attempts; its deadline is ``deadline_s`` after ``started`` (a
        ``clock()`` reading; default now: a hot path may begin at its first failure and
        still count from its first attempt).

        ``what`` names the operation in logs and in the note added to a final error;
        ``sleep``, ``clock`` and ``jitter`` (a fraction in [0, 1)) are injectable for tests."""
        return Retrying(self, retryable=retryable, what=what, sleep=sleep, clock=clock,
                        jitter=jitter, started=clock() if started is None else started)


@dataclass(slots=True)
class Retrying:
    """One streak of attempts under a :class:`RetryPolicy` (made by ``policy.begin()``)."""

    policy: RetryPolicy
    retryable: Callable[[BaseException], bool] = retry_any
    what: str = ""
    sleep: Sleep = asyncio.sleep
    clock: Callable[[], float] = time.monotonic
    jitter: Callable[[], float] = random.random
    started: float = 0.0  # the clock() reading the deadline counts from
    failures: int = 0

    @property
    def deadline(self) -> float | None:
        """The clock time after which no attempt starts (None: none)."""
        d = self.policy.deadline_s
        return None if d is None else self.started + d

    async def wait(self, exc: BaseException) -> float:
        """Count the failure ``exc``; raise it when it is final, else sleep and return the
        delay slept (logged as a warning when ``what`` names the operation). A final error
        carries a note saying why the retries stopped."""
        self.failures += 1
        if not self.retryable(exc):
            raise exc
        delay = self.policy.bound(self.failures) * self.jitter()
        deadline = self.deadline
        if deadline is not None:
            left = deadline - self.clock()
            if left <= 0:
                self._give_up(exc)
            delay = min(delay, left)
        if self.what:
            log.warning("%s failed (%s); retry %d in %.2f s", self.what, exc, self.failures,
                        delay)
        await self.sleep(delay)
        return delay

    def _give_up(self, exc: BaseException) -> None:
        elapsed = self.clock() - self.started
        what = f"{self.what}: " if self.what else ""
        exc.add_note(f"{what}gave up after {self.failures} attempt(s) in {elapsed:.2f} s "
                     f"(retry deadline {self.policy.deadline_s:g} s)")
        raise exc


async def retry(attempt: Callable[[], Awaitable[T]], policy: RetryPolicy, *,
                retryable: Callable[[BaseException], bool] = retry_any,
                what: str = "", sleep: Sleep = asyncio.sleep,
                clock: Callable[[], float] = time.monotonic,
                jitter: Callable[[], float] = random.random) -> T:
    """Await ``attempt()`` until it succeeds, retrying the ``Exception``s ``retryable``
    accepts under ``policy``; the last failure is raised with a note."""
    retrying = policy.begin(retryable=retryable, what=what, sleep=sleep, clock=clock,
                            jitter=jitter)
    while True:
        try:
            return await attempt()
        except Exception as exc:
            await retrying.wait(exc)
