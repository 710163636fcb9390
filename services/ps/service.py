"""A PS shard process: the gRPC server, the admin server and the TTL sweeper, owned together."""

from __future__ import annotations

import asyncio
import logging

from services.common.admin import AdminServer
from services.common.lifecycle import AsyncService
from services.common.rpc import make_server
from services.ps.admin import make_ps_admin
from services.ps.config import PSConfig
from services.ps.metrics import PSMetrics
from services.ps.server import PSServicer
from services.ps.shard import Shard

__all__ = ["PSService"]

log = logging.getLogger("persimmon.ps")


class PSService(AsyncService):
    """Start with ``await service.start()``; ``grpc_port``/``admin_port`` hold the bound ports."""

    def __init__(self, config: PSConfig) -> None:
        super().__init__()
        self.config = config
        self.shard = Shard(config)
        self.metrics = PSMetrics(self.shard)
        self.grpc_port = config.grpc_port
        self.admin_port = config.admin_port
        self._ready = False
        self._grpc = None
        self._admin: AdminServer | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.grpc_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.config.host}:{self.admin_port}"

    async def on_start(self) -> None:
        if self.config.restore:
            rows = await self.shard.restore(self.config.restore)
            log.info("restored checkpoint %s: %s", self.config.restore, rows)
        servicer = PSServicer(self.shard, self.metrics)
        self._grpc, self.grpc_port = make_server(
            [servicer.handlers()], self.config.host, self.config.grpc_port,
            max_message_bytes=2 * self.config.max_message_bytes)
        await self._grpc.start()
        app = make_ps_admin(self.shard, self.metrics, ready=lambda: self._ready)
        self._admin = AdminServer(app, self.config.host, self.config.admin_port)
        self.admin_port = await self._admin.start()
        self.spawn(self._sweep_ttl(), "ttl-sweeper")
        self._ready = True
        log.info("PS shard %d/%d serving gRPC on %s, admin on %s", self.config.shard_id,
                 self.config.num_shards, self.address, self.admin_url)

    async def on_close(self) -> None:
        self._ready = False
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        if self._admin is not None:
            await self._admin.close()

    async def _sweep_ttl(self) -> None:
        while True:
            await asyncio.sleep(self.config.ttl_sweep_s)
            dropped = await asyncio.to_thread(self.shard.expire)
            if dropped:
                log.info("TTL sweep dropped %d rows", dropped)
