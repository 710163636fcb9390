"""Configuration of a loader process and the source spec string it reads.

A source spec is one of::

    criteo:GLOB[,GLOB...][?dense=13&sparse=26&multi_hot=,&buckets=N]
    avazu:GLOB[?buckets=N]
    parquet:GLOB[?schema=FILE | ?label=COLUMN&buckets=N]
    csv:GLOB?schema=FILE
    kafka://HOST:PORT[,HOST:PORT]/TOPIC?group=G[&format=criteo|json|csv&schema=FILE&...]
    redis://HOST:PORT/STREAM?group=G[&consumer=NAME&format=...&field=data&db=0]
    synthetic:ROWS[?split=train|test]

Unknown parameters are a :class:`ConfigError`, as are unknown config keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from urllib.parse import parse_qsl, urlsplit

from services.common.errors import ConfigError
from services.loader.hashing import DenseTransform

__all__ = ["LoaderConfig", "SourceKind", "SourceSpec"]

_TEXT_PARAMS = {"format", "schema", "dense", "sparse", "multi_hot", "buckets", "label"}
_PARAMS: dict[str, set[str]] = {
    "criteo": {"dense", "sparse", "multi_hot", "buckets"},
    "avazu": {"buckets"},
    "parquet": {"schema", "label", "buckets"},
    "csv": {"schema"},
    "kafka": {"group", "dead_letter", *_TEXT_PARAMS},
    "redis": {"group", "consumer", "field", "db", *_TEXT_PARAMS},
    "synthetic": {"split", "profile", "max_vocab", "zipf"},
}


class SourceKind(StrEnum):
    CRITEO = "criteo"
    AVAZU = "avazu"
    PARQUET = "parquet"
    CSV = "csv"
    KAFKA = "kafka"
    REDIS = "redis"
    SYNTHETIC = "synthetic"

    @property
    def is_file(self) -> bool:
        return self in (SourceKind.CRITEO, SourceKind.AVAZU, SourceKind.PARQUET, SourceKind.CSV)


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """A parsed source spec: ``kind``, ``target`` (globs, ``host:port``, row count) and
    ``params``; for Kafka/Redis ``topic`` is the topic or stream name."""

    kind: SourceKind
    target: str
    params: dict[str, str] = field(default_factory=dict)
    topic: str = ""
    text: str = ""

    @classmethod
    def parse(cls, spec: str) -> SourceSpec:
        if not isinstance(spec, str) or ":" not in spec:
            raise ConfigError(f"source {spec!r} must look like KIND:TARGET, e.g. criteo:data/*.gz,"
                              f" kafka://host:9092/topic?group=g or synthetic:100000")
        scheme = spec.split(":", 1)[0].lower()
        try:
            kind = SourceKind(scheme)
        except ValueError as exc:
            raise ConfigError(f"unknown source kind {scheme!r} in {spec!r}; known: "
                              f"{[k.value for k in SourceKind]}") from exc
        if kind in (SourceKind.KAFKA, SourceKind.REDIS):
            parts = urlsplit(spec)
            topic = parts.path.lstrip("/")
            if not parts.netloc or not topic or "/" in topic:
                raise ConfigError(f"source {spec!r} must be {kind.value}://HOST:PORT/NAME?group=G")
            target, query = parts.netloc, parts.query
        else:
            rest = spec.split(":", 1)[1]
            target, _, query = rest.partition("?")
            topic = ""
            if not target:
                raise ConfigError(f"source {spec!r} names no files or rows")
        params = dict(parse_qsl(query, keep_blank_values=True))
        unknown = sorted(set(params) - _PARAMS[kind.value])
        if unknown:
            raise ConfigError(f"source {spec!r}: unknown parameters {unknown}; "
                              f"known for {kind.value}: {sorted(_PARAMS[kind.value])}")
        out = cls(kind=kind, target=target, params=params, topic=topic, text=spec)
        if kind in (SourceKind.KAFKA, SourceKind.REDIS) and not params.get("group"):
            raise ConfigError(f"source {spec!r} needs ?group=NAME (offsets are kept per group)")
        if kind is SourceKind.CSV and not params.get("schema"):
            raise ConfigError(f"source {spec!r} needs ?schema=FILE describing the columns")
        if kind is SourceKind.SYNTHETIC:
            out.rows()
        return out

    def int_param(self, name: str, default: int) -> int:
        raw = self.params.get(name)
        if raw is None or raw == "":
            return default
        try:
            value = int(raw)
        except ValueError as exc:
            raise ConfigError(f"source parameter {name}={raw!r} must be an integer") from exc
        if value < 0:
            raise ConfigError(f"source parameter {name} must be >= 0, got {value}")
        return value

    def rows(self) -> int:
        """The row count of ``synthetic:ROWS``."""
        try:
            rows = int(self.target)
        except ValueError as exc:
            raise ConfigError(f"synthetic source needs a row count, got {self.target!r}") from exc
        if rows < 1:
            raise ConfigError(f"synthetic row count must be >= 1, got {rows}")
        return rows

    def globs(self) -> list[str]:
        return [g for g in self.target.split(",") if g]


def _port(name: str, value: int) -> None:
    if not 0 <= value <= 65535:
        raise ValueError(f"{name} must be in [0, 65535], got {value}")


@dataclass(kw_only=True, slots=True)
class LoaderConfig:
    """One loader process: one source, one gRPC stream endpoint, one admin API."""

    source: str = field(default="synthetic:100000", metadata={"help": "source spec, see docs"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    grpc_port: int = field(default=50061, metadata={"help": "gRPC port (0: any free port)"})
    admin_port: int = field(default=8091, metadata={"help": "admin REST port (0: any free)"})
    batch_size: int = field(default=1024, metadata={"help": "samples per batch"})
    shuffle_buffer: int = field(default=0, metadata={"help": "rows shuffled together (0: off)"})
    shuffle_files: bool = field(default=False, metadata={"help": "shuffle file order per epoch"})
    seed: int = field(default=0, metadata={"help": "seed of every shuffle"})
    epochs: int = field(default=1, metadata={"help": "passes over file sources"})
    drop_last: bool = field(default=False, metadata={"help": "drop the last partial batch"})
    prefetch_batches: int = field(default=4, metadata={
        "help": "batches prepared ahead per worker rank (back-pressure bound)"})
    world_size: int = field(default=0, metadata={
        "help": "number of worker ranks (0: taken from the first worker that connects)"})
    replica: int = field(default=0, metadata={"help": "this loader's index among replicas"})
    replicas: int = field(default=1, metadata={
        "help": "loader replicas; files and Kafka partitions are split among them"})
    dead_letter: str | None = field(default=None, metadata={
        "help": "JSON-lines file that receives malformed records"})
    dead_letter_max_bytes: int = field(default=64 << 20, metadata={
        "help": "the dead-letter file grows to at most this many bytes; later malformed "
                "records are counted, not kept"})
    state_file: str | None = field(default=None, metadata={
        "help": "where file/synthetic sources keep committed positions (resume on restart)"})
    checkpoint_dir: str | None = field(default=None, metadata={
        "help": "job checkpoints (Kafka): start at the newest complete cut's positions and "
                "commit offsets only for complete cuts, not at acks"})
    block_bytes: int = field(default=4 << 20, metadata={"help": "bytes of text parsed at once"})
    poll_records: int = field(default=4096, metadata={
        "help": "most Kafka/Redis records fetched at once"})
    poll_timeout_ms: int = field(default=200, metadata={"help": "Kafka/Redis fetch wait"})
    claim_idle_ms: int = field(default=30000, metadata={
        "help": "Redis: pending entries idle this long are claimed from dead consumers"})
    dense_fill: float = field(default=0.0, metadata={"help": "value of a missing dense feature"})
    dense_clip_min: float | None = field(default=0.0, metadata={"help": "dense lower clip"})
    dense_clip_max: float | None = field(default=None, metadata={"help": "dense upper clip"})
    dense_log1p: bool = field(default=True, metadata={"help": "apply log1p to dense features"})
    max_message_bytes: int = field(default=128 << 20, metadata={"help": "largest gRPC message"})
    max_streams_per_client: int = field(default=256, metadata={
        "help": "most gRPC streams one client host may hold open at once"})
    max_streams_per_client_id: int = field(default=64, metadata={
        "help": "most gRPC streams one client id (the persimmon-client metadata its "
                "clients send) may hold open at once"})
    registry: str | None = field(default=None, metadata={
        "help": "register this loader at redis://HOST:PORT/DB?job=NAME (or memory://NAME)"})
    advertise: str | None = field(default=None, metadata={
        "help": "host:port others dial for gRPC (default: host and the bound port)"})

    def __post_init__(self) -> None:
        SourceSpec.parse(self.source)
        _port("grpc_port", self.grpc_port)
        _port("admin_port", self.admin_port)
        positive = ("batch_size", "epochs", "prefetch_batches", "replicas", "block_bytes",
                    "poll_records", "poll_timeout_ms", "claim_idle_ms", "dead_letter_max_bytes",
                    "max_streams_per_client", "max_streams_per_client_id")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shuffle_buffer < 0 or self.world_size < 0:
            raise ValueError("shuffle_buffer and world_size must be >= 0")
        if self.checkpoint_dir and self.shuffle_buffer:
            raise ValueError("checkpoint_dir (job cuts) needs shuffle_buffer 0: shuffled "
                             "batches hold no prefix of a partition, so no cut")
        if not 0 <= self.replica < self.replicas:
            raise ValueError(f"replica must be in [0, {self.replicas}), got {self.replica}")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be at least 1024")
        if not math.isfinite(self.dense_fill):
            raise ValueError("dense_fill must be finite")
        self.dense_transform()

    @property
    def spec(self) -> SourceSpec:
        return SourceSpec.parse(self.source)

    def dense_transform(self) -> DenseTransform:
        return DenseTransform(fill=self.dense_fill, clip_min=self.dense_clip_min,
                              clip_max=self.dense_clip_max, log1p=self.dense_log1p)
