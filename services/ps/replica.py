"""A worker's replica of the rows it alone writes: the PS round trip off the step.

With one worker, the rows of the head ids and of the hot tables have one writer: that worker.
Where they are remote the synchronous hot chain (``services.worker.heads.HotChain``) still waits
for one round trip a step (push the step's gradients, read the rows back). A
:class:`HeadReplica` keeps those rows in the worker's process instead, in tables of the PS's own
kind (one :class:`~services.ps.store.EmbeddingTable` per table, whatever the PS's shards: every
update is the PS's arithmetic, bit for bit): the compute thread reads them just before its step
and applies their gradients just after (``lookup_now``/``push_now``, as with embedded shards),
and the batch's push sends the same gradients on to the PS, whose copy so follows the
replica's.

A row is copied from the PS, rows and optimizer state exactly (``lookup_state_sharded``), the first
time a batch needs it (:meth:`HeadReplica.seed`, at that batch's lookup), once every earlier
batch's push is acknowledged (the worker's embedding pipeline waits for that): the copy holds every
update of the id, and so does the PS's copy after it. The replica's tables are the PS's configs
held in RAM without eviction, TTL or admission (the PS still applies those to its copy); optimizer
settings changed on the PS during a run (admin API) do not reach the replica, nor does a lossy
grads codec's loss.

It lives with the PS and is injected by the code that builds the worker (``services.local``),
as ``services.ps.inprocess.InProcessShards`` is: the worker never imports the PS.

Usage (one worker, its rows across a network)::

    trainer.pipeline.replica = HeadReplica()
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from services.common.config import from_dict
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.sharding import ShardedIds
from services.ps.store import EmbeddingTable, PushResult, warm_up
from services.ps.table_io import TableSnapshot
from services.ps.tables import StorageConfig, TableConfig

__all__ = ["HeadReplica"]


class _Source(Protocol):
    """The remote rows a replica copies from (a ``clients.rows.StatefulRows``)."""

    async def tables(self) -> list[dict[str, Any]]: ...

    async def lookup_state_sharded(self, layout: ShardedIds
                                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]: ...


class HeadReplica:
    """The worker's copy of the rows it alone writes (see the module doc); a
    ``clients.rows.DirectRows`` once :meth:`seed` built its tables."""

    def __init__(self) -> None:
        self._tables: dict[str, EmbeddingTable] | None = None
        self._building = asyncio.Lock()

    @property
    def direct(self) -> bool:
        return True

    @property
    def num_rows(self) -> int:
        """Rows held, over every table."""
        return sum(t.num_rows for t in (self._tables or {}).values())

    def clear(self) -> None:
        """Forget every row (a new run copies them again: the PS's may have changed)."""
        self._tables = None
        self._building = asyncio.Lock()

    def lookup_now(self, layout: ShardedIds) -> np.ndarray:
        """The held rows of ``layout`` (every id seeded first), in the calling thread."""
        tables = self._held_tables()
        out = np.empty((layout.ids.size, tables[layout.tables[0]].dim), dtype=np.float32)
        for name, at in _by_table(layout):
            out[at] = tables[name].lookup(layout.ids[at])
        return out

    def push_now(self, layout: ShardedIds, grads: np.ndarray) -> PushResult:
        """Apply ``grads`` to the held rows of ``layout`` now, with the PS's optimizer."""
        tables = self._held_tables()
        if grads.shape != (layout.ids.size, tables[layout.tables[0]].dim):
            raise InvalidArgument(f"grads must be ({layout.ids.size}, dim), got {grads.shape}")
        return PushResult.total(tables[name].push(layout.ids[at], grads[at])
                                for name, at in _by_table(layout))

    def holds(self, layout: ShardedIds) -> bool:
        """Whether the replica holds the row of every id of ``layout``."""
        return self._tables is not None and bool(_held(self._tables, layout).all())

    async def seed(self, source: _Source, layout: ShardedIds) -> int:
        """Copy the rows of ``layout``'s ids not held yet from ``source`` (rows and optimizer
        state, exactly); returns how many it copied."""
        tables = await self._build(source)
        missing = layout.subset(~_held(tables, layout))
        if not missing.ids.size:
            return 0
        rows, state = await source.lookup_state_sharded(
            replace(missing, tag=None))  # a copy, not a step's lookup (the PS's staleness count)
        fresh = ~_held(tables, missing)  # a seed overlapping this one may have copied some
        empty = np.empty(0, dtype=np.uint64)
        for name, at in _by_table(missing):
            at = at[fresh[at]]
            table = tables[name]
            table.restore(TableSnapshot(config=table.config, ids=missing.ids[at], rows=rows[at],
                                        state={key: v[at] for key, v in state.items()},
                                        tombstones=empty))
        return int(fresh.sum())

    async def _build(self, source: _Source) -> dict[str, EmbeddingTable]:
        """The replica's tables, built from ``source``'s configs at the first seed."""
        async with self._building:
            if self._tables is None:
                configs = [_replica_config(from_dict(TableConfig, dict(t), where="table"))
                           for t in await source.tables()]
                for config in configs:
                    await asyncio.to_thread(warm_up, config)  # numba's kernels, off the loop
                self._tables = {c.name: EmbeddingTable(c) for c in configs}
            return self._tables

    def _held_tables(self) -> dict[str, EmbeddingTable]:
        if self._tables is None:
            raise FailedPrecondition("the replica holds no rows yet: seed() first")
        return self._tables


def _replica_config(config: TableConfig) -> TableConfig:
    """``config`` held in RAM, with every row kept and admitted (the PS's copy still evicts,
    expires and admits)."""
    return replace(config, max_rows=None, ttl_s=None, admit_probability=1.0, admit_min_count=0,
                   storage=StorageConfig(), initial_capacity=1024)


def _by_table(layout: ShardedIds) -> Iterator[tuple[str, np.ndarray]]:
    """Each table of ``layout`` with the positions of its ids (over every shard: the replica
    holds one table of each, whatever the PS's shards)."""
    which = layout.table_index()
    order = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[order], np.arange(len(layout.tables) + 1))
    for j, name in enumerate(layout.tables):
        if bounds[j + 1] > bounds[j]:
            yield name, order[bounds[j]:bounds[j + 1]]


def _held(tables: dict[str, EmbeddingTable], layout: ShardedIds) -> np.ndarray:
    """Per id of ``layout``: whether the replica holds its row."""
    held = np.zeros(layout.ids.size, dtype=bool)
    for name, at in _by_table(layout):
        held[at] = tables[name].peek(layout.ids[at])[1]
    return held
