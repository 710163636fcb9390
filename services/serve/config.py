"""Configuration of ``persimmon serve`` and ``persimmon export``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.common.errors import ConfigError
from services.loader.hashing import DenseTransform
from services.serve.rows import ROW_DTYPES

__all__ = ["ExportConfig", "ServeConfig"]


def _port(name: str, value: int) -> None:
    if not 0 <= value <= 65535:
        raise ConfigError(f"{name} must be in [0, 65535], got {value}")


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    """One prediction server over the versions in ``model_dir``."""

    model_dir: str = field(default="", metadata={"help": "directory of model versions"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    admin_port: int = field(default=8090, metadata={
        "help": "REST port: predict, versions, health, metrics (0: any free port)"})
    grpc_port: int = field(default=8091, metadata={
        "help": "gRPC port of persimmon.Serve/Predict (0: any free port)"})
    advertise: str | None = field(default=None, metadata={
        "help": "host:port others dial for gRPC (default: host and the bound port)"})
    max_message_bytes: int = field(default=64 << 20, metadata={
        "help": "largest gRPC request accepted, in bytes"})
    max_batch_records: int = field(default=256, metadata={
        "help": "micro-batching: most records answered by one forward pass"})
    max_wait_ms: float = field(default=2.0, metadata={
        "help": "micro-batching: longest wait for more requests after the first"})
    max_request_records: int = field(default=4096, metadata={
        "help": "most records one request may hold (more: 413)"})
    max_queued_records: int = field(default=65536, metadata={
        "help": "most records waiting; beyond it requests get 503"})
    watch_interval_s: float = field(default=1.0, metadata={
        "help": "seconds between looks for a newer version in model_dir"})
    verify_checksums: bool = field(default=True, metadata={
        "help": "check every file's sha256 before serving a version"})
    forward_threads: int = field(default=1, metadata={
        "help": "BLAS threads of the forward pass (0: the BLAS library's default, one per "
                "core; the default 1 leaves the other cores to requests and featurizing)"})
    ps: str | None = field(default=None, metadata={
        "help": "PS shard addresses host:port,... in shard order: versions exported with "
                "--ps-tables read those tables there (read-only)"})

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ConfigError("model_dir is required (--model-dir DIR)")
        _port("admin_port", self.admin_port)
        _port("grpc_port", self.grpc_port)
        if self.max_message_bytes < 1024:
            raise ConfigError("max_message_bytes must be at least 1024")
        for name in ("max_batch_records", "max_request_records", "max_queued_records"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued_records < self.max_request_records:
            raise ConfigError("max_queued_records must be >= max_request_records")
        if not (math.isfinite(self.max_wait_ms) and self.max_wait_ms >= 0):
            raise ConfigError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if not (math.isfinite(self.watch_interval_s) and self.watch_interval_s > 0):
            raise ConfigError(f"watch_interval_s must be > 0, got {self.watch_interval_s}")
        if self.forward_threads < 0:
            raise ConfigError(f"forward_threads must be >= 0, got {self.forward_threads}")
        if self.ps is not None and not all(
                host and port.isdigit() and int(port) <= 65535
                for host, _, port in (a.rpartition(":") for a in self.ps.split(","))):
            raise ConfigError(f"ps must be host:port,... (the PS shards in shard order), "
                              f"got {self.ps!r}")


@dataclass(kw_only=True, slots=True)
class ExportConfig:
    """A model version from a job checkpoint: ``checkpoint_dir/job_checkpoint`` to ``out``."""

    job_checkpoint: str = field(default="", metadata={
        "help": "job checkpoint id ('latest': the newest complete one)"})
    checkpoint_dir: str = field(default="", metadata={
        "help": "the job's checkpoint directory (every PS shard's and the job's parts)"})
    out: str = field(default="", metadata={"help": "model directory to write the version into"})
    features: str = field(default="", metadata={
        "help": "the training data's --source spec (criteo:..., csv:...?schema=, kafka://..., "
                "synthetic:N) or a feature spec JSON file"})
    model: str = field(default="dlrm", metadata={"help": "model name (dlrm, deepfm, ...)"})
    model_config: str | None = field(default=None, metadata={
        "help": "YAML/JSON file of ModelConfig fields (overrides --model)"})
    table_prefix: str = field(default="", metadata={"help": "PS table = prefix + feature"})
    pooling: str = field(default="sum", metadata={"help": "pooling of training: sum or mean"})
    row_dtype: str = field(default="float32", metadata={
        "help": f"stored rows: one of {', '.join(ROW_DTYPES)}"})
    keep: int = field(default=0, metadata={"help": "keep the newest K versions (0: all)"})
    ps_tables: str = field(default="", metadata={
        "help": "tables,... the version reads from the live PS shards instead of copying "
                "them (persimmon serve --ps)"})
    base: str | None = field(default=None, metadata={
        "help": "write an incremental version on top of this version of --out ('latest': the "
                "newest there; none: a full version)"})
    dense_fill: float = field(default=0.0, metadata={"help": "the loader's dense_fill"})
    dense_clip_min: float | None = field(default=0.0, metadata={
        "help": "the loader's dense_clip_min"})
    dense_clip_max: float | None = field(default=None, metadata={
        "help": "the loader's dense_clip_max"})
    dense_log1p: bool = field(default=True, metadata={"help": "the loader's dense_log1p"})

    def __post_init__(self) -> None:
        for name in ("job_checkpoint", "checkpoint_dir", "out", "features"):
            if not getattr(self, name):
                raise ConfigError(f"{name} is required (--{name.replace('_', '-')})")
        if self.row_dtype not in ROW_DTYPES:
            raise ConfigError(f"row_dtype must be one of {ROW_DTYPES}, got {self.row_dtype!r}")
        if self.keep < 0:
            raise ConfigError(f"keep must be >= 0, got {self.keep}")
        self.dense_transform()

    def dense_transform(self) -> DenseTransform:
        try:
            return DenseTransform(fill=self.dense_fill, clip_min=self.dense_clip_min,
                                  clip_max=self.dense_clip_max, log1p=self.dense_log1p)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
