"""The one retry policy (services/common/retry.py), on a fake clock and a fake sleep."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.common.errors import ConfigError, InvalidArgument, Unavailable
from services.common.retry import RetryPolicy, retry


class FakeTime:
    """A clock that only the fake sleep moves; records every delay slept."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        assert delay >= 0
        self.slept.append(delay)
        self.now += delay


class Failing:
    """An attempt that fails ``times`` times with ``error``, then returns "ok"; each attempt
    takes ``cost`` seconds of the fake clock."""

    def __init__(self, fake: FakeTime, times: int, error: type[Exception] = Unavailable,
                 cost: float = 0.0) -> None:
        self.fake, self.times, self.error, self.cost = fake, times, error, cost
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        self.fake.now += self.cost
        if self.calls <= self.times:
            raise self.error(f"attempt {self.calls} failed")
        return "ok"


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def test_delays_stay_within_the_jittered_bounds_and_their_bound_grows() -> None:
    fake, rng = FakeTime(), random.Random(7)
    policy = RetryPolicy(deadline_s=None, first_delay_s=0.05, max_delay_s=1.0)
    attempt = Failing(fake, times=40)
    assert run(retry(attempt, policy, sleep=fake.sleep, clock=fake.clock,
                     jitter=rng.random)) == "ok"
    assert len(fake.slept) == 40
    bounds = [min(1.0, 0.05 * 2 ** n) for n in range(40)]
    assert all(0 <= d < b for d, b in zip(fake.slept, bounds, strict=True))
    assert [policy.bound(n + 1) for n in range(40)] == bounds
    # full jitter: the delays spread over the whole range, not pinned to the bound
    capped = fake.slept[10:]
    assert min(capped) < 0.3 and max(capped) > 0.7


def test_with_the_largest_jitter_every_delay_grows_until_the_cap() -> None:
    fake = FakeTime()
    policy = RetryPolicy(deadline_s=None, first_delay_s=0.1, max_delay_s=1.0, multiplier=3)
    run(retry(Failing(fake, times=5), policy, sleep=fake.sleep, clock=fake.clock,
              jitter=lambda: 1.0))
    assert fake.slept == pytest.approx([0.1, 0.3, 0.9, 1.0, 1.0])


@pytest.mark.parametrize("cost", [0.0, 0.13])
def test_the_deadline_is_never_overrun(cost: float) -> None:
    fake = FakeTime()
    policy = RetryPolicy(deadline_s=2.0, first_delay_s=0.05, max_delay_s=1.0)
    attempt = Failing(fake, times=10_000, cost=cost)
    start = fake.now
    with pytest.raises(Unavailable) as info:
        run(retry(attempt, policy, sleep=fake.sleep, clock=fake.clock, jitter=lambda: 0.999))
    # no sleep ends past the deadline; the last attempt starts at it at the latest
    ends, t = [], start
    for i, d in enumerate(fake.slept):
        t += cost + d
        ends.append(t)
        assert t <= start + 2.0 + 1e-9, f"sleep {i} ends at {t - start:.3f} s"
    assert attempt.calls == len(fake.slept) + 1
    assert fake.now - start <= 2.0 + cost + 1e-9  # only the last attempt's own time past it
    assert "gave up after" in "".join(info.value.__notes__)


def test_a_non_retryable_error_passes_through_at_once_without_sleeping() -> None:
    fake = FakeTime()
    attempt = Failing(fake, times=3, error=InvalidArgument)
    with pytest.raises(InvalidArgument, match="attempt 1 failed"):
        run(retry(attempt, RetryPolicy(deadline_s=60.0), sleep=fake.sleep, clock=fake.clock,
                  retryable=lambda e: isinstance(e, Unavailable)))
    assert attempt.calls == 1 and fake.slept == []


def test_the_last_error_is_raised_with_a_note_naming_the_operation() -> None:
    fake = FakeTime()
    attempt = Failing(fake, times=100)
    with pytest.raises(Unavailable) as info:
        run(retry(attempt, RetryPolicy(deadline_s=1.0, first_delay_s=0.5, max_delay_s=0.5),
                  what="lookup on shard 2", sleep=fake.sleep, clock=fake.clock,
                  jitter=lambda: 0.999))
    assert info.value.message == f"attempt {attempt.calls} failed"  # the last, not the first
    note = "".join(info.value.__notes__)
    assert note.startswith("lookup on shard 2: gave up after 4 attempt(s)")  # 0.4995 + 0.4995 + 0.001 slept
    assert "retry deadline 1 s" in note


def test_deadline_zero_never_retries_and_success_needs_no_sleep() -> None:
    fake = FakeTime()
    attempt = Failing(fake, times=1)
    with pytest.raises(Unavailable):
        run(retry(attempt, RetryPolicy(), sleep=fake.sleep, clock=fake.clock))
    assert attempt.calls == 1 and fake.slept == []
    assert run(retry(Failing(fake, times=0), RetryPolicy(), sleep=fake.sleep,
                     clock=fake.clock)) == "ok"
    assert fake.slept == []


def test_a_streak_counts_its_own_failures() -> None:
    fake = FakeTime()
    policy = RetryPolicy(deadline_s=None, first_delay_s=0.1, max_delay_s=10.0)
    first = policy.begin(sleep=fake.sleep, clock=fake.clock, jitter=lambda: 1.0)
    run(first.wait(Unavailable("a")))
    run(first.wait(Unavailable("b")))
    second = policy.begin(sleep=fake.sleep, clock=fake.clock, jitter=lambda: 1.0)
    run(second.wait(Unavailable("c")))
    assert fake.slept == pytest.approx([0.1, 0.2, 0.1])


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"deadline_s": -1.0}, "deadline_s"),
    ({"deadline_s": float("nan")}, "deadline_s"),
    ({"first_delay_s": 0.0}, "first_delay_s"),
    ({"first_delay_s": 2.0, "max_delay_s": 1.0}, "max_delay_s"),
    ({"multiplier": 0.5}, "multiplier"),
])
def test_a_bad_policy_is_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        RetryPolicy(**kwargs)
