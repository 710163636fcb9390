"""A prediction server process: versions, micro-batching, the REST API and the watcher.

``initial_rows`` is how an id never trained gets its row: the PS's deterministic initializer
(``services.ps.tables.initial_rows`` over the table config the version records). Serving
does not import the PS, so whoever starts the service injects it (the CLI does).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from services.common.admin import AdminServer
from services.common.config import config_to_dict
from services.common.lifecycle import AsyncService
from services.serve.admin import ServeMetrics, make_serve_admin
from services.serve.batching import MicroBatcher
from services.serve.config import ServeConfig
from services.serve.rows import InitialRows
from services.serve.versions import VersionManager

__all__ = ["ServeService"]

log = logging.getLogger("persimmon.serve")


class ServeService(AsyncService):
    """Start with ``await service.start()``; ``admin_port`` holds the bound port."""

    def __init__(self, config: ServeConfig, *, initial_rows: InitialRows) -> None:
        super().__init__()
        self.config = config
        self.admin_port = config.admin_port
        self.metrics = ServeMetrics()
        self.versions = VersionManager(config.model_dir, initial_rows=initial_rows,
                                       verify=config.verify_checksums,
                                       on_swap=self.metrics.swapped)
        self.batcher = MicroBatcher(self.versions.current,
                                    max_records=config.max_batch_records,
                                    max_wait_s=config.max_wait_ms / 1000.0,
                                    max_queued_records=config.max_queued_records,
                                    on_batch=self.metrics.batch)
        self._admin: AdminServer | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.admin_port}"

    async def on_start(self) -> None:
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        await self.versions.refresh()
        if self.versions.active is None:
            log.warning("no loadable model version in %s yet; not ready until one appears",
                        self.config.model_dir)
        self.batcher.start()
        app = make_serve_admin(self, config=lambda: config_to_dict(self.config))
        self._admin = AdminServer(app, self.config.host, self.config.admin_port)
        self.admin_port = await self._admin.start()
        self.spawn(self._watch(), "version-watcher")
        log.info("serving %s on %s", self.config.model_dir, self.url)

    async def on_close(self) -> None:
        if self._admin is not None:
            await self._admin.close()
        await self.batcher.close()

    async def _watch(self) -> None:
        """Look for a newer complete version every ``watch_interval_s``."""
        while True:
            await asyncio.sleep(self.config.watch_interval_s)
            try:
                await self.versions.refresh()
            except Exception:  # a bad directory entry must not stop the watcher
                log.exception("looking for new model versions failed")
