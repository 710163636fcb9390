"""Helpers of the loader integration tests: a worker that drains a rank, row extractors."""

from __future__ import annotations

import contextlib

import numpy as np

from clients.batch import Batch
from clients.loader_client import LoaderClient

MOCK_PARTITIONS = 4  # partitions of a topic the Kafka mock cluster creates on first use


async def drain(address: str, *, rank: int = 0, world_size: int = 1, credits: int = 4,
                limit: int | None = None, ack: bool = True) -> list[Batch]:
    """Read a rank's batches (until the end marker or ``limit``), acknowledging each."""
    out: list[Batch] = []
    async with LoaderClient(address, rank=rank, world_size=world_size, credits=credits,
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
