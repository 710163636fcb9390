"""A worker's replica of the rows it alone writes: the PS round trip off the step.

With one worker, the rows of the head ids and of the hot tables have one writer: that worker.
Where they are remote the synchronous hot chain (``services.worker.embedding.heads.HotChain``)
still waits for one round trip a step (push the step's gradients, read the rows back). A
:class:`HeadReplica` keeps those rows in the worker's process instead: one arena of rows and
optimizer state for all the tables that share an optimizer config (whatever the PS's shards),
found by one probe of a (table, id) index, updated with the PS's own optimizer kernels
(``services.ps.optimizers.apply_update``, bit for bit the PS's arithmetic). The compute thread
reads them just before its step and applies their gradients just after
(``lookup_now``/``push_now``, as with embedded shards: one call a step for all tables, not one a
table), and the same gradients go on to the PS in step order, whose copy so follows the
replica's.

A row is copied from the PS, rows and optimizer state exactly (``lookup_state_sharded``), the
first time a batch needs it (:meth:`HeadReplica.seed`, at that batch's lookup), once every
earlier batch's push is acknowledged (the worker's embedding pipeline waits for that): the copy
holds every update of the id, and so does the PS's copy after it. The replica holds its rows in
RAM without eviction, TTL or admission (the PS still applies those to its copy); optimizer
settings changed on the PS during a run (admin API) do not reach the replica, nor does a lossy
grads codec's loss.

It lives with the PS and is given by the code that builds the worker (``services.local``),
as ``services.ps.inprocess.InProcessShards`` is: the worker never imports the PS.

Usage (one worker, its rows across a network)::

    Trainer(model=..., ps_addresses=addresses, head_replica=HeadReplica())
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import msgspec
import numpy as np

from services.common.config import from_dict
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.messages import TableInfo
from services.common.sharding import ShardedIds
from services.ps.arena import gather_rows, nonfinite_rows
from services.ps.hashtable import PairHashTable
from services.ps.optimizers import apply_update, state_layout
from services.ps.table_io import PushResult
from services.ps.tables import OptimizerConfig, TableConfig

__all__ = ["HeadReplica"]


class _Source(Protocol):
    """The remote rows a replica copies from (a worker's ``StatefulRows``)."""

    async def tables(self) -> list[TableInfo]: ...

    async def lookup_state_sharded(self, layout: ShardedIds
                                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]: ...


@dataclass
class _Arena:
    """The rows and optimizer state of the tables that share one optimizer config, dim and
    storage dtype, one slot a row."""

    optimizer: OptimizerConfig
    dim: int
    dtype: np.dtype
    size: int = 0
    rows: np.ndarray = field(init=False)
    state: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        self.rows = np.empty((0, self.dim), dtype=self.dtype)
        self.state = {k: np.empty((0, *shape), dt) for k, (shape, dt)
                      in state_layout(self.optimizer, self.dim).items()}

    def add(self, rows: np.ndarray, state: dict[str, np.ndarray]) -> np.ndarray:
        """Store new rows (float32, as the PS sent them) and their state; their slots."""
        n = rows.shape[0]
        if self.size + n > self.rows.shape[0]:
            grow = max(1024, 2 * (self.size + n))
            self.rows = _grown(self.rows, grow)
            self.state = {k: _grown(v, grow) for k, v in self.state.items()}
        slots = np.arange(self.size, self.size + n)
        self.rows[slots] = rows.astype(self.dtype)
        for k, v in self.state.items():
            v[slots] = state[k]
        self.size += n
        return slots

    def read(self, slots: np.ndarray) -> np.ndarray:
        if self.dtype != np.float32:
            return self.rows[slots].astype(np.float32)
        out = np.empty((slots.shape[0], self.dim), dtype=np.float32)
        gather_rows(self.rows, slots, out)
        return out

    def apply(self, slots: np.ndarray, grads: np.ndarray) -> PushResult:
        """As a PS table applies a push of distinct held ids: non-finite rows dropped, and
        rows whose update would not be finite refused."""
        bad = np.empty(slots.shape[0], dtype=bool)
        if dropped := int(nonfinite_rows(grads, bad)):
            slots, grads = slots[~bad], grads[~bad]
        if self.dtype == np.float32:
            refused = apply_update(self.optimizer, self.rows, slots, self.state, slots, grads)
        else:
            wide = self.rows[slots].astype(np.float32)
            refused = apply_update(self.optimizer, wide, np.arange(slots.shape[0]), self.state,
                                   slots, grads, storage=self.dtype)
            self.rows[slots] = wide.astype(self.dtype)
        return PushResult(applied=int(slots.shape[0]) - refused,
                          dropped_nonfinite=dropped + refused)


def _warm_up(arenas: Sequence[_Arena]) -> None:
    """Run every kernel the replica's arenas use once, on scratch arenas of their kinds, so
    that numba loads (or compiles) them now, not during the first training steps."""
    index = PairHashTable()
    index.insert(np.zeros(4, dtype=np.int64), np.arange(4, dtype=np.uint64), np.arange(4))
    slots = index.find(np.zeros(4, dtype=np.int64), np.arange(4, dtype=np.uint64))
    for arena in arenas:
        scratch = _Arena(arena.optimizer, arena.dim, arena.dtype)
        scratch.add(np.zeros((4, arena.dim), dtype=np.float32),
                    {k: np.zeros((4, *v.shape[1:]), v.dtype) for k, v in scratch.state.items()})
        scratch.read(slots)
        scratch.apply(slots, np.zeros((4, arena.dim), dtype=np.float32))


def _grown(array: np.ndarray, rows: int) -> np.ndarray:
    out = np.empty((rows, *array.shape[1:]), dtype=array.dtype)
    out[:array.shape[0]] = array
    return out


class HeadReplica:
    """The worker's copy of the rows it alone writes (see the module doc); a
    ``services.worker.embedding.rows.RowsReplica``."""

    def __init__(self) -> None:
        # the compute thread reads and updates rows while the event loop adds copies (an
        # arena or the index may be reallocated as it grows)
        self._lock = threading.Lock()
        self.clear()

    @property
    def direct(self) -> bool:
        return True

    @property
    def num_rows(self) -> int:
        """Rows held, over every table."""
        return len(self._index)

    @property
    def num_arenas(self) -> int:
        """Row arenas: one per optimizer config, dim and storage dtype of the tables."""
        return len(self._arenas)

    def clear(self) -> None:
        """Forget every row (a new run copies them again: the PS's may have changed)."""
        self._configs: dict[str, TableConfig] | None = None
        self._number: dict[str, int] = {}  # table -> its number in the index
        self._arena_of = np.empty(0, dtype=np.int64)  # table number -> its arena
        self._arenas: list[_Arena] = []
        self._index = PairHashTable()  # (table number, id) -> slot in its table's arena
        self._numbers: dict[tuple[str, ...], np.ndarray] = {}  # per layout's tables
        # the parts of the layout read last: a step's push_now finds its rows where its
        # lookup_now did (slots never move: rows are only added, until clear())
        self._recent: tuple[ShardedIds, list[tuple[_Arena, np.ndarray | None, np.ndarray]]] \
            | None = None
        self._building = asyncio.Lock()

    def lookup_now(self, layout: ShardedIds) -> np.ndarray:
        """The held rows of ``layout`` (every id seeded first), in the calling thread."""
        with self._lock:
            parts = self._held_parts(layout)
            if len(parts) == 1 and parts[0][1] is None:
                return parts[0][0].read(parts[0][2])
            out = np.empty((layout.ids.size, parts[0][0].dim), dtype=np.float32)
            for arena, at, slots in parts:
                out[at] = arena.read(slots)
            return out

    def push_now(self, layout: ShardedIds, grads: np.ndarray) -> PushResult:
        """Apply ``grads`` to the held rows of ``layout`` now, with the PS's optimizer."""
        with self._lock:
            parts = self._held_parts(layout)
            if grads.shape != (layout.ids.size, parts[0][0].dim):
                raise InvalidArgument(f"grads must be ({layout.ids.size}, dim), got "
                                      f"{grads.shape}")
            grads = np.ascontiguousarray(grads, dtype=np.float32)
            return PushResult.total(arena.apply(slots, grads if at is None else grads[at])
                                    for arena, at, slots in parts)

    def holds(self, layout: ShardedIds) -> bool:
        """Whether the replica holds the row of every id of ``layout``."""
        with self._lock:
            return self._configs is not None and bool((self._slots(layout) >= 0).all())

    def held(self) -> dict[str, np.ndarray]:
        """The ids of the rows held, per table."""
        with self._lock:
            tables, ids, _ = self._index.items()
        return {name: ids[tables == number] for name, number in self._number.items()}

    async def seed(self, source: _Source, layout: ShardedIds) -> int:
        """Copy the rows of ``layout``'s ids not held yet from ``source`` (rows and optimizer
        state, exactly); returns how many it copied."""
        await self._build(source)
        with self._lock:
            missing = layout.subset(self._slots(layout) < 0)
        if not missing.ids.size:
            return 0
        rows, state = await source.lookup_state_sharded(
            replace(missing, tag=None))  # a copy, not a step's lookup (the PS's staleness count)
        with self._lock:
            return self._add(missing, rows, state)

    def _add(self, missing: ShardedIds, rows: np.ndarray, state: dict[str, np.ndarray]) -> int:
        """Hold the copied rows of ``missing`` not held yet; how many."""
        numbers = self._table_numbers(missing)
        fresh = self._index.find(numbers, missing.ids) < 0  # an overlapping seed copied some
        for k, arena in enumerate(self._arenas):
            at = np.flatnonzero(fresh & (self._arena_of[numbers] == k))
            if at.size:
                slots = arena.add(rows[at], {key: v[at] for key, v in state.items()})
                self._index.insert(numbers[at], missing.ids[at], slots)
        return int(fresh.sum())

    async def _build(self, source: _Source) -> None:
        """The replica's tables and arenas, from ``source``'s configs at the first seed."""
        async with self._building:
            if self._configs is not None:
                return
            configs = [from_dict(TableConfig, msgspec.to_builtins(t), where="table")
                       for t in await source.tables()]
            kinds: dict[str, int] = {}  # an arena per optimizer config, dim and dtype
            arena_of = []
            for config in configs:
                kind = repr((config.optimizer, config.dim, config.storage_dtype))
                if kind not in kinds:
                    kinds[kind] = len(self._arenas)
                    self._arenas.append(_Arena(config.optimizer, config.dim,
                                               config.storage_dtype))
                arena_of.append(kinds[kind])
            await asyncio.to_thread(_warm_up, self._arenas)  # numba's kernels, off the loop
            self._number = {c.name: j for j, c in enumerate(configs)}
            self._arena_of = np.array(arena_of, dtype=np.int64)
            self._configs = {c.name: c for c in configs}

    def _table_numbers(self, layout: ShardedIds) -> np.ndarray:
        """Per id of ``layout``: its table's number."""
        key = tuple(layout.tables)
        if (numbers := self._numbers.get(key)) is None:
            try:
                numbers = self._numbers[key] = np.array([self._number[n] for n in key],
                                                        dtype=np.int64)
            except KeyError as exc:
                raise InvalidArgument(f"the replica has no table {exc.args[0]!r}") from None
        return numbers[layout.table_index()]

    def _slots(self, layout: ShardedIds) -> np.ndarray:
        return self._index.find(self._table_numbers(layout), layout.ids)

    def _held_parts(self, layout: ShardedIds
                    ) -> list[tuple[_Arena, np.ndarray | None, np.ndarray]]:
        """Per arena: where ``layout``'s ids of it are (None: all of them) and their slots."""
        if self._recent is not None and self._recent[0] is layout:
            return self._recent[1]
        if self._configs is None:
            raise FailedPrecondition("the replica holds no rows yet: seed() first")
        numbers = self._table_numbers(layout)
        slots = self._index.find(numbers, layout.ids)
        if (slots < 0).any():
            raise FailedPrecondition(f"the replica holds {int((slots < 0).sum())} of these "
                                     "rows not: seed() them first")
        if len(self._arenas) == 1:
            parts: list[tuple[_Arena, np.ndarray | None, np.ndarray]] = [
                (self._arenas[0], None, slots)]
        else:
            arenas = self._arena_of[numbers]
            parts = [(arena, at, slots[at]) for k, arena in enumerate(self._arenas)
                     if (at := np.flatnonzero(arenas == k)).size]
        self._recent = (layout, parts)
        return parts
