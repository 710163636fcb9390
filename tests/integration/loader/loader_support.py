"""Helpers of the loader integration tests: a worker that drains a rank, row extractors."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import numpy as np

from clients.loader_client import LoaderClient
from services.common.batch import Batch

MOCK_PARTITIONS = 4  # partitions of a topic the Kafka mock cluster creates on first use


async def drain(address: str, *, rank: int = 0, world_size: int = 1, credits: int = 4,
                limit: int | None = None, ack: bool = True, timeout: float = 60.0
                ) -> list[Batch]:
    """Read a rank's batches (until the end marker or ``limit``), acknowledging each; fail
    after ``timeout`` seconds."""
    out: list[Batch] = []
    async with asyncio.timeout(timeout), LoaderClient(
            address, rank=rank, world_size=world_size, credits=credits,
            reconnect_timeout_s=5) as client:
        stream = client.batches()
        with contextlib.suppress(StopAsyncIteration):
            while limit is None or len(out) < limit:
                batch = await anext(stream)
                out.append(batch)
                if ack:
                    await client.ack(batch)
        await stream.aclose()
    return out


def labels_of(batches: list[Batch]) -> np.ndarray:
    return np.concatenate([b.labels for b in batches]) if batches else np.zeros(0)


def ids_of(batches: list[Batch], name: str) -> list[int]:
    return [int(v) for b in batches for v in b.sparse[name].values]


async def consume_until(address: str, want: set[int], *, ack_first: int | None = None,
                        timeout: float = 30.0) -> tuple[list, set[int]]:
    """Batches until every row id in ``want`` was seen (acking at most ``ack_first``)."""
    batches, seen = [], set()
    async with LoaderClient(address, credits=4) as client:
        stream = client.batches()

        async def run():
            async for batch in stream:
                batches.append(batch)
                seen.update(int(v) for v in batch.dense[:, 0])
                if ack_first is None or len(batches) <= ack_first:
                    await client.ack(batch)
                if want <= seen or (ack_first is not None and len(batches) >= ack_first + 2):
                    return

        await asyncio.wait_for(run(), timeout)
        await stream.aclose()
    return batches, seen


async def until(predicate: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    """Poll an async predicate until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.05)
