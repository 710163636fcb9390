"""Real PS shards on port 0 inside the test's event loop, a digest of their tables, and a
stream to one shard for requests built by hand."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator

import pytest

from clients._stream import MultiplexedStream
from services.common.rpc import open_channel
from services.ps.config import PSConfig
from services.ps.service import PSService
from services.ps.tables import OptimizerConfig, TableConfig


def table_configs() -> list[TableConfig]:
    return [
        TableConfig(name="user", dim=8, optimizer=OptimizerConfig(kind="adagrad", lr=0.1)),
        TableConfig(name="item", dim=4, optimizer=OptimizerConfig(kind="sgd", lr=0.5)),
    ]


async def start_cluster(num_shards: int, tmp_path=None, **kw) -> list[PSService]:
    services = []
    for k in range(num_shards):
        cfg = PSConfig(shard_id=k, num_shards=num_shards, grpc_port=0, admin_port=0,
                       tables=table_configs(),
                       checkpoint_dir=str(tmp_path / "ckpt") if tmp_path else None, **kw)
        service = PSService(cfg)
        await service.start()
        services.append(service)
    return services


@pytest.fixture
async def cluster(tmp_path) -> AsyncIterator[list[PSService]]:
    services = await start_cluster(2, tmp_path)
    yield services
    for s in services:
        await s.close()


@contextlib.asynccontextmanager
async def shard_stream(address: str, method: str) -> AsyncIterator[MultiplexedStream]:
    """A ``persimmon.PS`` stream of ``method`` to the shard at ``address``, apart from any
    client: requests built by hand (bad ones too) get their reply or in-band error."""
    channel = open_channel(address)
    stream = MultiplexedStream(channel, f"/persimmon.PS/{method}")
    try:
        yield stream
    finally:
        await stream.close()
        await channel.close()


def digest(services: list[PSService]) -> str:
    """A hash of every row, optimizer state and counter-free table content on every shard."""
    h = hashlib.sha256()
    for service in services:
        for name in sorted(service.shard.tables):
            table = service.shard.tables[name]
            rows, present = table.peek(_known_ids(table))
            h.update(name.encode())
            h.update(rows.tobytes())
            h.update(present.tobytes())
            h.update(str(table.num_rows).encode())
    return h.hexdigest()


def _known_ids(table):
    import numpy as np

    return np.arange(0, 2000, dtype=np.uint64)
