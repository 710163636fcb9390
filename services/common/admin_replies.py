"""The answers of a PS shard's admin REST API as typed records (what
:class:`clients.AdminClient` returns; the routes are in docs/admin-api.md).

A table's config, optimizer and counters are the wire messages' records
(:class:`~services.common.messages.TableInfo`, ``OptimizerInfo``, ``TableCounters``); every
record is a :class:`~services.common.wire.Record`: an answer with a field missing, unknown or
of the wrong type is a :class:`~services.common.errors.MalformedMessage` naming it.
"""

from __future__ import annotations

from services.common.messages import OptimizerInfo, TableCounters, TableInfo
from services.common.wire import Record, UInt

__all__ = ["CheckpointFile", "CheckpointManifest", "CheckpointSummary", "CheckpointTable",
           "Restored", "Row", "TableDescription", "TableSummary"]


class TableSummary(Record, kw_only=True):
    """A table as ``GET /v1/tables`` lists it and ``POST /v1/tables`` answers."""

    name: str
    dim: int
    dtype: str
    rows: int
    optimizer: OptimizerInfo


class TableDescription(Record, kw_only=True):
    """``GET /v1/tables/{name}``: the table's config and counters, and the shard's epoch."""

    config: TableInfo
    stats: TableCounters
    epoch: int


class Row(Record, kw_only=True):
    """``GET /v1/tables/{name}/rows/{id}``: one row, read without creating or touching it
    (an absent row shows its initial value)."""

    id: int
    present: bool
    row: list[float]


class CheckpointFile(Record, kw_only=True):
    """One array file of a checkpoint part and its checksum."""

    file: str
    sha256: str
    bytes: int


class CheckpointTable(Record, kw_only=True):
    """One table in a checkpoint part: its config, row and tombstone counts, its files."""

    config: TableInfo
    dim: int
    dtype: str
    optimizer: OptimizerInfo
    rows: int
    tombstones: int
    files: dict[str, CheckpointFile]


class CheckpointManifest(Record, kw_only=True, omit_defaults=True):
    """A shard's part of a checkpoint (its ``manifest.json``), as ``POST /v1/checkpoints``
    answers; ``pushes``: the files of its window of applied pushes, where it has one;
    ``epoch``: the shard's when it wrote the part (0, left out: none recorded)."""

    format: int
    checkpoint_id: str
    shard_id: int
    num_shards: int
    incremental: bool
    parent: str | None
    created: float
    epoch: UInt = 0
    tables: dict[str, CheckpointTable]
    pushes: dict[str, CheckpointFile] | None = None


class CheckpointSummary(Record, kw_only=True):
    """One checkpoint as ``GET /v1/checkpoints`` lists it: its parts present (``shards``),
    whether they are all there, its rows per table over the parts, and the parts."""

    checkpoint_id: str
    created: float
    num_shards: int
    shards: list[int]
    complete: bool
    incremental: bool
    parent: str | None
    tables: dict[str, int]
    parts: list[CheckpointManifest]


class Restored(Record, kw_only=True):
    """``POST /v1/checkpoints/{id}/restore``: each table's rows after it, and the shard's new
    epoch (pushes of older epochs are refused)."""

    checkpoint_id: str
    rows: dict[str, int]
    epoch: int
