"""REST API of a prediction server (FastAPI): predict, versions, health and metrics.

- ``POST /v1/predict``: ``{"records": [{field: value}, ...]}`` (JSON objects with the
  training data's fields), ``{"lines": [...]}`` (delimited lines in the training files'
  layout) or ``{"ids": {feature: [[id, ...], ...]}, "dense": [[x, ...], ...]}`` (pre-hashed
  ids, dense inputs after the transform) → ``{"version", "step", "probabilities"}``.
- ``GET /v1/versions``: every complete version; ``POST /v1/versions/{id}/activate``: serve it
  and pin it (``latest``: follow the newest again).
- ``/healthz``, ``/readyz`` (a version is loaded), ``/metrics`` (latency histograms, the
  version served), ``/v1/config``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Path, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict

from services.common.admin import ErrorBody, make_admin_app
from services.common.errors import NotFound, PersimmonError
from services.serve.server import check_records, count_records

if TYPE_CHECKING:
    from services.serve.batching import MicroBatcher
    from services.serve.predictor import Predictor
    from services.serve.versions import VersionManager

__all__ = ["PredictReply", "PredictRequest", "ServeMetrics", "make_serve_admin"]

VersionId = Annotated[str, Path(min_length=1, max_length=128,
                                pattern=r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]*$")]
_ERRORS: dict[int | str, dict[str, Any]] = {400: ErrorBody, 404: ErrorBody, 412: ErrorBody,
                                            413: ErrorBody, 503: ErrorBody}
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class PredictRequest(BaseModel):
    """One of ``records``, ``lines`` or ``ids`` (with ``dense``); unknown keys are a 422."""

    model_config = ConfigDict(extra="forbid")

    records: list[Any] | None = None
    lines: list[Any] | None = None
    ids: dict[str, Any] | None = None
    dense: list[Any] | None = None

    def count(self) -> int:
        """The number of records the request holds (checked again once featurized)."""
        return count_records(records=self.records, lines=self.lines, ids=self.ids)


class PredictReply(BaseModel):
    """The probabilities of a request's records, all from one model version."""

    version: str
    step: int
    probabilities: list[float]


class ServeMetrics:
    """Prometheus metrics of one server (its own registry)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_seconds = Histogram(
            "persimmon_serve_request_seconds", "Latency of predict requests (queue + batch)",
            ["code"], buckets=_LATENCY_BUCKETS, registry=r)
        self.forward_seconds = Histogram(
            "persimmon_serve_forward_seconds", "Seconds of one micro-batch's forward pass",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_records = Histogram(
            "persimmon_serve_batch_records", "Records per micro-batch",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096), registry=r)
        self.records = Counter("persimmon_serve_records_total", "Records answered", registry=r)
        self.version = Gauge("persimmon_serve_version_info", "The model version served (1)",
                             ["version"], registry=r)
        self.step = Gauge("persimmon_serve_version_step", "Training step of the version served",
                          registry=r)
        self.swaps = Counter("persimmon_serve_swaps_total", "Version swaps", registry=r)
        self._served: str | None = None

    def batch(self, records: int, seconds: float) -> None:
        self.batch_records.observe(records)
        self.forward_seconds.observe(seconds)
        self.records.inc(records)

    def swapped(self, predictor: Predictor) -> None:
        if self._served is not None:
            self.version.remove(self._served)
        self._served = predictor.version_id
        self.version.labels(version=predictor.version_id).set(1)
        self.step.set(predictor.step)
        self.swaps.inc()


def make_serve_admin(*, metrics: ServeMetrics, manager: VersionManager, batcher: MicroBatcher,
                     max_request_records: int, config: Callable[[], dict[str, Any]]
                     ) -> FastAPI:
    app = make_admin_app(title="Persimmon prediction server", registry=metrics.registry,
                         config=config, ready=lambda: manager.active is not None)

    @app.post("/v1/predict", tags=["predict"], responses=_ERRORS, response_model=PredictReply)
    async def predict(body: PredictRequest) -> Response:
        """Probabilities of the records, with the version that computed all of them."""
        started = time.perf_counter()
        code = "200"
        try:
            records = body.count()
            check_records(records, max_request_records)
            answer = await batcher.submit(body.model_dump(exclude_none=True), records)
        except PersimmonError as exc:
            code = str(exc.http_status)
            raise
        finally:
            metrics.request_seconds.labels(code=code).observe(
                time.perf_counter() - started)
        # written here, not by FastAPI's encoder: it walks the floats in Python (the hot path)
        return Response(json.dumps({"version": answer.version_id, "step": answer.step,
                                    "probabilities": answer.probabilities.tolist()}),
                        media_type="application/json")

    @app.get("/v1/versions", tags=["versions"])
    async def versions() -> dict[str, Any]:
        """The complete versions in the model directory, oldest first, and the active one."""
        active = manager.active
        return {"active": active.describe() if active is not None else None,
                "pinned": manager.pinned,
                "versions": await manager.listing()}

    @app.post("/v1/versions/{version_id}/activate", tags=["versions"], responses=_ERRORS)
    async def activate(version_id: VersionId) -> dict[str, Any]:
        """Serve this version from now on and pin it (a rollback); ``latest`` unpins and
        follows the newest version again. A version that fails its checks is a 412."""
        predictor = await manager.activate(version_id)
        return {"active": predictor.describe(), "pinned": manager.pinned}

    @app.get("/v1/versions/active", tags=["versions"], responses=_ERRORS)
    async def active() -> dict[str, Any]:
        """The version answering now."""
        predictor = manager.active
        if predictor is None:
            raise NotFound("no model version is loaded yet")
        return predictor.describe()

    return app
