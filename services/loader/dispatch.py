"""Handing batches to worker ranks with credit-based flow control.

Batch ``b`` belongs to rank ``b % world_size``. Each rank has a *ready* queue of at most
``prefetch`` encoded batches (the producer waits when it is full: back-pressure reaches the
source) and an *unacked* set. A connected worker grants ``credits``: the loader never has more
than that many batches sent to it and not yet acknowledged. When a rank reconnects, its
unacknowledged batches go back to the front of its queue and are sent again, in order; the
previous stream of that rank ends. When the source is exhausted and a rank's batches are all
acknowledged, its stream gets an end marker.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.common.errors import FailedPrecondition, InvalidArgument, PersimmonError

__all__ = ["Dispatcher", "Outgoing"]

MAX_CREDITS = 4096


@dataclass(slots=True, eq=False)
class Outgoing:
    """One encoded batch with the chunk rows it carries (settled when it is acked)."""

    batch_id: int
    payload: bytes
    size: int
    chunk_ids: np.ndarray
    counts: np.ndarray
    deliveries: int = 0


@dataclass(slots=True)
class _Rank:
    ready: deque[Outgoing] = field(default_factory=deque)
    unacked: dict[int, Outgoing] = field(default_factory=dict)
    credits: int = 0
    generation: int = 0
    connected: bool = False
    delivered: int = 0
    acked: int = 0
    redelivered: int = 0


class Dispatcher:
    """Per-rank queues; all state changes happen on the event loop under one condition."""

    def __init__(self, prefetch: int, world_size: int = 0) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.prefetch = prefetch
        self.world_size = world_size
        self._ranks: dict[int, _Rank] = {}
        self._cond = asyncio.Condition()
        self._world_known = asyncio.Event()
        if world_size:
            self._world_known.set()
        self._finished = False
        self._error: PersimmonError | None = None

    def _rank(self, rank: int) -> _Rank:
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = _Rank()
        return state

    @property
    def finished(self) -> bool:
        return self._finished

    # ---- producer side ----------------------------------------------------------------------

    async def put(self, item: Outgoing) -> None:
        """Queue ``item`` for its rank; waits for the world size and for queue room."""
        await self._world_known.wait()
        async with self._cond:
            state = self._rank(item.batch_id % self.world_size)
            await self._cond.wait_for(lambda: len(state.ready) < self.prefetch)
            state.ready.append(item)
            self._cond.notify_all()

    async def finish(self) -> None:
        """No more batches will come; streams end once their batches are acknowledged."""
        async with self._cond:
            self._finished = True
            self._cond.notify_all()

    async def fail(self, error: PersimmonError) -> None:
        """The producer died: every stream, now and later, ends with ``error``."""
        async with self._cond:
            self._error = error
            self._cond.notify_all()

    # ---- worker side ------------------------------------------------------------------------

    async def connect(self, rank: Any, world_size: Any, credits: Any) -> int:
        """Register a stream of ``rank``; returns its generation. Raises on bad arguments."""
        for name, value in (("rank", rank), ("world_size", world_size), ("credits", credits)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgument(f"{name} must be an integer, got {value!r}")
        if world_size < 1:
            raise InvalidArgument(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise InvalidArgument(f"rank must be in [0, {world_size}), got {rank}")
        if not 1 <= credits <= MAX_CREDITS:
            raise InvalidArgument(f"credits must be in [1, {MAX_CREDITS}], got {credits}")
        if self.world_size and world_size != self.world_size:
            raise FailedPrecondition(f"this loader serves world_size {self.world_size}, "
                                     f"a worker asked for {world_size}")
        async with self._cond:
            if not self.world_size:
                self.world_size = world_size
                self._world_known.set()
            state = self._rank(rank)
            state.generation += 1
            if state.unacked:
                again = sorted(state.unacked.values(), key=lambda o: o.batch_id)
                state.ready.extendleft(reversed(again))
                state.redelivered += len(again)
                state.unacked.clear()
            state.credits = credits
            state.connected = True
            self._cond.notify_all()
            return state.generation

    async def stream(self, rank: int, generation: int) -> AsyncIterator[Outgoing | None]:
        """Batches for ``rank`` within its credits; ``None`` is the end marker. Raises the
        producer's error if it failed."""
        state = self._rank(rank)
        try:
            while True:
                async with self._cond:
                    item = await self._next(state, generation)
                    if item is False:
                        return
                yield item  # type: ignore[misc]
                if item is None:
                    return
        finally:
            if state.generation == generation:
                state.connected = False

    async def _next(self, state: _Rank, generation: int) -> Outgoing | None | bool:
        while True:
            if self._error is not None:
                raise self._error
            if state.generation != generation:
                return False  # superseded by a newer stream of this rank
            if state.ready and len(state.unacked) < state.credits:
                item = state.ready.popleft()
                state.unacked[item.batch_id] = item
                item.deliveries += 1
                state.delivered += 1
                self._cond.notify_all()
                return item
            if self._finished and not state.ready and not state.unacked:
                return None
            await self._cond.wait()

    async def ack(self, batch_ids: list[int]) -> tuple[list[Outgoing], list[int]]:
        """Acknowledge batches; returns those newly acknowledged and the unknown ids."""
        acked: list[Outgoing] = []
        unknown: list[int] = []
        async with self._cond:
            for bid in batch_ids:
                state = self._ranks.get(bid % self.world_size) if self.world_size else None
                item = state.unacked.pop(bid, None) if state else None
                if item is None and state is not None:  # acked after a reconnect re-queued it
                    item = next((o for o in state.ready if o.batch_id == bid), None)
                    if item is not None:
                        state.ready.remove(item)
                if item is None or state is None:
                    unknown.append(bid)
                    continue
                state.acked += 1
                acked.append(item)
            self._cond.notify_all()
        return acked, unknown

    # ---- reporting --------------------------------------------------------------------------

    def in_flight(self) -> dict[int, int]:
        return {r: len(s.unacked) for r, s in sorted(self._ranks.items())}

    def stats(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "finished": self._finished,
                "ranks": {str(r): {"ready": len(s.ready), "in_flight": len(s.unacked),
                                   "credits": s.credits, "connected": s.connected,
                                   "delivered": s.delivered, "acked": s.acked,
                                   "redelivered": s.redelivered}
                          for r, s in sorted(self._ranks.items())}}
