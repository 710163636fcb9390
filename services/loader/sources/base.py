"""What every source produces and promises, and helpers the sources share.

A source yields :class:`SourceBlock` objects — parsed rows of one partition plus the records
it rejected — and is told through :meth:`Source.commit` which blocks are fully consumed
(every row acknowledged by a worker). It commits positions only then, so a restarted loader
resumes with no record lost (records after the last commit may be delivered twice).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from services.common.batch import Jagged
from services.common.errors import ConfigError
from services.loader.batching import Settled
from services.loader.config import SourceSpec
from services.loader.parsers import BadRecord, Parsed
from services.loader.schema import FeatureSchema, TextLayout, criteo_layout, load_schema_file

__all__ = ["Rewindable", "Source", "SourceBlock", "StateFile", "message_layout", "parsed_block"]


@dataclass(slots=True)
class SourceBlock:
    """Rows of one partition with source positions ``first..last`` (inclusive, bad records
    included); ``meta`` is what the source needs back at commit time."""

    partition: str
    first: int
    last: int
    labels: np.ndarray
    dense: np.ndarray
    sparse: dict[str, Jagged]
    positions: np.ndarray
    bad: list[BadRecord] = field(default_factory=list)
    meta: Any = None

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])


def parsed_block(partition: str, parsed: Parsed, positions_of_lines: np.ndarray,
                 first: int, last: int, meta: Any = None) -> SourceBlock:
    """A block from parser output, mapping line indices to source positions."""
    for record in parsed.bad:
        record.position = int(positions_of_lines[record.position])
    return SourceBlock(partition=partition, first=first, last=last, labels=parsed.labels,
                       dense=parsed.dense, sparse=parsed.sparse,
                       positions=positions_of_lines[parsed.lines], bad=parsed.bad, meta=meta)


@runtime_checkable
class Source(Protocol):
    """A place records come from. ``blocks`` ends when a finite source is exhausted."""

    spec: SourceSpec
    schema: FeatureSchema

    async def start(self) -> None: ...

    def blocks(self) -> AsyncIterator[SourceBlock]: ...

    async def commit(self, settled: Settled) -> None: ...

    async def dead_letter(self, block: SourceBlock) -> None: ...

    def offsets(self) -> dict[str, dict[str, Any]]: ...

    def describe(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


@runtime_checkable
class Rewindable(Protocol):
    """A source that can start at a job cut's positions and commit a complete cut's (the
    loader's ``--checkpoint-dir``; :mod:`services.common.checkpoints.positions`)."""

    def rewind(self, positions: dict[str, int]) -> None: ...

    async def commit_positions(self, positions: dict[str, int]) -> dict[str, int]: ...


def message_layout(spec: SourceSpec) -> tuple[str, TextLayout | None, Any]:
    """(format, text layout, schema file) of a message source (Kafka, Redis)."""
    fmt = spec.params.get("format", "criteo")
    buckets = spec.int_param("buckets", 0)
    if fmt == "criteo":
        layout = criteo_layout(spec.int_param("dense", 13), spec.int_param("sparse", 26),
                               multi_hot=spec.params.get("multi_hot") or None, buckets=buckets)
        return fmt, layout, None
    if fmt not in ("json", "csv"):
        raise ConfigError(f"format must be criteo, json or csv, got {fmt!r}")
    if not spec.params.get("schema"):
        raise ConfigError(f"format={fmt} needs ?schema=FILE naming label, dense and sparse fields")
    schema_file = load_schema_file(spec.params["schema"])
    if fmt == "csv":
        if not schema_file.columns:
            raise ConfigError("format=csv for messages needs 'columns' in the schema file")
        return fmt, schema_file.layout(), schema_file
    return fmt, None, schema_file


class StateFile:
    """Committed positions of file and synthetic sources, rewritten atomically as JSON."""

    def __init__(self, path: str | None, source: str) -> None:
        self.path = Path(path) if path else None
        self.source = source
        self.partitions: dict[str, dict[str, Any]] = {}
        self._seq = self._written = 0
        self._lock = threading.Lock()
        if self.path is not None and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"cannot read state file {self.path}: {exc}") from exc
            if not isinstance(data, dict) or data.get("source") != source:
                raise ConfigError(f"state file {self.path} belongs to source "
                                  f"{data.get('source') if isinstance(data, dict) else None!r}, "
                                  f"not {source!r}; remove it to start over")
            self.partitions = dict(data.get("partitions", {}))

    def get(self, partition: str) -> dict[str, Any] | None:
        return self.partitions.get(partition)

    def update(self, partition: str, **values: Any) -> None:
        self.partitions.setdefault(partition, {}).update(values)

    def snapshot(self) -> tuple[int, str]:
        """The current state serialized (call on the event loop), with a sequence number."""
        self._seq += 1
        return self._seq, json.dumps({"source": self.source, "partitions": self.partitions},
                                     indent=1)

    def write(self, snapshot: tuple[int, str]) -> None:
        """Write a snapshot atomically (may run in a thread); an older one never wins."""
        if self.path is None:
            return
        seq, body = snapshot
        with self._lock:
            if seq <= self._written:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".state-")
            with os.fdopen(fd, "w") as fh:
                fh.write(body)
            os.replace(tmp, self.path)
            self._written = seq

    async def save(self) -> None:
        if self.path is not None:
            await asyncio.to_thread(self.write, self.snapshot())
