"""One PS shard's state: its tables, ownership checks, limits, lookups and pushes.

Transport-free: the gRPC servicer and the admin REST API both call this. Every method
validates first and mutates after, so a rejected request changes nothing. Table work runs
under one lock per table: on the event loop for requests of at most ``INLINE_IDS`` ids whose
tables are free, in worker threads (``asyncio.to_thread``) otherwise. A push holds the locks of
all its tables (taken in name order, as a checkpoint and a restore take them) while it is
applied, to the tables it was validated against: a push comes wholly before a restore (rolled
back) or after it (validated again, logged in the log's new segment).

A push may name its ``origin`` (client id, sequence number; every push over the wire does):
it is then applied at most once, a retry answered with the first ack
(:mod:`services.ps.dedup`); the window of applied pushes is saved and restored with the
tables. In-process callers, which cannot retry over a wire, may leave it out.

With ``wal_dir`` configured, every push and table change is appended to the shard's
write-ahead log (:mod:`services.ps.wal`) after it is validated and before it is applied and
acknowledged (a table create after the table is built: a create that fails is never logged);
a log that fails refuses pushes (UNAVAILABLE) until it is cut back. Checkpoints, restores,
epochs and recovery from the log are the shard's :class:`services.ps.durability.Durable` part.
A push is fenced by its epoch: the one it carries (one that carries none, from a client that
never learned an epoch, only while the shard was never restored), an in-process one by the
shard's when it was received; it is checked under its tables' locks, so one received before a
restore is never applied after.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from services.common.admin_replies import Row, TableDescription
from services.common.config import ConfigError, from_dict
from services.common.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    WrongShard,
)
from services.common.messages import StatsReply
from services.common.sharding import shard_of
from services.ps.config import PSConfig
from services.ps.dedup import PushOrigin, PushWindow, fingerprint
from services.ps.durability import Durable
from services.ps.locks import hold
from services.ps.multitable import dim_groups, lookup_plain, push_plain, warm_up_groups
from services.ps.optimizers import state_layout
from services.ps.pooled import check_lengths, segment_sum
from services.ps.segments import OsSegmentFile, SegmentOpener
from services.ps.staleness import GlobalStaleness
from services.ps.store import EmbeddingTable, PushResult
from services.ps.tables import OptimizerConfig, TableConfig, table_info
from services.ps.wal import PushPart, WalFsync, WriteAheadLog
from services.ps.wal_records import (
    CreateRecord,
    DropRecord,
    OptimizerRecord,
    PushRecord,
    WalRecord,
)

__all__ = ["INLINE_IDS", "Shard"]

T = TypeVar("T")
LookupParts = tuple[Sequence[str], Sequence[int], np.ndarray]  # tables, counts, ids
PushParts = tuple[Sequence[str], Sequence[int], np.ndarray, Any]  # ... and the grads
Checked = tuple[Callable[[], int], list[PushPart], list[EmbeddingTable]]  # see _push_once
INLINE_IDS = 16_384  # requests up to this many ids: served on the event loop (~0.2 ms)


class Shard(Durable):
    """The tables of shard ``config.shard_id`` of ``config.num_shards``."""

    def __init__(self, config: PSConfig, *, open_segment: SegmentOpener = OsSegmentFile) -> None:
        """``open_segment`` opens the log's segment files for appending."""
        self.config = config
        self.epoch = 1  # a restore moves it on (services.ps.durability)
        self.tables: dict[str, EmbeddingTable] = {}
        self._locks: dict[str, threading.RLock] = {}  # re-entered by work served inline
        self._layout = threading.Lock()  # which tables there are: create, drop, restore
        self._ckpt_lock = asyncio.Lock()
        self._last_checkpoint: str | None = None
        self.pushes = PushWindow(max_clients=config.push_clients)  # see services.ps.dedup
        self.staleness = GlobalStaleness()  # of the tagged lookups (services.ps.staleness)
        self.wal: WriteAheadLog | None = None  # after the configured tables: not logged
        for table_config in config.tables:
            self.create_table(table_config)
        if config.wal_dir is not None:
            self.wal = WriteAheadLog(
                config.wal_dir, shard_id=config.shard_id, num_shards=config.num_shards,
                fsync=config.wal_fsync, fsync_interval_s=config.wal_fsync_interval_ms / 1000,
                segment_bytes=config.wal_segment_bytes, open_file=open_segment)

    # ---- tables -------------------------------------------------------------------------

    def table(self, name: str) -> EmbeddingTable:
        try:
            return self.tables[name]
        except KeyError:
            raise NotFound(f"table {name!r} does not exist on shard {self.config.shard_id}; "
                           f"tables: {sorted(self.tables)}") from None

    def dim_groups(self) -> list[list[str]]:
        """The tables' names by dim (:func:`services.ps.multitable.dim_groups`)."""
        return dim_groups(self.tables)

    def warm_up(self, groups: Sequence[Sequence[str]] | None = None) -> None:
        """Load, before the first request, the kernels of requests of each of ``groups`` of
        tables (default: :meth:`dim_groups`; :func:`services.ps.multitable.warm_up_groups`)."""
        warm_up_groups([[self.table(name).config for name in group]
                        for group in (self.dim_groups() if groups is None else groups)])

    def create_table(self, table_config: TableConfig | dict[str, Any]) -> EmbeddingTable:
        if isinstance(table_config, dict):
            table_config = from_dict(TableConfig, table_config, where="table")
        with self._layout:
            if table_config.name in self.tables:
                raise AlreadyExists(f"table {table_config.name!r} already exists")
            if len(self.tables) >= self.config.max_tables:
                raise ResourceExhausted(
                    f"shard holds the maximum of {self.config.max_tables} tables")
            table = EmbeddingTable(table_config)  # built, then logged: a failed one never is
            self._log(CreateRecord.of, table_config)
            self._locks[table_config.name] = threading.RLock()
            self.tables[table_config.name] = table
        return table

    def drop_table(self, name: str) -> None:
        with self._layout, self._locked(name):
            self._log(DropRecord.of, name)
            del self.tables[name]
            del self._locks[name]

    def stats(self, table: str | None = None) -> StatsReply:
        """The counters, sizes and staleness of ``table`` or of every table (what Stats
        answers)."""
        tables = [self.table(table)] if table is not None else list(self.tables.values())
        return StatsReply(shard_id=self.config.shard_id, epoch=self.epoch,
                          tables={t.config.name: self.staleness.stats(t.stats())
                                  for t in tables})

    def describe(self, name: str) -> TableDescription:
        table = self.table(name)
        return TableDescription(config=table_info(table.config), stats=table.stats(),
                                epoch=self.epoch)

    def set_optimizer(self, name: str, changes: dict[str, Any]) -> OptimizerConfig:
        if not isinstance(changes, dict) or not changes:
            raise InvalidArgument("optimizer changes must be a non-empty object, e.g. {\"lr\": 0.05}")
        with self._layout, self._locked(name) as table:
            try:
                table.config.optimizer_with(changes)  # checked first,
            except ConfigError as exc:
                raise InvalidArgument(f"bad optimizer settings {changes}: {exc}") from exc
            self._log(OptimizerRecord.of, name, changes)  # logged,
            return table.set_optimizer(**changes)  # then applied

    # ---- lookups and pushes -------------------------------------------------------------

    def check_ids(self, ids: np.ndarray) -> np.ndarray:
        """Reject ids of the wrong dtype, too many, or owned by another shard."""
        if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
            raise InvalidArgument("ids must be a 1-d uint64 array")
        if ids.size > self.config.max_ids_per_request:
            raise InvalidArgument(f"{ids.size} ids exceed the limit of "
                                  f"{self.config.max_ids_per_request} per request")
        if self.config.num_shards > 1 and ids.size:
            owners = shard_of(ids, self.config.num_shards)
            foreign = owners != self.config.shard_id
            if foreign.any():
                bad = ids[foreign]
                raise WrongShard(
                    f"{bad.size} ids do not belong to shard {self.config.shard_id} of "
                    f"{self.config.num_shards} (e.g. id {int(bad[0])} belongs to shard "
                    f"{int(owners[foreign][0])}); route with shard_of()")
        return ids

    def lookup_sync(self, name: str, ids: np.ndarray) -> np.ndarray:
        self.table(name).validate_lookup(self.check_ids(ids))
        with self._locked(name) as table:
            return table.lookup(ids)

    def push_sync(self, name: str, ids: np.ndarray, grads: np.ndarray, *,
                  origin: PushOrigin | None = None, fence: int | None = None) -> PushResult:
        def check() -> Checked:
            table = self.table(name)
            i, g = table.validate_push(self.check_ids(ids), grads)
            return lambda: fingerprint((name,), [i], [g]), [(name, i, g)], [table]
        return self._push_once(check, origin, fence)

    def _push_once(self, check: Callable[[], Checked], origin: PushOrigin | None,
                   fence: int | None) -> PushResult:
        """Apply the push that ``check()`` validates (its fingerprint, its parts and the
        tables it validated them against) at most once per ``origin``, under the pushed
        tables' locks, if the shard is in epoch ``fence`` then (None: any); validated again
        if a drop replaced a table meanwhile."""
        while True:
            content, parts, tables = check()
            names = [name for name, _, _ in parts]
            with self.holding(names) as held:
                if held and all(self.tables.get(name) is table
                                for name, table in zip(names, tables, strict=True)):
                    return self._once(origin, content, parts, fence)

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[EmbeddingTable]:
        """Table ``name`` under its lock; NotFound if it is dropped, before or meanwhile."""
        lock = self._locks.get(name)
        with lock if lock is not None else contextlib.nullcontext():
            yield self.table(name)

    @contextlib.contextmanager
    def holding(self, names: Sequence[str]) -> Iterator[bool]:
        """Hold the locks of tables ``names`` (no push, lookup or checkpoint of them runs
        meanwhile), taken in name order (deadlock-free with a checkpoint, which takes every
        table's in that order); yields False where one has none (gone)."""
        locks = [self._locks.get(name) for name in sorted(set(names))]
        with hold([lock for lock in locks if lock is not None]):
            yield None not in locks

    def _once(self, origin: PushOrigin | None, content: Callable[[], int],
              parts: Sequence[PushPart], fence: int | None) -> PushResult:
        """Apply the validated ``parts``, at most once per ``origin``, if the shard is in
        epoch ``fence``: a retry (same ``content()`` fingerprint) gets the first ack; logged
        first (no log while a replay reads it). The caller holds the pushed tables' locks, so
        the epoch, the window, the log and the rows change together."""
        self.check_epoch(fence)
        if origin is None or not self.config.idempotent_pushes:
            self._log(PushRecord.of, None, 0, parts)
            return self._apply(parts)
        window = self.pushes
        fp = content()
        done = window.claim(origin, fp)
        if done is not None:
            return done
        try:
            self._log(PushRecord.of, origin, fp, parts)
            result = self._apply(parts)
        except BaseException:
            window.abandon(origin)
            raise
        window.commit(origin, result)
        return result

    def _apply(self, parts: Sequence[PushPart]) -> PushResult:
        tables = [self.table(name) for name, _, _ in parts]
        results = push_plain(tables, [ids for _, ids, _ in parts], [g for _, _, g in parts]) \
            or [t.push(ids, grads) for t, (_, ids, grads) in zip(tables, parts, strict=True)]
        self.staleness.pushed([name for name, _, _ in parts])
        return PushResult.total(results)

    def _fence(self, origin: PushOrigin | None) -> int:
        """The epoch of a push received now: the one it carries; 0 for a wire push that
        carries none (its client never learned an epoch: accepted only while the shard is in
        its first, :meth:`check_epoch`); the shard's for an in-process call (no origin)."""
        return origin.epoch if origin is not None else self.epoch

    def _log(self, record: Callable[..., WalRecord], *args: Any) -> None:
        if self.wal is not None:  # a record is built only when there is a log
            self.wal.append(record(*args))

    async def lookup(self, name: str, ids: np.ndarray) -> np.ndarray:
        return await self._serve([name], np.size(ids), self.lookup_sync, name, ids)

    async def _serve(self, tables: Sequence[str], num_ids: int, work: Callable[..., T],
                     *args: Any, push: bool = False) -> T:
        """``work(*args)`` on the event loop when the request is small and no table it touches
        is busy (a checkpoint holds them): a thread hop costs more than such a request. Else
        in a worker thread, so that the loop goes on serving; a ``push`` too when the log
        fsyncs before each ack."""
        syncs = push and self.wal is not None and self.wal.fsync is WalFsync.ALWAYS
        if num_ids <= INLINE_IDS and not syncs:
            taken: list[threading.RLock] = []
            try:
                for name in dict.fromkeys(tables):
                    lock = self._locks.get(name)
                    if lock is not None:
                        if not lock.acquire(blocking=False):
                            break
                        taken.append(lock)
                else:
                    return work(*args)
            finally:
                for lock in reversed(taken):
                    lock.release()
        return await asyncio.to_thread(work, *args)

    # Several tables in one request (a worker's whole step): ``ids`` holds each table's ids
    # one after the other (``counts`` per table). Every check is done before any part is
    # served or applied.

    def _table_slices(self, tables: Sequence[str], counts: Sequence[int], ids: np.ndarray
                      ) -> tuple[list[tuple[str, np.ndarray]], int, list[int]]:
        """The (table, ids) parts of a multi-table request, the tables' common dim and the
        parts' bounds in ``ids``."""
        if not tables:
            raise InvalidArgument("a multi-table request needs at least one table")
        if len(set(tables)) != len(tables):
            raise InvalidArgument(f"a multi-table request names a table twice: {list(tables)}")
        if len(counts) != len(tables):
            raise InvalidArgument(f"{len(counts)} counts for {len(tables)} tables")
        self.check_ids(ids)
        if any(count < 0 for count in counts):
            raise InvalidArgument(f"counts must not be negative, got {list(counts)}")
        bounds = list(itertools.accumulate(counts, initial=0))
        if bounds[-1] != ids.size:
            raise InvalidArgument(f"the counts add up to {bounds[-1]} but there are "
                                  f"{ids.size} ids")
        dims = [self.table(name).dim for name in tables]
        if len(set(dims)) != 1:
            raise InvalidArgument("the tables of one request must have one dim, got "
                                  f"{dict(zip(tables, dims, strict=True))}")
        return ([(name, ids[lo:hi])
                 for name, lo, hi in zip(tables, bounds[:-1], bounds[1:], strict=True)],
                dims[0], bounds)

    def lookup_many_sync(self, tables: Sequence[str], counts: Sequence[int],
                         ids: np.ndarray, *, read_only: bool = False,
                         state: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """Rows ``(len(ids), dim)`` of several tables' ids, in request order. ``read_only``:
        change nothing (no row created or marked used; see :meth:`EmbeddingTable.peek`).
        ``state`` is filled with the rows' optimizer state by name, read with them (tables of
        one state layout only): what a worker's replica of the rows starts from."""
        parts, dim, _ = self._table_slices(tables, counts, ids)
        if state is not None and len({repr(state_layout(self.table(t).config.optimizer, dim))
                                      for t in tables}) > 1:
            raise InvalidArgument(f"the tables {list(tables)} keep optimizer states of "
                                  "different layouts: look their state up apart")
        return self._lookup_slices(parts, dim, ids.size, read_only=read_only, state=state)

    def _lookup_slices(self, parts: list[tuple[str, np.ndarray]], dim: int, num_ids: int, *,
                       read_only: bool = False, state: dict[str, np.ndarray] | None = None
                       ) -> np.ndarray:
        held = [self.table(name) for name, _ in parts]
        if not read_only and state is None and (out := lookup_plain(
                held, [p for _, p in parts], dim)) is not None:
            for (name, _), table in zip(parts, held, strict=True):
                if self.tables.get(name) is not table:  # dropped while the lookup waited
                    self.table(name)  # NotFound
                    raise NotFound(f"table {name!r} was dropped during the lookup")
                self.staleness.looked_up(name)
            return out
        out = np.empty((num_ids, dim), dtype=np.float32)
        states: list[dict[str, np.ndarray]] = []
        start = 0
        for name, part in parts:
            with self._locked(name) as table:
                if read_only:
                    out[start:start + part.size] = table.peek(part)[0]
                else:
                    out[start:start + part.size] = table.lookup(part)
                    self.staleness.looked_up(name)
                if state is not None:
                    states.append(table.state_of(part))
            start += part.size
        if state is not None and states:
            state.update({k: np.concatenate([s[k] for s in states]) for k in states[0]})
        return out

    def push_many_sync(self, tables: Sequence[str], counts: Sequence[int], ids: np.ndarray,
                       grads: np.ndarray | Sequence[np.ndarray], *,
                       origin: PushOrigin | None = None, fence: int | None = None) -> PushResult:
        """Apply several tables' gradients: one ``(len(ids), dim)`` array, or one array per
        table (all tables or none, at most once per ``origin``, only in epoch ``fence``)."""
        sampled = [grads] if isinstance(grads, np.ndarray) else list(grads)

        def check() -> Checked:
            parts, dim, bounds = self._table_slices(tables, counts, ids)
            held = [self.table(name) for name, _ in parts]
            if isinstance(grads, np.ndarray):  # checked whole, then sliced
                if grads.shape != (ids.size, dim) or grads.dtype.kind != "f":
                    raise InvalidArgument(f"grads must be floats ({ids.size} ids, dim {dim}), "
                                          f"got {grads.dtype} {grads.shape}")
                whole = np.ascontiguousarray(grads, dtype=np.float32)
                checked = [(name, part, whole[lo:hi]) for (name, part), lo, hi
                           in zip(parts, bounds[:-1], bounds[1:], strict=True)]
            elif len(grads) != len(parts):
                raise InvalidArgument(f"{len(grads)} gradient arrays for {len(parts)} tables")
            else:
                checked = [(name, *table.validate_push(part, g)) for (name, part), g, table
                           in zip(parts, grads, held, strict=True)]
            return (lambda: fingerprint((tuple(tables), tuple(counts)), [ids], sampled),
                    checked, held)
        return self._push_once(check, origin, fence)

    def push_then_lookup_sync(self, push: PushParts, lookup: LookupParts, *,
                              origin: PushOrigin | None = None, fence: int | None = None
                              ) -> tuple[PushResult, np.ndarray]:
        """Apply a multi-table push (at most once per ``origin``), then serve a multi-table
        lookup (its rows include the push): both parts are checked before the push is
        applied."""
        parts, dim, _ = self._table_slices(*lookup)
        return (self.push_many_sync(*push, origin=origin, fence=fence),
                self._lookup_slices(parts, dim, lookup[2].size))

    async def push_then_lookup(self, push: PushParts, lookup: LookupParts, *,
                               origin: PushOrigin | None = None
                               ) -> tuple[PushResult, np.ndarray]:
        return await self._serve([*push[0], *lookup[0]], np.size(push[2]) + np.size(lookup[2]),
                                 functools.partial(self.push_then_lookup_sync, origin=origin,
                                                   fence=self._fence(origin)),
                                 push, lookup, push=True)

    async def lookup_many(self, tables: Sequence[str], counts: Sequence[int],
                          ids: np.ndarray, *, read_only: bool = False,
                          state: dict[str, np.ndarray] | None = None) -> np.ndarray:
        return await self._serve(tables, np.size(ids), functools.partial(
            self.lookup_many_sync, read_only=read_only, state=state), tables, counts, ids)

    async def push_many(self, tables: Sequence[str], counts: Sequence[int], ids: np.ndarray,
                        grads: np.ndarray | Sequence[np.ndarray], *,
                        origin: PushOrigin | None = None) -> PushResult:
        return await self._serve(tables, np.size(ids),
                                 functools.partial(self.push_many_sync, origin=origin,
                                                   fence=self._fence(origin)),
                                 tables, counts, ids, grads, push=True)

    # DES-style partial pooling: the shard pools the rows it owns, per sample.

    def pooled_lookup_sync(self, name: str, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Per-sample sums of the rows of ``ids`` (sample ``b`` owns the next ``lengths[b]``
        ids): ``(len(lengths), dim)`` float32, zeros for a sample with none here."""
        self.table(name).validate_lookup(self.check_ids(ids))
        lengths = check_lengths(ids, lengths, self.config.max_ids_per_request)
        with self._locked(name) as table:
            rows = table.lookup(ids)
        return segment_sum(rows, lengths)

    def pooled_push_sync(self, name: str, ids: np.ndarray, lengths: np.ndarray,
                         grads: np.ndarray, *, origin: PushOrigin | None = None,
                         fence: int | None = None) -> PushResult:
        """Apply the per-sample pooled gradients ``grads`` (``(len(lengths), dim)``): each id
        of sample ``b`` gets ``grads[b]`` (summed over its occurrences) — sum pooling's
        backward, done here (at most once per ``origin``)."""
        def check() -> Checked:
            table = self.table(name)
            counts = check_lengths(self.check_ids(ids), lengths,
                                   self.config.max_ids_per_request)
            if not isinstance(grads, np.ndarray) or grads.ndim != 2 \
                    or grads.shape[0] != counts.size:
                raise InvalidArgument(f"pooled grads must be (samples, dim) = ({counts.size}, "
                                      f"{table.config.dim}), got "
                                      f"{getattr(grads, 'shape', type(grads).__name__)}")
            i, expanded = table.validate_push(ids, np.repeat(grads, counts, axis=0))
            return (lambda: fingerprint((name,), [i, counts], [grads]), [(name, i, expanded)],
                    [table])
        return self._push_once(check, origin, fence)

    async def pooled_lookup(self, name: str, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        return await self._serve([name], np.size(ids), self.pooled_lookup_sync, name, ids, lengths)

    async def pooled_push(self, name: str, ids: np.ndarray, lengths: np.ndarray,
                          grads: np.ndarray, *, origin: PushOrigin | None = None) -> PushResult:
        return await self._serve([name], np.size(ids),
                                 functools.partial(self.pooled_push_sync, origin=origin,
                                                   fence=self._fence(origin)),
                                 name, ids, lengths, grads, push=True)

    async def push(self, name: str, ids: np.ndarray, grads: np.ndarray, *,
                   origin: PushOrigin | None = None) -> PushResult:
        return await self._serve([name], np.size(ids),
                                 functools.partial(self.push_sync, origin=origin,
                                                   fence=self._fence(origin)),
                                 name, ids, grads, push=True)

    def peek(self, name: str, row_id: int) -> Row:
        if not 0 <= row_id < 2**64:
            raise InvalidArgument(f"id {row_id} is not a uint64")
        ids = self.check_ids(np.array([row_id], dtype=np.uint64))
        with self._locked(name) as table:
            rows, present = table.peek(ids)
        return Row(id=row_id, present=bool(present[0]), row=rows[0].tolist())

    def expire(self) -> int:
        dropped = 0
        for name in list(self.tables):
            with contextlib.suppress(NotFound), self._locked(name) as table:
                dropped += table.expire()
        return dropped

    def close(self) -> None:
        """Sync and close the write-ahead log, if any."""
        if self.wal is not None:
            self.wal.close()

