"""The hot chain: the hot groups' rows under a window of their own (1: synchronous).

The hot tables, and the head ids of the windowed groups where the rows are remote
(:mod:`services.worker.embedding.heads`), are rows nearly every batch touches, which stale
updates hurt most: a batch gets them only once the push of the batch ``window`` before it is
acknowledged, in the same message where it can.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from services.common.errors import Unavailable
from services.common.lifecycle import settle
from services.worker.embedding.exchange import EmbeddingPath, StepTimers, lookup_groups
from services.worker.embedding.rows import RowsClient
from services.worker.pooling import BatchPlan

__all__ = ["HotChain"]

Rows = list[np.ndarray]  # per group of tables, aligned with its layout's ids

class HotChain:
    """The hot groups' rows (hot tables, and the head ids of the windowed groups where the
    rows are remote) under a window of ``window`` batches: a batch's lookup starts only
    once the push of the batch ``window`` before it is acknowledged; that push carries the
    lookup when the batch is planned already (one message per shard and group), else the
    batch looks up on its own after it. Window 1 is synchronous. With a ``barrier`` (a wait
    for every worker) each acknowledged push waits at it, and no lookup rides on a push: with
    window 1 every worker's push of batch t is applied before any worker's lookup of t + 1.
    Its requests go through ``rows`` (a lane of their own beside the bulk traffic's where there
    is one) as ``path`` sends them; ``timers`` get the seconds of its lookups."""

    def __init__(self, rows: RowsClient, path: EmbeddingPath, groups: list[int], window: int,
                 barrier: Callable[[], Awaitable[Any]] | None = None,
                 timers: StepTimers | None = None) -> None:
        self.rows, self.path, self.timers = rows, path, timers
        self.groups = groups
        self.window = window
        self.barrier = barrier
        self._waiting: collections.deque[tuple[BatchPlan, asyncio.Future[Rows]]] = \
            collections.deque()
        self._out = 0  # batches looked up whose push is not acknowledged yet

    def reset(self) -> None:
        """Forget the batches of a finished run."""
        for _, future in self._waiting:
            future.cancel()
        self._waiting.clear()
        self._out = 0

    def request(self, plan: BatchPlan) -> asyncio.Future[Rows]:
        """The future rows of ``plan``'s hot groups (batches must request in their order)."""
        future: asyncio.Future[Rows] = asyncio.get_running_loop().create_future()
        self._waiting.append((plan, future))
        self._advance()
        return future

    def _advance(self) -> None:
        while self._out < self.window and self._waiting:
            plan, future = self._waiting.popleft()
            self._out += 1
            task = asyncio.ensure_future(lookup_groups(self.path, self.rows, plan, self.groups,
                                                       self.timers))
            task.add_done_callback(functools.partial(settle, future))

    async def push(self, plan: BatchPlan, grads: Rows) -> None:
        """Push ``plan``'s hot gradients (``grads`` holds every group's); hand the next
        batch its rows, looked up in the same message."""
        path, rows = self.path, self.rows
        following = self._waiting.popleft() if self._waiting and not self.barrier else None
        try:
            if following is None:
                await asyncio.gather(*(path.push(rows, plan, i, grads[i])
                                       for i in self.groups))
            else:
                done = await asyncio.gather(*(path.push_then_lookup(
                    rows, plan, i, grads[i], following[0]) for i in self.groups))
                if not following[1].done():
                    following[1].set_result(list(done))
        except BaseException as exc:
            if following is not None and not following[1].done():
                following[1].set_exception(exc if isinstance(exc, Exception)
                                           else Unavailable("the push it rode on was cancelled"))
            raise
        if self.barrier is not None:
            await self.barrier()
        if following is None:
            self._out -= 1
            self._advance()
