"""A PS shard process: the gRPC server, the admin server and the TTL sweeper, owned together.

Its tables are bounded (:func:`services.ps.table_limits.bounded`); at start, before restoring
or recovering, it removes the staging directories a crash left in its checkpoint directory
(:func:`services.ps.retention.clean_temp`).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.common.admin import AdminServer
from services.common.checkpoints import latest_complete
from services.common.errors import ConfigError
from services.common.lifecycle import ServingService
from services.common.registry import Heartbeat, Member
from services.common.rpc import make_server
from services.ps.admin import make_ps_admin
from services.ps.config import PSConfig
from services.ps.metrics import PSMetrics
from services.ps.retention import clean_temp
from services.ps.server import PSServicer
from services.ps.shard import Shard
from services.ps.table_limits import bounded

__all__ = ["PSService"]

log = logging.getLogger("persimmon.ps")


class PSService(ServingService):
    """Start with ``await service.start()``; ``grpc_port``/``admin_port`` hold the bound ports."""

    def __init__(self, config: PSConfig) -> None:
        config = bounded(config)
        super().__init__(config)
        self.shard = Shard(config)
        self.metrics = PSMetrics(self.shard)
        self._ready = False
        self._grpc: grpc.aio.Server | None = None
        self._heartbeat: Heartbeat | None = None

    async def on_start(self) -> None:
        await asyncio.to_thread(self._tidy_checkpoints)
        restore = self.config.restore
        if restore == "job":  # the newest complete job checkpoint, if there is one yet
            if not self.config.checkpoint_dir:
                raise ConfigError("--restore job needs --checkpoint-dir")
            job = latest_complete(self.config.checkpoint_dir)
            restore = job["checkpoint_id"] if job else None
        wal = self.shard.wal
        if restore:  # exactly that state: a rollback (the log restarts from it)
            rows = await self.shard.restore(restore)
            log.info("restored checkpoint %s: %s", restore, rows)
        elif wal is not None and self.config.restore is None:  # back to the state at a crash
            counts = await self.shard.recover()
            log.info("recovered from the write-ahead log (checkpoint %s, then %s)", wal.base,
                     counts)
        elif wal is not None:  # --restore job before the job's first checkpoint: empty
            await asyncio.to_thread(self.shard.start_log)
        await asyncio.to_thread(self.shard.warm_up)
        servicer = PSServicer(self.shard, self.metrics)
        self._grpc, self.grpc_port = make_server(
            [servicer.handlers()], self.config.host, self.config.grpc_port,
            max_message_bytes=2 * self.config.max_message_bytes,
            max_streams_per_client=self.config.max_streams_per_client,
            max_streams_per_client_id=self.config.max_streams_per_client_id)
        await self._grpc.start()
        app = make_ps_admin(self.shard, self.metrics, ready=lambda: self._ready)
        self._admin = AdminServer(app, self.config.host, self.config.admin_port)
        self.admin_port = await self._admin.start()
        self.spawn(self._sweep_ttl(), "ttl-sweeper")
        if self.config.registry:
            member = Member(kind="ps", index=self.config.shard_id, count=self.config.num_shards,
                            address=self.address, admin_url=self.admin_url)
            self._heartbeat = await Heartbeat.join(self.config.registry, member,
                                                   self.config.heartbeat_ttl_s)
        self._ready = True
        log.info("PS shard %d/%d serving gRPC on %s, admin on %s", self.config.shard_id,
                 self.config.num_shards, self.address, self.admin_url)

    async def on_close(self) -> None:
        self._ready = False
        if self._heartbeat is not None:
            await self._heartbeat.close()
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        if self._admin is not None:
            await self._admin.close()
        await asyncio.to_thread(self.shard.close)

    def _tidy_checkpoints(self) -> None:
        """Remove what a crash left half-written in the checkpoint directory."""
        cfg = self.config
        if cfg.checkpoint_dir:
            clean_temp(cfg.checkpoint_dir, cfg.shard_id, cfg.num_shards)

    async def _sweep_ttl(self) -> None:
        while True:
            await asyncio.sleep(self.config.ttl_sweep_s)
            dropped = await asyncio.to_thread(self.shard.expire)
            if dropped:
                log.info("TTL sweep dropped %d rows", dropped)
