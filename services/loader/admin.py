"""Admin REST API of a loader (FastAPI): sources, offsets, workers, stats, pause/resume."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from services.common.admin import ErrorBody, make_admin_app
from services.common.config import config_to_dict
from services.loader.pipeline import Pipeline

__all__ = ["make_loader_admin"]


def make_loader_admin(pipeline: Pipeline, *, ready: Callable[[], bool],
                      lifespan: Any = None) -> FastAPI:
    app = make_admin_app(title="Persimmon loader", registry=pipeline.metrics.registry,
                         config=lambda: config_to_dict(pipeline.config), ready=ready,
                         lifespan=lifespan)

    @app.get("/v1/sources", tags=["sources"])
    async def sources() -> list[dict[str, Any]]:
        """The source this loader reads, its features and record counts."""
        return [{**pipeline.source.describe(),
                 "state": "paused" if pipeline.paused else
                          "exhausted" if pipeline.exhausted else "reading"}]

    @app.get("/v1/offsets", tags=["sources"])
    async def offsets() -> dict[str, dict[str, Any]]:
        """Per partition: committed and read positions and the lag where the source has one."""
        return pipeline.source.offsets()

    @app.post("/v1/cuts/{checkpoint_id}/commit", tags=["sources"],
              responses={400: ErrorBody, 404: ErrorBody, 412: ErrorBody})
    async def commit_cut(checkpoint_id: str) -> dict[str, int]:
        """Commit the source positions of a complete job cut (``--checkpoint-dir``)."""
        return await pipeline.commit_cut(checkpoint_id)

    @app.get("/v1/workers", tags=["workers"])
    async def workers() -> dict[str, Any]:
        """Per worker rank: ready and in-flight batches, credits, deliveries and acks."""
        return pipeline.dispatcher.stats()

    @app.get("/v1/stats", tags=["stats"])
    async def stats() -> dict[str, Any]:
        """Records, records/s, batches, malformed records by reason, buffer fill."""
        return pipeline.stats()

    @app.post("/v1/pause", tags=["control"])
    async def pause() -> dict[str, bool]:
        """Stop reading the source (batches already made are still delivered)."""
        pipeline.pause()
        return {"paused": True}

    @app.post("/v1/resume", tags=["control"])
    async def resume() -> dict[str, bool]:
        """Read the source again."""
        pipeline.resume()
        return {"paused": False}

    return app
