"""Columnar rows, fixed-size batches with a shuffle buffer, and acknowledgement accounting.

Sources emit :class:`Rows` (one *chunk* at a time: a run of records of one partition, e.g.
a file block or a Kafka fetch); :class:`Batcher` cuts them into batches of ``batch_size``;
:class:`ChunkTracker` counts each chunk's rows still unacknowledged, so a source learns
when every record of a chunk is safely consumed and which prefix of each partition it may
commit. All of it is numpy over whole columns; nothing loops per record.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.common.batch import Batch, Jagged

__all__ = ["Batch", "Batcher", "Chunk", "ChunkTracker", "Jagged", "Rows", "concat_jagged",
           "take_jagged"]


def take_jagged(feature: Jagged, idx: np.ndarray) -> Jagged:
    """The samples ``idx`` of a jagged feature, in that order."""
    offsets = feature.offsets()
    lengths = feature.lengths[idx]
    starts = offsets[:-1][idx]
    new_offsets = np.zeros(idx.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    gather = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
    return Jagged(feature.values[gather], lengths)


def concat_jagged(features: list[Jagged]) -> Jagged:
    if len(features) == 1:
        return features[0]
    return Jagged(np.concatenate([f.values for f in features]),
                  np.concatenate([f.lengths for f in features]))


@dataclass(slots=True)
class Rows:
    """Records in columns: ``positions`` and ``chunks`` give each row's source position and
    the chunk (see :class:`ChunkTracker`) it belongs to."""

    labels: np.ndarray
    dense: np.ndarray
    sparse: dict[str, Jagged]
    positions: np.ndarray
    chunks: np.ndarray

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        if len(parts) == 1:
            return parts[0]
        return Rows(labels=np.concatenate([p.labels for p in parts]),
                    dense=np.concatenate([p.dense for p in parts]),
                    sparse={name: concat_jagged([p.sparse[name] for p in parts])
                            for name in parts[0].sparse},
                    positions=np.concatenate([p.positions for p in parts]),
                    chunks=np.concatenate([p.chunks for p in parts]))

    def take(self, idx: np.ndarray) -> Rows:
        return Rows(labels=self.labels[idx], dense=self.dense[idx],
                    sparse={n: take_jagged(f, idx) for n, f in self.sparse.items()},
                    positions=self.positions[idx], chunks=self.chunks[idx])

    def slice(self, start: int, stop: int) -> Rows:
        sparse = {}
        for name, f in self.sparse.items():
            offsets = f.offsets()
            sparse[name] = Jagged(f.values[offsets[start]:offsets[stop]], f.lengths[start:stop])
        return Rows(labels=self.labels[start:stop], dense=self.dense[start:stop], sparse=sparse,
                    positions=self.positions[start:stop], chunks=self.chunks[start:stop])

    def chunk_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct chunk ids of these rows and how many rows each has."""
        ids, counts = np.unique(self.chunks, return_counts=True)
        return ids, counts

    def to_batch(self, batch_id: int, partition_of: Callable[[int], str]) -> Batch:
        """A :class:`Batch` (contiguous copies) with per-partition first/last positions."""
        ids, inverse = np.unique(self.chunks, return_inverse=True)
        names = [partition_of(int(c)) for c in ids]
        positions: dict[str, tuple[int, int]] = {}
        for name in dict.fromkeys(names):
            mask = np.isin(inverse, [k for k, n in enumerate(names) if n == name])
            chosen = self.positions[mask]
            positions[name] = (int(chosen.min()), int(chosen.max()))
        return Batch(batch_id=batch_id,
                     labels=np.ascontiguousarray(self.labels, dtype=np.float32),
                     dense=np.ascontiguousarray(self.dense, dtype=np.float32),
                     sparse={n: Jagged(np.ascontiguousarray(f.values, dtype=np.uint64),
                                       np.ascontiguousarray(f.lengths, dtype=np.int32))
                             for n, f in self.sparse.items()},
                     positions=positions)


