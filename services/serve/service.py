"""A prediction server process: versions, micro-batching, the REST and gRPC APIs and the
watcher.

``initial_rows`` is how an id never trained gets its row: the PS's deterministic initializer
(``services.ps.tables.initial_rows`` over the table config the version records). Serving
does not import the PS, so whoever starts the service injects it (the CLI does).

With ``ps`` set, versions may keep tables on the live PS shards (``persimmon export
--ps-tables``): their rows are read there with read-only lookups, from the batcher's thread
through a PS client on the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import grpc
import numpy as np
from threadpoolctl import threadpool_limits

from clients.ps_client import PSClient, unique_ids
from services.common.admin import AdminServer
from services.common.config import config_to_dict
from services.common.errors import FailedPrecondition
from services.common.lifecycle import ServingService
from services.common.rpc import make_server
from services.serve.admin import ServeMetrics, make_serve_admin
from services.serve.batching import MicroBatcher
from services.serve.config import ServeConfig
from services.serve.rows import InitialRows
from services.serve.server import ServeServicer
from services.serve.versions import VersionManager

__all__ = ["ServeService"]

log = logging.getLogger("persimmon.serve")


class ServeService(ServingService):
    """Start with ``await service.start()``; ``admin_port``/``grpc_port`` hold the bound
    ports."""

    config: ServeConfig

    def __init__(self, config: ServeConfig, *, initial_rows: InitialRows) -> None:
        super().__init__(config)
        self.metrics = ServeMetrics()
        self._ps: PSClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.versions = VersionManager(config.model_dir, initial_rows=initial_rows,
                                       verify=config.verify_checksums,
                                       on_swap=self.metrics.swapped,
                                       ps_lookup=self._ps_lookup if config.ps else None)
        self.batcher = MicroBatcher(self.versions.current,
                                    max_records=config.max_batch_records,
                                    max_wait_s=config.max_wait_ms / 1000.0,
                                    max_queued_records=config.max_queued_records,
                                    on_batch=self.metrics.batch)
        self._grpc: grpc.aio.Server | None = None
        self._blas: threadpool_limits | None = None

    @property
    def url(self) -> str:
        """The REST API's base URL."""
        return self.admin_url

    async def on_start(self) -> None:
        if self.config.forward_threads:  # process-wide: BLAS has one thread pool
            self._blas = threadpool_limits(self.config.forward_threads, user_api="blas")
        if self.config.ps:
            self._loop = asyncio.get_running_loop()
            self._ps = PSClient(self.config.ps.split(","))
            await self._ps.connect()
        await self.versions.refresh()
        if self.versions.active is None:
            log.warning("no loadable model version in %s yet; not ready until one appears",
                        self.config.model_dir)
        self.batcher.start()
        self._grpc, self.grpc_port = make_server(
            [ServeServicer(self.batcher, max_request_records=self.config.max_request_records
                           ).handlers()], self.config.host, self.config.grpc_port,
            max_message_bytes=self.config.max_message_bytes)
        await self._grpc.start()
        app = make_serve_admin(metrics=self.metrics, manager=self.versions,
                               batcher=self.batcher,
                               max_request_records=self.config.max_request_records,
                               config=lambda: config_to_dict(self.config))
        self._admin = AdminServer(app, self.config.host, self.config.admin_port)
        self.admin_port = await self._admin.start()
        self.spawn(self._watch(), "version-watcher")
        log.info("serving %s: REST on %s, gRPC on %s", self.config.model_dir, self.url,
                 self.address)

    async def on_close(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        if self._admin is not None:
            await self._admin.close()
        await self.batcher.close()
        self.versions.close()
        if self._ps is not None:
            await self._ps.close()
        if self._blas is not None:
            self._blas.restore_original_limits()

    def _ps_lookup(self, ids: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Read-only rows of several tables from the live PS in one read (a message per
        shard); called from worker threads, never the loop's."""
        if self._ps is None or self._loop is None:
            raise FailedPrecondition("the PS client is not connected")
        uniq = {t: unique_ids(i) for t, i in ids.items()}
        rows = asyncio.run_coroutine_threadsafe(self._ps.lookup_tables(
            {t: u for t, (u, _) in uniq.items()}, read_only=True), self._loop).result()
        return {t: rows[t][inverse] for t, (_, inverse) in uniq.items()}

    async def _watch(self) -> None:
        """Look for a newer complete version every ``watch_interval_s``."""
        while True:
            await asyncio.sleep(self.config.watch_interval_s)
            try:
                await self.versions.refresh()
            except Exception:  # a bad directory entry must not stop the watcher
                log.exception("looking for new model versions failed")
