"""The embedding parameter server: in-memory tables (with an optional disk tier), server-side
optimizers, checkpoints."""

from __future__ import annotations

from services.ps.checkpoint import (
    list_checkpoints,
    read_checkpoint,
    restore_tables,
    write_checkpoint,
)
from services.ps.store import EmbeddingTable, PushResult, TableSnapshot
from services.ps.tables import (
    EvictionPolicy,
    Initializer,
    OptimizerConfig,
    OptimizerKind,
    StorageConfig,
    StorageTier,
    TableConfig,
    initial_rows,
)

__all__ = [
    "EmbeddingTable",
    "EvictionPolicy",
    "Initializer",
    "OptimizerConfig",
    "OptimizerKind",
    "PushResult",
    "StorageConfig",
    "StorageTier",
    "TableConfig",
    "TableSnapshot",
    "initial_rows",
    "list_checkpoints",
    "read_checkpoint",
    "restore_tables",
    "write_checkpoint",
]
