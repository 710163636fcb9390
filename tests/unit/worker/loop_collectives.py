"""What the trainer's gloo collectives do, for W workers that are tasks of one event loop:
round k of each is complete once every worker made its k-th call (an ``asyncio.Barrier``)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from services.worker.embedding.head_vote import Ballot, vote


class LoopCollectives:
    """The step gate's all-reduce (every worker has a batch?) and the head-id vote's gather
    and sum, for ``n`` workers."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = asyncio.Barrier(n)
        self.rounds: dict[int, dict[int, Any]] = collections.defaultdict(dict)
        self.calls = [0] * n

    async def _round(self, worker: int, value: Any) -> dict[int, Any]:
        k = self.calls[worker]
        self.calls[worker] += 1
        self.rounds[k][worker] = value
        await self.barrier.wait()
        return self.rounds[k]

    def step_gate(self, worker: int) -> Callable[[bool], Awaitable[bool]]:
        async def gate(has_batch: bool) -> bool:
            return all((await self._round(worker, has_batch)).values())
        return gate

    def head_vote(self, worker: int) -> Callable[[Ballot], Awaitable[dict[int, np.ndarray]]]:
        async def gather(obj: Any) -> list[Any]:
            got = await self._round(worker, obj)
            return [got[v] for v in range(self.n)]

        async def add(counts: np.ndarray) -> np.ndarray:
            return sum((await self._round(worker, counts)).values())

        async def head_vote(ballot: Ballot) -> dict[int, np.ndarray]:
            return await vote(ballot, self.n, gather, add)
        return head_vote
