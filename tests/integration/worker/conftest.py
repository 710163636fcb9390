"""What the worker's integration tests share: real PS shard services on port 0."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from services.ps.config import PSConfig
from services.ps.service import PSService
from services.ps.tables import TableConfig


@contextlib.asynccontextmanager
async def running_shards(tables: Sequence[TableConfig], count: int = 2, *,
                         created_later: Sequence[TableConfig] = ()
                         ) -> AsyncIterator[list[PSService]]:
    """``count`` PS shard services holding ``tables``, started, then ``created_later`` (a
    shard's start loads the kernels of a request of all its tables of a dim: tests/conftest.py's
    LocalPS.create_tables says when to hold some back); closed on leaving."""
    services: list[PSService] = []
    try:
        for k in range(count):
            service = PSService(PSConfig(shard_id=k, num_shards=count, grpc_port=0,
                                         admin_port=0, tables=list(tables)))
            await service.start()
            services.append(service)
            for table in created_later:
                service.shard.create_table(table)
        yield services
    finally:
        for service in services:
            await service.close()
