"""The staleness window of one worker's embedding pipeline: slots and riders.

The bound on staleness is a semaphore of ``size`` slots: a batch takes one before its lookup
and the acknowledgement of its push frees it, so a lookup starts with at most ``size - 1``
earlier pushes unacknowledged (its *staleness*). Once every slot is taken the next batches
wait as *riders*: the push leaving next carries a rider's lookup in the same message per shard
(:meth:`Slots.carry`) and, once acknowledged, hands its slot straight to it with the rows it
brought back. A slot freed while a rider is still carried waits (spare) until none is, then
goes to the next rider (slot only: it came after the pushes had left) or back to the
semaphore: lookups start in batch order, so that a batch's lookup never starts before an
earlier batch's, whose push (not even computed) it would miss beyond the bound.

:meth:`Slots.resize` changes the number of slots as a run goes (``staleness auto``
re-measured): a larger window's new slots are free at once; a smaller one keeps the slots it
loses as a debt, paid by the next slots freed, so no lookup ever sees more earlier pushes
unacknowledged than the size it started under.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

import numpy as np

from services.common.errors import InvalidArgument
from services.worker.pooling import BatchPlan

__all__ = ["Rider", "Slots"]

Rows = list[np.ndarray]


@dataclass(slots=True)
class Rider:
    """A planned batch waiting for a slot: the push that frees one looks it up, or hands it
    the slot only (rows None); either way with its staleness."""

    plan: BatchPlan
    future: asyncio.Future[tuple[Rows | None, int]]


class Slots:
    """``size`` slots (None: unbounded, nothing waits) and the riders waiting for one."""

    def __init__(self, size: int | None) -> None:
        self.reset(size)

    def reset(self, size: int | None) -> None:
        """Every slot free, no rider (a run's start)."""
        self.size = size
        self._free = asyncio.Semaphore(size) if size is not None else None
        self._debt = 0  # slots a smaller window took away, not yet back
        self._riders: collections.deque[Rider] = collections.deque()
        self.unacked = 0  # batches whose lookup started and whose push is not acknowledged
        self._carried = 0  # riders whose lookup travels with a push not yet acknowledged
        self._spare = 0  # slots freed while a rider was carried: passed on once none is

    @property
    def full(self) -> bool:
        """Every slot is taken: the next batch rides."""
        return self._free is not None and self._free.locked()

    async def take(self) -> int:
        """Wait for a slot; the staleness of the lookup that starts now."""
        if self._free is not None:
            await self._free.acquire()
        self.unacked += 1
        return self.unacked - 1

    def wait_as_rider(self, plan: BatchPlan) -> Rider:
        rider = Rider(plan, asyncio.get_running_loop().create_future())
        self._riders.append(rider)
        return rider

    def carry(self) -> Rider | None:
        """The rider the push leaving now carries (None: none waits, or the slot it frees
        pays a smaller window's debt)."""
        if not self._riders or self._debt:
            return None
        self._carried += 1
        return self._riders.popleft()

    def acknowledged(self, rider: Rider | None, rows: Rows | None) -> None:
        """A push (which carried ``rider``, bringing back ``rows``) is done: its slot passes
        to that rider, else on (see the module doc)."""
        self.unacked -= 1
        if rider is not None:
            self._carried -= 1
            if not rider.future.done():
                rider.future.set_result((rows, self.unacked))
                self.unacked += 1
                self._pass_spare()
                return
        self._spare += 1
        self._pass_spare()

    async def resize(self, size: int) -> None:
        """``size`` slots from now on (see the module doc); not for an unbounded window."""
        if self.size is None or self._free is None:
            raise InvalidArgument("an unbounded window (async mode) has no slots to resize")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidArgument(f"a window must be an int >= 1, got {size!r}")
        grown = size - self.size
        self.size = size
        if grown < 0:
            self._debt -= grown
            while self._debt and not self._free.locked():  # free slots go first (at once)
                await self._free.acquire()
                self._debt -= 1
            return
        repaid = min(grown, self._debt)  # slots still owed are simply not taken back
        self._debt -= repaid
        self._spare += grown - repaid
        self._pass_spare()

    def _pass_spare(self) -> None:
        while self._spare and self._debt:  # a smaller window: freed slots pay its debt
            self._spare -= 1
            self._debt -= 1
        while self._spare and not self._carried:
            self._spare -= 1
            rider = self._riders.popleft() if self._riders else None
            if rider is not None and not rider.future.done():
                rider.future.set_result((None, self.unacked))
                self.unacked += 1
            elif self._free is not None:
                self._free.release()

    def forget_riders(self) -> None:
        self._riders.clear()
