"""Prometheus metrics of a loader: counters updated as data flows, gauges read at scrape."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["LoaderMetrics", "RateMeter"]


class RateMeter:
    """Events per second over the last ``window`` seconds."""

    def __init__(self, window: float = 5.0) -> None:
        self.window = window
        self.total = 0
        self._samples: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])

    def add(self, n: int) -> None:
        self.total += n
        now = time.monotonic()
        self._samples.append((now, self.total))
        while len(self._samples) > 2 and now - self._samples[1][0] > self.window:
            self._samples.popleft()

    def rate(self) -> float:
        now = time.monotonic()
        t0, n0 = self._samples[0]
        return (self.total - n0) / max(now - t0, 1e-9) if self.total > n0 else 0.0


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self.read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self.read()
        rate = GaugeMetricFamily("persimmon_loader_records_per_second",
                                 "Records read per second (5 s window)")
        rate.add_metric([], state["records_per_second"])
        yield rate
        inflight = GaugeMetricFamily("persimmon_loader_batches_in_flight",
                                     "Batches sent to a rank and not yet acknowledged", labels=["rank"])
        for rank, n in state["in_flight"].items():
            inflight.add_metric([str(rank)], n)
        yield inflight
        lag = GaugeMetricFamily("persimmon_loader_lag",
                                "Records in the source not yet committed", labels=["partition"])
        for partition, info in state["offsets"].items():
            if info.get("lag") is not None:
                lag.add_metric([partition], float(info["lag"]))
        yield lag
        held = GaugeMetricFamily("persimmon_loader_shuffle_buffer_rows", "Rows held for shuffling")
        held.add_metric([], state["buffered_rows"])
        yield held


class LoaderMetrics:
    """A registry of its own per loader, so several loaders can live in one process."""

    def __init__(self, read_state: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(read_state))
        self.records = Counter("persimmon_loader_records", "Records parsed",
                               registry=self.registry)
        self.malformed = Counter("persimmon_loader_malformed_records", "Malformed records",
                                 ["reason"], registry=self.registry)
        self.batches = Counter("persimmon_loader_batches", "Batches produced",
                               registry=self.registry)
        self.acked = Counter("persimmon_loader_batches_acked", "Batches acknowledged",
                             registry=self.registry)
        self.sent_bytes = Counter("persimmon_loader_sent_bytes", "Batch bytes sent to workers",
                                  registry=self.registry)
