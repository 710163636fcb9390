"""A worker's live state and its admin REST API: health, Prometheus metrics, ``/v1/progress``,
``/v1/curves``, ``/v1/shards`` and the live page ``/dashboard``.

:class:`WorkerProgress` is what the Trainer updates every step (samples, throughput, loss,
staleness, held-out evaluations) and times its PS round trips into; :func:`make_worker_admin`
serves it. ``persimmon demo`` draws its progress bar from ``GET /v1/progress`` of rank 0 and
prints the URL of its ``/dashboard``: one static HTML file (``dashboard.html``, package data,
no library) that polls ``/v1/progress``, ``/v1/curves``, ``/v1/shards`` and ``/metrics``.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from importlib.resources import files
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, RedirectResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from services.common.admin import make_admin_app
from services.common.messages import StatsReply
from services.worker.summary import LossCurve

__all__ = ["WorkerProgress", "make_worker_admin"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0)
_STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)
EVALS_KEPT = 1000  # held-out evaluations /v1/curves serves (the latest)


class WorkerProgress:
    """Counters of one worker rank, mirrored into a Prometheus registry of its own."""

    def __init__(self, *, rank: int = 0, world_size: int = 1, loss_window: int = 50) -> None:
        self.rank = rank
        self.world_size = world_size
        self.step = 0
        self.samples = 0
        self.staleness = 0
        self.staleness_max = 0
        self.last_eval: dict[str, float] | None = None
        self.evals: deque[dict[str, float]] = deque(maxlen=EVALS_KEPT)
        self.staleness_counts: Tally[int] = Tally()  # steps per staleness seen
        self.loss_curve = LossCurve(points=256)
        self.state = "starting"
        self.window: dict[str, float] | None = None  # staleness auto's latest measurement
        self._losses: deque[float] = deque(maxlen=loss_window)
        self._started: float | None = None
        self.registry = r = CollectorRegistry()
        self._samples = Counter("persimmon_worker_samples", "samples trained on", registry=r)
        self._steps = Counter("persimmon_worker_steps", "training steps", registry=r)
        self._rate = Gauge("persimmon_worker_samples_per_second", "samples/s since the start",
                           registry=r)
        self._loss = Gauge("persimmon_worker_loss", "training loss (moving average)", registry=r)
        self._window = Gauge("persimmon_worker_window",
                             "staleness window (staleness auto: as last measured)", registry=r)
        self._round_trip = Gauge("persimmon_worker_round_trip_ms",
                                 "median wall ms of a batch's lookup, as last measured",
                                 registry=r)
        self._stale = Gauge("persimmon_worker_staleness",
                            "earlier pushes unacknowledged at the latest lookup", registry=r)
        self._auc = Gauge("persimmon_worker_eval_auc", "latest held-out AUC", registry=r)
        self._logloss = Gauge("persimmon_worker_eval_logloss", "latest held-out logloss",
                              registry=r)
        self.lookup_seconds = Histogram("persimmon_worker_lookup_seconds",
                                        "PS lookup of one batch (all tables)",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.push_seconds = Histogram("persimmon_worker_push_seconds",
                                      "PS push of one batch until acknowledged",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self._stale_steps = Histogram("persimmon_worker_step_staleness",
                                      "staleness of each step", buckets=_STALENESS_BUCKETS,
                                      registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, cpu seconds

    @property
    def samples_per_s(self) -> float:
        if self._started is None or self.samples == 0:
            return 0.0
        return self.samples / max(time.perf_counter() - self._started, 1e-9)

    @property
    def loss(self) -> float:
        return sum(self._losses) / len(self._losses) if self._losses else math.nan

    def training(self) -> None:
        """Training starts now (the clock of samples/s)."""
        self.state = "training"
        if self._started is None:
            self._started = time.perf_counter()

    def record_step(self, *, samples: int, loss: float, staleness: int) -> None:
        self.step += 1
        self.samples += samples
        self.staleness = staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self._losses.append(loss)
        self.staleness_counts[staleness] += 1
        self.loss_curve.add(self.step, loss)
        self._stale_steps.observe(staleness)
        self._samples.inc(samples)
        self._steps.inc()
        self._rate.set(self.samples_per_s)
        self._loss.set(self.loss)
        self._stale.set(staleness)

    def record_window(self, entry: dict[str, float]) -> None:
        """``staleness auto`` measured again: its step, round trip, step compute and window."""
        self.window = dict(entry)
        self._window.set(entry["window"])
        self._round_trip.set(entry["round_trip_ms"])

    def record_eval(self, entry: dict[str, float]) -> None:
        self.last_eval = dict(entry)
        self.evals.append(self.last_eval)
        self._auc.set(entry["auc"])
        self._logloss.set(entry["logloss"])

    def as_dict(self) -> dict[str, Any]:
        loss = self.loss
        return {"rank": self.rank, "world_size": self.world_size, "state": self.state,
                "step": self.step, "samples": self.samples,
                "samples_per_s": self.samples_per_s,
                "loss": None if math.isnan(loss) else loss,
                "staleness": self.staleness, "staleness_max": self.staleness_max,
                "window": self.window, "eval": self.last_eval}

    def curves(self) -> dict[str, Any]:
        """The loss curve (``[first step, mean loss]`` of spans of steps), the held-out
        evaluations and the steps per staleness value."""
        return {"step": self.step, "loss": [list(p) for p in self.loss_curve.points()],
                "evals": list(self.evals),
                "staleness": [[k, self.staleness_counts[k]]
                              for k in sorted(self.staleness_counts)]}


# the rows client's stats(): the PS client's or the in-process shards'
ShardStats = Callable[[], Awaitable[Sequence[StatsReply]]]


def make_worker_admin(progress: WorkerProgress, *, config: Callable[[], dict[str, Any]],
                      ready: Callable[[], bool], shards: ShardStats | None = None) -> FastAPI:
    """The worker's admin app; ``shards`` reads the PS shards' statistics (``/v1/shards``)."""
    app = make_admin_app(title="Persimmon worker", registry=progress.registry, config=config,
                         ready=ready)

    @app.get("/v1/progress", tags=["training"])
    async def get_progress() -> dict[str, Any]:
        """Step, samples, samples/s, loss (moving average), staleness and the latest eval."""
        return progress.as_dict()

    @app.get("/v1/curves", tags=["training"])
    async def get_curves() -> dict[str, Any]:
        """The loss curve, the held-out evaluations and the staleness histogram."""
        return progress.curves()

    @app.get("/v1/shards", tags=["training"])
    async def get_shards() -> dict[str, Any]:
        """Per PS shard, its tables summed: rows (in RAM and on disk), bytes, ids looked up,
        misses (ids that had no row) and their ratio, ids pushed, and the global staleness of
        its step-tagged lookups (the most pushes of any one worker they missed: mean, max);
        empty without a PS."""
        return {"shards": [_shard_summary(s) for s in await shards()] if shards else []}

    @app.get("/dashboard", tags=["training"], response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        """The live page of this worker (polls the JSON routes and /metrics)."""
        return HTMLResponse(_dashboard_html())

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard")

    return app


def _shard_summary(stats: StatsReply) -> dict[str, Any]:
    """One shard's Stats, its tables summed."""
    tables = stats.tables.values()
    total = {key: sum(getattr(t, key) for t in tables)
             for key in ("rows", "disk_rows", "bytes", "ids_looked_up", "misses", "ids_pushed")}
    looked, tagged = total["ids_looked_up"], sum(t.tagged_lookups for t in tables)
    return {"shard_id": stats.shard_id, "tables": len(tables), **total,
            "miss_ratio": total["misses"] / looked if looked else None,
            "global_staleness_mean": sum(t.global_staleness_mean * t.tagged_lookups
                                         for t in tables) / tagged if tagged else None,
            "global_staleness_max": max((t.global_staleness_max for t in tables), default=0)}


@functools.cache
def _dashboard_html() -> str:
    return (files("services.worker") / "dashboard.html").read_text(encoding="utf-8")