class Batcher:
    """Cuts rows into batches of ``batch_size``, optionally through a shuffle buffer.

    With ``shuffle_buffer`` S > 0 rows collect until at least S are held, are permuted
    together, and every full batch is emitted (the remainder stays for the next window): a
    windowed shuffle, deterministic for a given ``seed`` and input order.
    """

    def __init__(self, batch_size: int, *, shuffle_buffer: int = 0, seed: int = 0,
                 drop_last: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {shuffle_buffer}")
        self.batch_size = batch_size
        self.shuffle_buffer = shuffle_buffer
        self.drop_last = drop_last
        self._rng = np.random.default_rng(seed)
        self._pending: list[Rows] = []
        self._held = 0

    @property
    def held(self) -> int:
        """Rows waiting in the buffer."""
        return self._held

    def push(self, rows: Rows) -> list[Rows]:
        """Add rows; returns the batches now complete."""
        if rows.size:
            self._pending.append(rows)
            self._held += rows.size
        threshold = max(self.shuffle_buffer, self.batch_size)
        if self._held < threshold:
            return []
        return self._cut(final=False)

    def flush(self) -> tuple[list[Rows], Rows | None]:
        """Emit everything held: full batches, then the last partial batch unless
        ``drop_last`` (then it is returned second, so its chunks can be settled)."""
        if not self._held:
            return [], None
        batches = self._cut(final=True)
        if self._held == 0:
            return batches, None
        rest = Rows.concat(self._pending)
        self._pending, self._held = [], 0
        if self.drop_last:
            return batches, rest
        return [*batches, rest], None

    def _cut(self, *, final: bool) -> list[Rows]:
        rows = Rows.concat(self._pending)
        if self.shuffle_buffer:
            rows = rows.take(self._rng.permutation(rows.size))
        full = rows.size // self.batch_size
        out = [rows.slice(k * self.batch_size, (k + 1) * self.batch_size) for k in range(full)]
        rest = rows.size - full * self.batch_size
        self._pending = [rows.slice(full * self.batch_size, rows.size)] if rest else []
        self._held = rest
        return out


@dataclass(slots=True)
class Chunk:
    """A run of records of one partition, positions ``first..last``; ``meta`` is the
    source's own resume information (a byte offset, Redis entry ids)."""

    chunk_id: int
    partition: str
    first: int
    last: int
    rows: int
    meta: Any = None
    remaining: int = 0
    done: bool = False


@dataclass(slots=True)
class Settled:
    """Chunks whose every row is now consumed, and per partition the last chunk of the
    newly complete prefix (commit position = ``chunk.last + 1``)."""

    done: list[Chunk] = field(default_factory=list)
    advanced: dict[str, Chunk] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.done or self.advanced)


class ChunkTracker:
    """Counts unconsumed rows per chunk; chunks of a partition must be opened in order."""

    def __init__(self) -> None:
        self._chunks: dict[int, Chunk] = {}
        self._order: dict[str, deque[int]] = {}
        self._next = 0
        self._settled = Settled()

    def open(self, partition: str, first: int, last: int, rows: int, meta: Any = None) -> Chunk:
        chunk = Chunk(self._next, partition, first, last, rows, meta, remaining=rows)
        self._next += 1
        self._chunks[chunk.chunk_id] = chunk
        self._order.setdefault(partition, deque()).append(chunk.chunk_id)
        if rows == 0:
            self._finish(chunk)
        return chunk

    def partition_of(self, chunk_id: int) -> str:
        return self._chunks[chunk_id].partition

    def settle(self, chunk_ids: np.ndarray, counts: np.ndarray) -> None:
        """Mark ``counts[i]`` rows of chunk ``chunk_ids[i]`` consumed (acked or dropped)."""
        for cid, n in zip(chunk_ids.tolist(), counts.tolist(), strict=True):
            chunk = self._chunks.get(cid)
            if chunk is None or chunk.done:
                continue
            chunk.remaining -= n
            if chunk.remaining <= 0:
                self._finish(chunk)

    def _finish(self, chunk: Chunk) -> None:
        chunk.done = True
        self._settled.done.append(chunk)
        order = self._order[chunk.partition]
        last = None
        while order and self._chunks[order[0]].done:
            last = self._chunks.pop(order.popleft())
        if last is not None:
            self._settled.advanced[chunk.partition] = last

    def take_settled(self) -> Settled:
        settled, self._settled = self._settled, Settled()
        return settled

    @property
    def open_chunks(self) -> int:
        return len(self._chunks)
