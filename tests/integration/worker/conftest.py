"""What the worker's integration tests share: real PS shard services on port 0."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from services.ps.config import PSConfig
from services.ps.service import PSService
from services.ps.tables import TableConfig


@contextlib.asynccontextmanager
async def running_shards(tables: Sequence[TableConfig], count: int = 2, *,
                         created_after_start: bool = False) -> AsyncIterator[list[PSService]]:
    """``count`` PS shard services holding ``tables``, started; closed on leaving.
    ``created_after_start``: the tables are created once each shard is up, so its start loads
    no kernel for a request of all of them (tests/conftest.py's create_tables says why)."""
    services: list[PSService] = []
    try:
        for k in range(count):
            service = PSService(PSConfig(shard_id=k, num_shards=count, grpc_port=0,
                                         admin_port=0,
                                         tables=[] if created_after_start else list(tables)))
            await service.start()
            services.append(service)
            for table in tables if created_after_start else ():
                service.shard.create_table(table)
        yield services
    finally:
        for service in services:
            await service.close()
