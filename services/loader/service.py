"""A loader process: the source, the pipeline, the gRPC server and the admin server, owned
together; start with ``await service.start()``, which binds and reports the ports."""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.common.admin import AdminServer
from services.common.checkpoints.positions import cut_positions
from services.common.errors import ConfigError
from services.common.lifecycle import ServingService
from services.common.registry import Heartbeat, Member
from services.common.rpc import make_server
from services.loader.admin import make_loader_admin
from services.loader.config import LoaderConfig
from services.loader.deadletter import DeadLetters
from services.loader.dispatch import Dispatcher
from services.loader.pipeline import Pipeline
from services.loader.server import LoaderServicer
from services.loader.sources import Rewindable, Source, make_source

__all__ = ["LoaderService"]

log = logging.getLogger("persimmon.loader")


class LoaderService(ServingService):
    """``source`` may be given (tests, embedded use); otherwise it comes from the config."""

    def __init__(self, config: LoaderConfig, source: Source | None = None) -> None:
        super().__init__(config)
        self.source = source or make_source(config)
        self.dispatcher = Dispatcher(config.prefetch_batches, config.world_size)
        self.pipeline = Pipeline(self.source, config, self.dispatcher,
                                 DeadLetters(config.dead_letter, config.dead_letter_max_bytes))
        self._grpc: grpc.aio.Server | None = None
        self._source_started = False
        self._heartbeat: Heartbeat | None = None

    def ready(self) -> bool:
        task = self._tasks.get("producer")
        return self._started and task is not None and not (
            task.done() and not task.cancelled() and task.exception() is not None)

    async def on_start(self) -> None:
        try:
            await self._bind()
        except BaseException:
            await self.on_close()
            raise
        self.spawn(self.pipeline.produce(), "producer")
        self.spawn(self.pipeline.commit_loop(), "committer")
        if self.config.registry:
            member = Member(kind="loader", index=self.config.replica, count=self.config.replicas,
                            address=self.address, admin_url=self.admin_url)
            self._heartbeat = await Heartbeat.join(self.config.registry, member)
        log.info("loader serving %s on gRPC %s, admin on %s", self.config.source, self.address,
                 self.admin_url)

    async def _bind(self) -> None:
        if self.config.checkpoint_dir:  # start at the newest complete job cut
            if not isinstance(self.source, Rewindable):
                raise ConfigError(f"--checkpoint-dir (job cuts) needs a Kafka source, not "
                                  f"{self.config.spec.kind.value}")
            positions = await asyncio.to_thread(cut_positions, self.config.checkpoint_dir)
            self.source.rewind(positions)
            log.info("starting at the newest job cut: %s", positions or "the job's start")
        await self.source.start()
        self._source_started = True
        servicer = LoaderServicer(self.pipeline)
        self._grpc, self.grpc_port = make_server(
            [servicer.handlers()], self.config.host, self.config.grpc_port,
            max_message_bytes=self.config.max_message_bytes,
            max_streams_per_client=self.config.max_streams_per_client,
            max_streams_per_client_id=self.config.max_streams_per_client_id)
        await self._grpc.start()
        self._admin = AdminServer(make_loader_admin(self.pipeline, ready=self.ready),
                                  self.config.host, self.config.admin_port)
        self.admin_port = await self._admin.start()

    async def on_close(self) -> None:
        if self._heartbeat is not None:
            await self._heartbeat.close()
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        if self._admin is not None:
            await self._admin.close()
        if self._source_started:
            try:
                await self.pipeline.commit_once()
            finally:
                await self.source.close()
