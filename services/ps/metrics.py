"""Prometheus metrics of a PS shard: table gauges read at scrape time (with the staleness of
the tagged lookups, :mod:`services.ps.staleness`), request histograms."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from services.ps.shard import Shard

__all__ = ["PSMetrics"]

_GAUGES = {"rows": "Rows stored", "capacity": "Row slots allocated",
           "bytes": "Bytes held by rows, optimizer state and the hash table",
           "miss_ratio": "Share of looked-up ids that had no row yet"}
_COUNTERS = {"lookups": "Lookup requests", "pushes": "Push requests",
             "ids_looked_up": "Ids looked up", "misses": "Rows created on first sight",
             "evictions": "Rows evicted by capacity", "expired": "Rows dropped by TTL",
             "dropped_nonfinite": "Gradients dropped for NaN/Inf",
             "refused_nonfinite": "Row updates refused: the row or its optimizer state "
                                  "would have become NaN/Inf",
             "not_admitted": "Ids not (yet) admitted"}
_STALENESS = {  # services.ps.staleness
    "global_staleness_max": "Most earlier pushes of any one worker a tagged lookup missed",
    "global_staleness_mean": "Mean of the most earlier pushes of any one worker a tagged "
                             "lookup missed",
    "own_staleness_max": "Most earlier pushes of its own worker a tagged lookup missed",
    "own_staleness_mean": "Mean earlier pushes of its own worker a tagged lookup missed",
    "total_staleness_max": "Most earlier pushes, of every worker summed, a tagged lookup missed",
    "total_staleness_mean": "Mean earlier pushes, of every worker summed, a tagged lookup "
                            "missed"}


class _TableCollector(Collector):
    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.shard.stats().tables
        for key, doc in _GAUGES.items():
            fam = GaugeMetricFamily(f"persimmon_ps_table_{key}", doc, labels=["table"])
            for name, s in stats.items():
                if key == "miss_ratio":
                    value = s.misses / s.ids_looked_up if s.ids_looked_up else 0.0
                else:
                    value = getattr(s, key)
                fam.add_metric([name], float(value))
            yield fam
        for key, doc in _COUNTERS.items():
            counter = CounterMetricFamily(f"persimmon_ps_table_{key}", doc, labels=["table"])
            for name, s in stats.items():
                counter.add_metric([name], float(getattr(s, key)))
            yield counter
        for key, doc in _STALENESS.items():
            fam = GaugeMetricFamily(f"persimmon_ps_table_{key}", doc, labels=["table"])
            for name, s in stats.items():
                fam.add_metric([name], float(getattr(s, key)))
            yield fam


class PSMetrics:
    """A registry of its own per shard, so several shards can live in one test process."""

    def __init__(self, shard: Shard) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_TableCollector(shard))
        self.latency = Histogram(
            "persimmon_ps_request_seconds", "Time to serve one request", ["method"],
            registry=self.registry,
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
        self.errors = Counter("persimmon_ps_request_errors", "Requests rejected",
                              ["method", "code"], registry=self.registry)
        self.wire_bytes = Counter("persimmon_ps_wire_bytes", "Bytes received and sent",
                                  ["method", "direction"], registry=self.registry)
