"""Per-stream codecs and byte accounting.

A *stream* is one kind of traffic (``rows_down``, ``grads_up``, ``activations``,
``dense_allreduce``, …). Each stream has its own codec instance (so error-feedback state
never mixes between streams), chosen by a :class:`CodecSpec` in the config. Bytes sent and
received are counted per (stream, codec, direction) in :class:`WireStats`; services turn
:meth:`WireStats.rows` into Prometheus metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.common.codecs.array import WireArray
from services.common.codecs.base import Codec, CodecStats
from services.common.codecs.registry import decode_array, get_codec
from services.common.errors import ConfigError, InvalidArgument

__all__ = ["CodecSpec", "StreamCodecs", "WireStats", "WireStatsCollector"]

SENT = "sent"
RECEIVED = "received"


@dataclass(kw_only=True, slots=True)
class CodecSpec:
    """A codec choice: a registry name (``"dct"``, ``"fp16+zstd"``) and its parameters."""

    name: str = "none"
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"codec name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.params, dict):
            raise ConfigError(f"codec params must be a mapping, got {self.params!r}")
        self.build()  # validates name and parameters once, at config time

    def build(self) -> Codec:
        """A fresh codec instance (its own state and counters)."""
        try:
            return get_codec(self.name, **self.params)
        except ConfigError:
            raise
        except InvalidArgument as exc:
            raise ConfigError(exc.message) from exc

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | CodecSpec) -> CodecSpec:
        """From ``"fp16+zstd"``, ``{"name": "dct", "keep": 0.01}`` or ``{"name", "params"}``."""
        if isinstance(value, CodecSpec):
            return value
        if isinstance(value, str):
            return cls(name=value)
        if isinstance(value, Mapping):
            body = dict(value)
            name = body.pop("name", None)
            params = body.pop("params", None)
            if params is not None and body:
                raise ConfigError(f"codec spec mixes 'params' with top-level keys {sorted(body)}")
            return cls(name=name, params=dict(params if params is not None else body))
        raise ConfigError(f"a codec spec is a name or a mapping, got {value!r}")


class WireStats:
    """Raw and wire bytes per (stream, codec, direction)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, str], CodecStats] = {}

    def add(self, stream: str, codec: str, direction: str, raw: int, wire: int) -> None:
        if direction not in (SENT, RECEIVED):
            raise ValueError(f"direction must be {SENT!r} or {RECEIVED!r}, got {direction!r}")
        key = (stream, codec, direction)
        stats = self._counts.get(key)
        if stats is None:
            stats = self._counts[key] = CodecStats()
        stats.add(raw, wire)

    def get(self, stream: str, codec: str, direction: str) -> CodecStats:
        return self._counts.get((stream, codec, direction), CodecStats())

    @classmethod
    def merged(cls, *parts: WireStats) -> WireStats:
        """The counts of ``parts`` added up (one client's traffic over several lanes)."""
        out = cls()
        for part in parts:
            for key, stats in part._counts.items():
                total = out._counts.setdefault(key, CodecStats())
                total.raw_bytes += stats.raw_bytes
                total.wire_bytes += stats.wire_bytes
                total.arrays += stats.arrays
        return out

    def rows(self) -> list[dict[str, Any]]:
        """One flat record per (stream, codec, direction), sorted: ready for metric labels."""
        return [{"stream": s, "codec": c, "direction": d, **st.as_dict()}
                for (s, c, d), st in sorted(self._counts.items())]

    def as_dict(self) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
        """``{stream: {codec: {direction: {raw_bytes, wire_bytes, arrays, ratio}}}}``."""
        out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
        for (s, c, d), st in sorted(self._counts.items()):
            out.setdefault(s, {}).setdefault(c, {})[d] = st.as_dict()
        return out


class StreamCodecs:
    """Stream name → its own codec; encodes, decodes and counts bytes both ways.

    Streams not named in ``specs`` use ``default``. Decoding reads the codec name carried
    by the array (a receiver accepts whatever a sender chose) and counts it under that name.
    """

    def __init__(self, specs: Mapping[str, str | Mapping[str, Any] | CodecSpec] | None = None,
                 *, default: str | Mapping[str, Any] | CodecSpec = "none") -> None:
        self.default = CodecSpec.parse(default)
        self.specs = {stream: CodecSpec.parse(v) for stream, v in (specs or {}).items()}
        self._codecs: dict[str, Codec] = {}
        self.stats = WireStats()

    def codec(self, stream: str) -> Codec:
        """The codec instance of ``stream`` (created on first use)."""
        codec = self._codecs.get(stream)
        if codec is None:
            codec = self._codecs[stream] = self.specs.get(stream, self.default).build()
        return codec

    def encode(self, stream: str, x: np.ndarray, *, key: Any = None) -> WireArray:
        """``x`` encoded for ``stream``."""
        codec = self.codec(stream)
        arr = codec.to_wire(x, key=key)
        self.stats.add(stream, codec.name, SENT, np.asarray(x).nbytes, arr.nbytes)
        return arr

    def decode(self, stream: str, body: WireArray | Mapping[str, Any]) -> np.ndarray:
        """Decode a received array of ``stream``; malformed input is a MalformedMessage."""
        arr = WireArray.from_wire(body)
        out = decode_array(arr)
        self.stats.add(stream, arr.codec, RECEIVED, out.nbytes, arr.nbytes)
        return out

    def reset(self) -> None:
        """Drop every stream's state (error-feedback residuals, thresholds)."""
        for codec in self._codecs.values():
            reset = getattr(codec, "reset", None)
            if callable(reset):
                reset()

    def as_dict(self) -> dict[str, Any]:
        """``{"codecs": {stream: name}, "bytes": WireStats.as_dict()}``."""
        names = {s: spec.name for s, spec in self.specs.items()}
        names.update({s: c.name for s, c in self._codecs.items()})
        return {"codecs": dict(sorted(names.items())), "bytes": self.stats.as_dict()}


class WireStatsCollector:
    """Prometheus collector: ``persimmon_codec_bytes_total{stream, codec, direction, kind}``
    (``kind`` ``raw``: as fp32; ``wire``: as sent) from records like :meth:`WireStats.rows`,
    read at every scrape from ``source``."""

    def __init__(self, source: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            "persimmon_codec_bytes", "bytes per stream and codec: raw (as fp32) and on the wire",
            labels=["stream", "codec", "direction", "kind"])
        for row in self.source():
            labels = [str(row["stream"]), str(row["codec"]), str(row["direction"])]
            family.add_metric([*labels, "raw"], float(row["raw_bytes"]))
            family.add_metric([*labels, "wire"], float(row["wire_bytes"]))
        yield family
