"""The embedding pipeline's waits across the workers, each on a gloo group of its own.

Each collective runs in a thread (it blocks) on a process group of its own, so that it never
interleaves with the dense all-reduce or with another of these; with one rank there is none
(None).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from services.worker.distributed import every_rank_has_a_batch, several_ranks
from services.worker.embedding.head_vote import Ballot, vote

__all__ = ["global_barrier", "head_vote", "step_gate"]


def _own_group() -> Any:
    """A new gloo group of every rank, or None with one rank (every rank must call it, in the
    same order)."""
    return dist.new_group(backend="gloo") if several_ranks() else None


def global_barrier() -> Callable[[], Awaitable[None]] | None:
    """A wait for every rank (None with one rank)."""
    if (group := _own_group()) is None:
        return None

    async def barrier() -> None:
        await asyncio.to_thread(dist.barrier, group=group)
    return barrier


def step_gate() -> Callable[[bool], Awaitable[bool]] | None:
    """The bound across workers: a collective per step, True while every rank has a batch for
    it (None with one rank)."""
    if (group := _own_group()) is None:
        return None

    async def gate(has_batch: bool) -> bool:
        return await asyncio.to_thread(every_rank_has_a_batch, has_batch, group)
    return gate


def head_vote(workers: int) -> Callable[[Ballot], Awaitable[dict[int, np.ndarray]]] | None:
    """One head-id set for the job: the vote's two collectives (None with one rank)."""
    if (group := _own_group()) is None:
        return None

    def gather_now(obj: Any) -> list[Any]:
        out: list[Any] = [None] * workers
        dist.all_gather_object(out, obj, group=group)
        return out

    def add_now(counts: np.ndarray) -> np.ndarray:
        summed = torch.from_numpy(counts.copy())
        dist.all_reduce(summed, group=group)
        return summed.numpy()

    async def gather(obj: Any) -> list[Any]:
        return await asyncio.to_thread(gather_now, obj)

    async def add(counts: np.ndarray) -> np.ndarray:
        return await asyncio.to_thread(add_now, counts)

    async def elect(ballot: Ballot) -> dict[int, np.ndarray]:
        return await vote(ballot, workers, gather, add)
    return elect
