"""A worker's replica of the rows it alone writes: the PS round trip off the step.

With one worker, the rows of the head ids and of the hot tables have one writer: that worker.
Where they are remote the synchronous hot chain (``services.worker.heads.HotChain``) still waits
for one round trip a step (push the step's gradients, read the rows back). A
:class:`HeadReplica` keeps those rows in the worker's process instead, in tables of the PS's own
kind (:class:`InProcessShards`: every update is the PS's arithmetic, bit for bit): the compute
thread reads them just before its step and applies their gradients just after
(``lookup_now``/``push_now``, as with embedded shards), and the batch's push sends the same
gradients on to the PS, whose copy so follows the replica's.

A row is copied from the PS, rows and optimizer state exactly (``lookup_state_sharded``), the
first time a batch needs it (:meth:`HeadReplica.seed`, at that batch's lookup): like any lookup
under the window it may miss the updates of the batches then in flight, which the PS's copy
keeps. The replica's tables are the PS's configs held in RAM without eviction, TTL or admission
(the PS still applies those to its copy); optimizer settings changed on the PS during a run
(admin API) do not reach the replica, nor does a lossy grads codec's loss.

It lives with the PS and is injected by the code that builds the worker (``services.local``),
as :class:`InProcessShards` is: the worker never imports the PS.

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
from services.common.sharding import ShardedIds
from services.ps.inprocess import InProcessShards
from services.ps.store import PushResult
from services.ps.table_io import TableSnapshot
from services.ps.tables import StorageConfig, TableConfig

__all__ = ["HeadReplica"]


class _Source(Protocol):
    """The remote rows a replica copies from (a ``clients.rows.StatefulRows``)."""

    @property
    def num_shards(self) -> int: ...

    async def tables(self) -> list[dict[str, Any]]: ...

    async def lookup_state_sharded(self, layout: ShardedIds
                                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]: ...


class HeadReplica:
    """The worker's copy of the rows it alone writes (see the module doc); a
    ``clients.rows.DirectRows`` once :meth:`seed` built its tables."""

    def __init__(self) -> None:
        self._local: InProcessShards | None = None
        self._building = asyncio.Lock()

    @property
    def direct(self) -> bool:
        return True

    @property
    def num_rows(self) -> int:
        """Rows held, over every table."""
        local = self._local
        return 0 if local is None else sum(t.num_rows for s in local.shards
                                           for t in s.tables.values())

    def clear(self) -> None:
        """Forget every row (a new run copies them again: the PS's may have changed)."""
        self._local = None

    def lookup_now(self, layout: ShardedIds) -> np.ndarray:
        """The held rows of ``layout`` (every id seeded first), in the calling thread."""
        return self._tables().lookup_now(_untagged(layout))

    def push_now(self, layout: ShardedIds, grads: np.ndarray) -> PushResult:
        """Apply ``grads`` to the held rows of ``layout`` now, with the PS's optimizer."""
        return self._tables().push_now(_untagged(layout), grads)

    async def seed(self, source: _Source, layout: ShardedIds) -> int:
        """Copy the rows of ``layout``'s ids not held yet from ``source`` (rows and optimizer
        state, exactly); returns how many it copied."""
        local = await self._build(source)
        missing = layout.subset(~_held(local, layout))
        if not missing.ids.size:
            return 0
        rows, state = await source.lookup_state_sharded(_untagged(missing))
        fresh = ~_held(local, missing)  # a seed overlapping this one may have copied some
        empty = np.empty(0, dtype=np.uint64)
        for k, name, lo, hi in _parts(missing):
            if not fresh[lo:hi].any():
                continue
            at = np.arange(lo, hi)[fresh[lo:hi]]
            table = local.shards[k].table(name)
            table.restore(TableSnapshot(config=table.config, ids=missing.ids[at], rows=rows[at],
                                        state={key: v[at] for key, v in state.items()},
                                        tombstones=empty))
        return int(fresh.sum())

    async def _build(self, source: _Source) -> InProcessShards:
        """The replica's tables, built from ``source``'s configs at the first seed."""
        async with self._building:
            if self._local is None:
                configs = [_replica_config(from_dict(TableConfig, dict(t), where="table"))
                           for t in await source.tables()]
                local = InProcessShards(configs, num_shards=source.num_shards)
                self._local = await asyncio.to_thread(local.warm_up)
            return self._local

    def _tables(self) -> InProcessShards:
        if self._local is None:
            raise RuntimeError("the replica holds no rows yet: seed() first")
        return self._local


def _replica_config(config: TableConfig) -> TableConfig:
    """``config`` held in RAM, with every row kept and admitted (the PS's copy still evicts,
    expires and admits)."""
    return replace(config, max_rows=None, ttl_s=None, admit_probability=1.0, admit_min_count=0,
                   storage=StorageConfig(), initial_capacity=1024)


def _untagged(layout: ShardedIds) -> ShardedIds:
    """``layout`` without its step tag: a seed is not a step's lookup for the PS's staleness
    count, and the replica counts none."""
    return replace(layout, tag=None) if layout.tag is not None else layout


def _parts(layout: ShardedIds) -> Iterator[tuple[int, str, int, int]]:
    """(shard, table, lo, hi) of every non-empty part of ``layout.ids``."""
    start = 0
    for k in range(layout.num_shards):
        for j, name in enumerate(layout.tables):
            count = int(layout.counts[k, j])
            if count:
                yield k, name, start, start + count
            start += count


def _held(local: InProcessShards, layout: ShardedIds) -> np.ndarray:
    """Per id of ``layout``: whether the replica holds its row."""
    held = np.zeros(layout.ids.size, dtype=bool)
    for k, name, lo, hi in _parts(layout):
        held[lo:hi] = local.shards[k].table(name).peek(layout.ids[lo:hi])[1]
    return held
