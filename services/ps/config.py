"""Configuration of one PS shard process."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.ps.tables import TableConfig
from services.ps.wal import WalFsync

__all__ = ["PSConfig"]


@dataclass(kw_only=True, slots=True)
class PSConfig:
    """One process is one shard: ``shard_id`` of ``num_shards``."""

    shard_id: int = field(default=0, metadata={"help": "this shard's index, 0..num_shards-1"})
    num_shards: int = field(default=1, metadata={"help": "number of PS shards in the job"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    grpc_port: int = field(default=50051, metadata={"help": "gRPC port (0: any free port)"})
    admin_port: int = field(default=8081, metadata={"help": "admin REST port (0: any free port)"})
    checkpoint_dir: str | None = field(default=None, metadata={"help": "where checkpoints go"})
    restore: str | None = field(default=None, metadata={
        "help": "checkpoint id to restore at start ('latest' for the newest; 'job' for the "
                "newest complete job checkpoint under checkpoint_dir, if any)"})
    registry: str | None = field(default=None, metadata={
        "help": "register this shard at redis://HOST:PORT/DB?job=NAME (or memory://NAME)"})
    advertise: str | None = field(default=None, metadata={
        "help": "host:port others dial for gRPC (default: host and the bound port)"})
    heartbeat_ttl_s: float = field(default=5.0, metadata={
        "help": "seconds the registry keeps this shard after its last heartbeat"})
    idempotent_pushes: bool = field(default=True, metadata={
        "help": "apply a push at most once per (client, seq) and answer a retry with the "
                "first ack (off: every push is applied, retries too; only to measure what "
                "the check costs)"})
    wal_dir: str | None = field(default=None, metadata={
        "help": "keep a write-ahead log of the pushes since the last checkpoint here, so a "
                "restarted shard (no --restore) comes back with every acknowledged push "
                "(off when unset)"})
    wal_fsync: WalFsync = field(default=WalFsync.BATCH, metadata={
        "help": "when the log is fsynced: always (before each ack), batch (every "
                "wal_fsync_interval_ms) or never; a push is written before its ack under every "
                "policy, so a killed process loses none"})
    wal_fsync_interval_ms: float = field(default=100.0, metadata={
        "help": "milliseconds between fsyncs of the write-ahead log under wal_fsync=batch"})
    wal_segment_bytes: int = field(default=64 * 1024 * 1024, metadata={
        "help": "the write-ahead log starts a new segment past this many bytes (a checkpoint "
                "starts one too, and deletes the older)"})
    tables: list[TableConfig] = field(default_factory=list)
    max_message_bytes: int = field(default=128 * 1024 * 1024, metadata={
        "help": "largest request accepted, in bytes"})
    max_ids_per_request: int = field(default=4_000_000, metadata={
        "help": "most ids one lookup or push may carry"})
    max_tables: int = field(default=1024, metadata={"help": "most tables one shard holds"})
    max_streams_per_client: int = field(default=256, metadata={
        "help": "most gRPC streams one client host may hold open at once"})
    max_streams_per_client_id: int = field(default=64, metadata={
        "help": "most gRPC streams one client id (the persimmon-client metadata its "
                "clients send) may hold open at once"})
    data_dir: str | None = field(default=None, metadata={
        "help": "directory under which tables created over the admin API keep their "
                "disk-tier files (their storage.path must lie under it; unset: such tables "
                "are refused)"})
    max_table_dim: int = field(default=1024, metadata={
        "help": "largest dim of a table created over the admin API"})
    max_initial_capacity: int = field(default=131_072, metadata={
        "help": "largest initial_capacity (rows allocated up front) of a table created "
                "over the admin API"})
    default_max_rows: int = field(default=1 << 26, metadata={
        "help": "max_rows of every table of this shard that sets none (the least recently "
                "used rows are evicted past it; 0: unbounded)"})
    keep_checkpoints: int = field(default=0, metadata={
        "help": "checkpoints of this shard kept in checkpoint_dir: after each checkpoint, "
                "the oldest beyond this many are removed (never one a kept incremental "
                "chains to, nor a job checkpoint's part; 0: keep all)"})
    admin_open_reads: bool = field(default=False, metadata={
        "help": "with a token set, serve the admin API's GETs without it (as "
                "PERSIMMON_ADMIN_OPEN_READS=1 does)"})
    ttl_sweep_s: float = field(default=10.0, metadata={
        "help": "seconds between sweeps that drop rows past their table's TTL"})
    max_workers: int = field(default=4096, metadata={
        "help": "most workers the job may have (set it to the job's world size where known): "
                "a request's step tag naming more is refused (INVALID_ARGUMENT)"})
    dedup_clients: int | None = field(default=None, metadata={
        "help": "pushing clients whose recent pushes (acks and fingerprints, up to ~0.2 MB a "
                "busy client) the shard keeps to answer retries (unset: 2 per worker of "
                "max_workers, at least 1024); past it the least recently seen is evicted, and "
                "a later push of it that may be a retry is refused (FAILED_PRECONDITION), "
                "never applied twice"})

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard_id < self.num_shards:
            raise ValueError(f"shard_id must be in [0, {self.num_shards}), got {self.shard_id}")
        for name in ("grpc_port", "admin_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be at least 1024")
        _check_bounds(self)
        if self.heartbeat_ttl_s <= 0:
            raise ValueError("heartbeat_ttl_s must be > 0")
        if self.ttl_sweep_s <= 0:
            raise ValueError("ttl_sweep_s must be > 0")
        _check_wal(self)
        names = [t.name for t in self.tables]
        if len(names) != len(set(names)):
            raise ValueError(f"table names must be unique, got {names}")
        _check_clients(self)

    @property
    def push_clients(self) -> int:
        """The clients a shard's push window keeps (``dedup_clients`` or its default)."""
        return self.dedup_clients or max(1024, 2 * self.max_workers)


def _check_wal(config: PSConfig) -> None:
    if not config.wal_fsync_interval_ms > 0:
        raise ValueError(f"wal_fsync_interval_ms must be > 0, got {config.wal_fsync_interval_ms}")
    if config.wal_segment_bytes < 4096:
        raise ValueError(f"wal_segment_bytes must be >= 4096, got {config.wal_segment_bytes}")


def _check_clients(config: PSConfig) -> None:
    if not 1 <= config.max_workers <= 1 << 20:
        raise ValueError(f"max_workers must be in [1, 2**20], got {config.max_workers}")
    if config.dedup_clients is not None and config.dedup_clients < 1:
        raise ValueError(f"dedup_clients must be >= 1 (or unset), got {config.dedup_clients}")


def _check_bounds(config: PSConfig) -> None:
    for name in ("max_ids_per_request", "max_tables", "max_streams_per_client",
                 "max_streams_per_client_id", "max_table_dim", "max_initial_capacity"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
    for name in ("default_max_rows", "keep_checkpoints"):
        if getattr(config, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(config, name)}")
