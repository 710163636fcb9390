"""The in-memory embedding table of one PS shard: hash index + row arena + optimizer state.

Layout: an :class:`~services.ps.hashtable.IdHashTable` maps id → slot; slot ``s`` owns
``rows[s]`` (storage dtype), the optimizer state rows ``state[name][s]`` and per-slot
bookkeeping (id, live flag, last-use tick and time, use count, dirty flag). Freed slots go on
a free list; the arena and the index grow by doubling. Every public method works on whole
batches (numpy and numba, no Python loop per id) and holds the table's lock, so the gRPC
server may call it from worker threads.

Row life cycle: a row is created on first sight (lookup or push) once admitted, with the
deterministic :func:`~services.ps.tables.initial_rows`; it is dropped by eviction (when
``max_rows`` is reached, LRU or LFU, never an id of the batch being served), by TTL
(:meth:`EmbeddingTable.expire`) or by :meth:`EmbeddingTable.delete`, leaving a tombstone for
the next snapshot. An id without a row always reads as its initial row.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from services.common.errors import ConfigError, FailedPrecondition, InvalidArgument
from services.ps.hashtable import (
    IdHashTable,
    dedup_slots,
    gather_rows,
    nonfinite_rows,
    sum_rows_by_slot,
    touch_slots,
    unique_inverse,
)
from services.ps.optimizers import apply_update, init_state, state_layout
from services.ps.tables import (
    EvictionPolicy,
    OptimizerConfig,
    TableConfig,
    admission_uniform,
    initial_rows,
)

__all__ = ["EmbeddingTable", "PushResult", "TableSnapshot", "warm_up"]

_COUNTERS = ("lookups", "pushes", "ids_looked_up", "ids_pushed", "misses", "evictions",
             "expired", "deleted", "dropped_nonfinite", "not_admitted")
_META = {"tick": np.int64, "uses": np.int64}


@dataclass(slots=True)
class PushResult:
    """What a push did, counted in unique ids."""

    applied: int = 0
    dropped_nonfinite: int = 0
    not_admitted: int = 0


@dataclass(slots=True)
class TableSnapshot:
    """Rows of a table (all, or those changed since the previous snapshot) and tombstones.

    ``rows`` are float32 in ``ids`` order (ids sorted ascending); ``state`` holds the
    optimizer state rows by name; ``meta`` the eviction bookkeeping (``tick``, ``uses``);
    ``tombstones`` the ids dropped since the previous snapshot. Restoring applies the
    tombstones first, then the rows.
    """

    config: TableConfig
    ids: np.ndarray
    rows: np.ndarray
    state: dict[str, np.ndarray]
    tombstones: np.ndarray
    incremental: bool = False
    meta: dict[str, np.ndarray] = field(default_factory=dict)


def _committed(shape: tuple[int, ...], dtype: Any, fill: int = 0) -> np.ndarray:
    """An array whose memory is written now (``np.zeros`` would defer the page faults to the
    first batches that touch it): the arena is preallocated for real."""
    a = np.empty(shape, dtype=dtype)
    a.fill(fill)
    return a


def _smallest(k: int, primary: np.ndarray, secondary: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Positions of the k smallest entries by (primary, secondary, id), in O(n) + ties."""
    if k >= primary.shape[0]:
        return np.arange(primary.shape[0])
    kth = primary[np.argpartition(primary, k - 1)[k - 1]]
    below = np.flatnonzero(primary < kth)
    ties = np.flatnonzero(primary == kth)
    order = np.lexsort((ids[ties], secondary[ties]))
    return np.concatenate([below, ties[order[:k - below.shape[0]]]])


class EmbeddingTable:
    """One embedding table held in memory, with its optimizer, admission and eviction."""

    def __init__(self, config: TableConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.dim = config.dim
        self._clock = clock
        self._lock = threading.RLock()
        self._dtype = config.storage_dtype
        cap = int(config.initial_capacity)
        self._index = IdHashTable(cap)
        self._pending = IdHashTable(64)  # sightings of ids not admitted yet
        self._rows = _committed((cap, self.dim), self._dtype)
        self._state = {name: _committed((cap, *shape), dt)
                       for name, (shape, dt) in state_layout(config.optimizer, self.dim).items()}
        self._slot_ids = _committed((cap,), np.uint64)
        self._live = _committed((cap,), bool)
        self._dirty = _committed((cap,), bool)
        self._ticks = _committed((cap,), np.int64)
        self._uses = _committed((cap,), np.int64)
        self._last_used = _committed((cap,), np.float64)
        self._mark = _committed((cap,), np.int64, -1)  # scratch of push: slot -> position
        self._free = np.empty(0, dtype=np.int64)  # stack of freed slots below _high
        self._high = 0  # slots >= _high were never used
        self._num_live = 0
        self._tick = 0
        self._tombstones: list[np.ndarray] = []
        self._counters = dict.fromkeys(_COUNTERS, 0)

    # ----------------------------------------------------------------- validation

    def validate_lookup(self, ids: Any) -> np.ndarray:
        """``ids`` as a contiguous uint64 vector, or :class:`InvalidArgument`."""
        name = self.config.name
        if not isinstance(ids, np.ndarray):
            raise InvalidArgument(f"table {name}: ids must be a numpy array, got {type(ids).__name__}")
        if ids.ndim != 1:
            raise InvalidArgument(f"table {name}: ids must be 1-D, got shape {ids.shape}")
        if ids.dtype == np.uint64:
            return np.ascontiguousarray(ids)
        if ids.dtype.kind not in "iu":
            raise InvalidArgument(f"table {name}: ids must be uint64, got dtype {ids.dtype}")
        if ids.dtype.kind == "i" and ids.size and ids.min() < 0:
            raise InvalidArgument(f"table {name}: ids must be non-negative, got {ids.min()}")
        return ids.astype(np.uint64)

    def validate_push(self, ids: Any, grads: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(ids uint64, grads float32 (n, dim))`` or :class:`InvalidArgument`."""
        ids = self.validate_lookup(ids)
        name = self.config.name
        if not isinstance(grads, np.ndarray):
            raise InvalidArgument(f"table {name}: grads must be a numpy array, "
                                  f"got {type(grads).__name__}")
        if grads.dtype.kind != "f":
            raise InvalidArgument(f"table {name}: grads must be float32, got dtype {grads.dtype}")
        if grads.ndim != 2:
            raise InvalidArgument(f"table {name}: grads must be 2-D (n, {self.dim}), "
                                  f"got shape {grads.shape}")
        if grads.shape[1] != self.dim:
            raise InvalidArgument(f"table {name}: grads have dim {grads.shape[1]}, "
                                  f"the table has dim {self.dim}")
        if grads.shape[0] != ids.shape[0]:
            raise InvalidArgument(f"table {name}: {ids.shape[0]} ids but {grads.shape[0]} "
                                  f"gradient rows")
        return ids, np.ascontiguousarray(grads, dtype=np.float32)

    # ----------------------------------------------------------------- reads

    @property
    def num_rows(self) -> int:
        return self._num_live

    def initial_rows(self, ids: Any) -> np.ndarray:
        """The deterministic initial rows of ``ids`` (float32); stores nothing."""
        return initial_rows(self.config, self.validate_lookup(ids))

    def peek(self, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, present)``: current rows (initial rows where absent); changes nothing."""
        ids = self.validate_lookup(ids)
        with self._lock:
            slots = self._index.find(ids)
            return self._gather(ids, slots), slots >= 0

    def ids(self) -> np.ndarray:
        """Every id that has a row, sorted."""
        with self._lock:
            return np.sort(self._slot_ids[:self._high][self._live[:self._high]])

    def lookup(self, ids: Any) -> np.ndarray:
        """Rows of ``ids`` (float32, request order); creates admitted rows, marks rows used."""
        ids = self.validate_lookup(ids)
        with self._lock:
            self._counters["lookups"] += 1
            self._counters["ids_looked_up"] += ids.shape[0]
            slots = self._index.find(ids)
            missing = slots < 0
            if missing.any():
                pos = np.flatnonzero(missing)
                mids, inv = unique_inverse(ids[pos])
                created = self._admit_and_create(mids, protected=slots[~missing])
                slots[pos] = created[inv]
            self._mark_used(slots)
            return self._gather(ids, slots)

    def _gather(self, ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        out = np.empty((ids.shape[0], self.dim), dtype=np.float32)
        if self._dtype == np.float32:
            gather_rows(self._rows, slots, out)
        else:
            valid = slots >= 0
            out[valid] = self._rows[slots[valid]]
        absent = slots < 0
        if absent.any():
            out[absent] = initial_rows(self.config, ids[absent])
        return out

    # ----------------------------------------------------------------- writes

    def push(self, ids: Any, grads: Any) -> PushResult:
        """Apply gradients (duplicates summed first); non-finite ones are dropped and counted."""
        ids, grads = self.validate_push(ids, grads)
        with self._lock:
            self._counters["pushes"] += 1
            self._counters["ids_pushed"] += ids.shape[0]
            slots = self._index.find(ids)
            missing = slots < 0
            dropped = not_admitted = 0
            if missing.any():
                dropped, not_admitted = self._push_missing(ids, grads, slots, missing)
            uslots, summed = self._sum_by_slot(slots, grads)
            bad = np.empty(uslots.shape[0], dtype=bool)
            if nonfinite_rows(summed, bad):
                dropped += int(bad.sum())
                uslots, summed = uslots[~bad], summed[~bad]
            self._counters["dropped_nonfinite"] += dropped
            self._counters["not_admitted"] += not_admitted
            self._apply(uslots, summed)
            self._dirty[uslots] = True
            self._mark_used(uslots)
            return PushResult(applied=int(uslots.shape[0]), dropped_nonfinite=dropped,
                              not_admitted=not_admitted)

    def _push_missing(self, ids: np.ndarray, grads: np.ndarray, slots: np.ndarray,
                      missing: np.ndarray) -> tuple[int, int]:
        """Create rows for pushed ids without one; returns (dropped, not admitted) counts.

        Ids whose gradient holds NaN/Inf are neither sighted nor created; ids that are not
        admitted keep slot -1, so their gradients are ignored.
        """
        pos = np.flatnonzero(missing)
        mids, inv = unique_inverse(ids[pos])
        row_bad = np.empty(pos.shape[0], dtype=bool)
        bad = np.zeros(mids.shape[0], dtype=bool)
        if nonfinite_rows(grads[pos], row_bad):
            bad[inv[row_bad]] = True
        good = np.flatnonzero(~bad)
        mslots = np.full(mids.shape[0], -1, dtype=np.int64)
        mslots[good] = self._admit_and_create(mids[good], protected=slots[~missing])
        slots[pos] = mslots[inv]
        return int(bad.sum()), int((mslots[good] < 0).sum())

    def _sum_by_slot(self, slots: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(unique slots >= 0, their summed gradients); no copy when nothing repeats."""
        n = slots.shape[0]
        uslots = np.empty(n, dtype=np.int64)
        first = np.empty(n, dtype=np.int64)
        k, dups = dedup_slots(slots, self._mark, uslots, first)
        uslots = uslots[:k]
        if not dups:
            summed = grads if k == n else grads[first[:k]]
        else:
            summed = np.zeros((k, self.dim), dtype=np.float32)
            sum_rows_by_slot(slots, self._mark, grads, summed)
        self._mark[uslots] = -1
        return uslots, summed

    def _apply(self, slots: np.ndarray, grads: np.ndarray) -> None:
        opt = self.config.optimizer
        if self._dtype == np.float32:
            apply_update(opt, self._rows, slots, self._state, slots, grads)
            return
        wide = self._rows[slots].astype(np.float32)
        apply_update(opt, wide, np.arange(slots.shape[0]), self._state, slots, grads)
        self._rows[slots] = wide.astype(self._dtype)

    def set_optimizer(self, **changes: Any) -> OptimizerConfig:
        """Change optimizer settings (not its kind); validated; the state is kept."""
        if "kind" in changes and changes["kind"] != self.config.optimizer.kind:
            raise ConfigError(f"table {self.config.name}: the optimizer kind cannot change "
                              f"({self.config.optimizer.kind} -> {changes['kind']})")
        with self._lock:
            try:
                new = replace(self.config.optimizer, **changes)
            except TypeError as exc:
                raise ConfigError(f"table {self.config.name}: {exc}") from exc
            except ValueError as exc:
                raise ConfigError(f"table {self.config.name}: {exc}") from exc
            self.config = replace(self.config, optimizer=new)
            return new

    def delete(self, ids: Any) -> int:
        """Drop the rows of ``ids`` (absent ids are ignored); returns how many were dropped."""
        ids = self.validate_lookup(ids)
        with self._lock:
            self._pending.remove(ids)
            slots = self._index.find(np.unique(ids))
            slots = slots[slots >= 0]
            self._drop(slots, "deleted")
            return int(slots.shape[0])

    def expire(self) -> int:
        """Drop rows untouched for ``ttl_s`` seconds of the table's clock; returns how many."""
        if self.config.ttl_s is None:
            return 0
        with self._lock:
            now = self._clock()
            high = self._high
            old = self._live[:high] & (now - self._last_used[:high] > self.config.ttl_s)
            slots = np.flatnonzero(old)
            self._drop(slots, "expired")
            return int(slots.shape[0])

    # ----------------------------------------------------------------- row life cycle

    def _admit_and_create(self, mids: np.ndarray, *, protected: np.ndarray) -> np.ndarray:
        """Slots for the unique absent ids ``mids``: new rows where admitted, else -1."""
        cfg = self.config
        out = np.full(mids.shape[0], -1, dtype=np.int64)
        if cfg.admits_all:
            admit = np.ones(mids.shape[0], dtype=bool)
        else:
            seen = self._pending.count_up(mids)
            admit = seen >= cfg.admit_min_count
            if cfg.admit_probability < 1.0:
                admit &= admission_uniform(cfg, mids, seen) < cfg.admit_probability
        pos = np.flatnonzero(admit)
        if cfg.max_rows is not None and pos.shape[0]:
            excess = self._num_live + pos.shape[0] - cfg.max_rows
            if excess > 0:
                self._evict(excess, protected)
            pos = pos[:max(0, cfg.max_rows - self._num_live)]
        if pos.shape[0]:
            new_ids = mids[pos]
            out[pos] = self._create(new_ids)
            if not cfg.admits_all:
                self._pending.remove(new_ids)
        return out

    def _allocate(self, n: int) -> np.ndarray:
        take = min(n, self._free.shape[0])
        reused = self._free[self._free.shape[0] - take:][::-1]
        self._free = self._free[:self._free.shape[0] - take]
        fresh = np.arange(self._high, self._high + n - take, dtype=np.int64)
        self._high += n - take
        if self._high > self._rows.shape[0]:
            self._grow(self._high)
        return np.concatenate([reused, fresh])

    def _grow(self, need: int) -> None:
        cap = self._rows.shape[0]
        while cap < need:
            cap *= 2

        def grown(a: np.ndarray, fill: int = 0) -> np.ndarray:
            b = np.empty((cap, *a.shape[1:]), dtype=a.dtype)
            b[:a.shape[0]] = a
            b[a.shape[0]:] = fill
            return b

        self._rows = grown(self._rows)
        self._state = {k: grown(v) for k, v in self._state.items()}
        for name in ("_slot_ids", "_live", "_dirty", "_ticks", "_uses", "_last_used"):
            setattr(self, name, grown(getattr(self, name)))
        self._mark = grown(self._mark, -1)

    def _create(self, ids: np.ndarray) -> np.ndarray:
        """New rows (initial values, fresh state) for unique absent ids; returns their slots."""
        slots = self._allocate(ids.shape[0])
        self._index.insert(ids, slots)
        rows = initial_rows(self.config, ids)
        self._rows[slots] = rows
        init_state(self.config.optimizer, self._state, slots, rows)
        self._slot_ids[slots] = ids
        self._live[slots] = True
        self._dirty[slots] = True
        self._uses[slots] = 0
        self._ticks[slots] = self._tick
        self._last_used[slots] = self._clock()
        self._num_live += ids.shape[0]
        self._counters["misses"] += ids.shape[0]
        return slots

    def _mark_used(self, slots: np.ndarray) -> None:
        self._tick += 1
        touch_slots(slots, self._ticks, self._uses, self._last_used, self._tick, float(self._clock()))

    def _evict(self, k: int, protected: np.ndarray) -> None:
        high = self._high
        candidates = self._live[:high].copy()
        candidates[protected[protected >= 0]] = False
        cand = np.flatnonzero(candidates)
        ticks, uses, ids = self._ticks[cand], self._uses[cand], self._slot_ids[cand]
        if self.config.eviction is EvictionPolicy.LFU:
            victims = cand[_smallest(k, uses, ticks, ids)]
        else:
            victims = cand[_smallest(k, ticks, uses, ids)]
        self._drop(victims, "evictions")

    def _drop(self, slots: np.ndarray, counter: str | None) -> None:
        """Free rows; with a counter name, count them and leave tombstones."""
        if not slots.shape[0]:
            return
        ids = self._slot_ids[slots]
        self._index.remove(ids)
        self._live[slots] = False
        self._dirty[slots] = False
        self._free = np.concatenate([self._free, slots.astype(np.int64)])
        self._num_live -= slots.shape[0]
        if counter is not None:
            self._tombstones.append(ids)
            self._counters[counter] += slots.shape[0]

    # ----------------------------------------------------------------- snapshots

    def snapshot(self, *, incremental: bool = False) -> TableSnapshot:
        """All rows (or those changed since the last snapshot) and tombstones; resets both."""
        with self._lock:
            high = self._high
            sel = self._live[:high] & self._dirty[:high] if incremental else self._live[:high]
            slots = np.flatnonzero(sel)
            slots = slots[np.argsort(self._slot_ids[slots], kind="stable")]
            tomb = (np.unique(np.concatenate(self._tombstones)) if self._tombstones
                    else np.empty(0, dtype=np.uint64))
            snap = TableSnapshot(
                config=self.config,
                ids=self._slot_ids[slots],
                rows=self._rows[slots].astype(np.float32),
                state={k: v[slots] for k, v in self._state.items()},
                tombstones=tomb,
                incremental=incremental,
                meta={"tick": self._ticks[slots], "uses": self._uses[slots]},
            )
            self._dirty[:high] = False
            self._tombstones = []
            return snap

    def requeue(self, snap: TableSnapshot) -> None:
        """Undo the reset of a snapshot that could not be saved: its rows and tombstones
        go into the next snapshot again."""
        with self._lock:
            slots = self._index.find(snap.ids)
            self._dirty[slots[slots >= 0]] = True
            if snap.tombstones.shape[0]:
                self._tombstones.insert(0, snap.tombstones)

    def _check_compatible(self, snap: TableSnapshot) -> None:
        name = self.config.name
        if snap.config.dim != self.dim:
            raise FailedPrecondition(f"table {name}: snapshot has dim {snap.config.dim}, "
                                     f"the table has dim {self.dim}")
        if snap.config.optimizer.kind != self.config.optimizer.kind:
            raise FailedPrecondition(f"table {name}: snapshot optimizer is "
                                     f"{snap.config.optimizer.kind}, the table's is "
                                     f"{self.config.optimizer.kind}")
        n = snap.ids.shape[0]
        if snap.rows.shape != (n, self.dim):
            raise FailedPrecondition(f"table {name}: snapshot rows have shape {snap.rows.shape}, "
                                     f"expected ({n}, {self.dim})")
        for key, (shape, _) in state_layout(self.config.optimizer, self.dim).items():
            got = snap.state.get(key)
            if got is None or got.shape != (n, *shape):
                raise FailedPrecondition(f"table {name}: snapshot optimizer state {key!r} is "
                                         f"missing or has the wrong shape")

    def restore(self, snap: TableSnapshot, *,
                keep: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """Apply a snapshot: drop its tombstones, then load its rows and optimizer state.

        ``keep(ids) -> bool mask`` selects the ids to take (resharding). Restored rows count
        as clean: the next incremental snapshot holds changes made after the restore.
        """
        self._check_compatible(snap)
        ids = np.ascontiguousarray(snap.ids, dtype=np.uint64)
        tomb = np.ascontiguousarray(snap.tombstones, dtype=np.uint64)
        sel = np.ones(ids.shape[0], dtype=bool) if keep is None else np.asarray(keep(ids), bool)
        if keep is not None and tomb.shape[0]:
            tomb = tomb[np.asarray(keep(tomb), dtype=bool)]
        ids = ids[sel]
        with self._lock:
            gone = self._index.find(tomb)
            self._drop(gone[gone >= 0], None)
            slots = self._index.find(ids)
            new = slots < 0
            if new.any():
                fresh = self._allocate(int(new.sum()))
                self._index.insert(ids[new], fresh)
                slots[new] = fresh
                self._slot_ids[fresh] = ids[new]
                self._live[fresh] = True
                self._num_live += fresh.shape[0]
            self._rows[slots] = snap.rows[sel].astype(self._dtype)
            for key, arr in self._state.items():
                arr[slots] = snap.state[key][sel]
            self._dirty[slots] = False
            self._last_used[slots] = self._clock()
            for key, arr in (("tick", self._ticks), ("uses", self._uses)):
                if key in snap.meta:
                    arr[slots] = snap.meta[key][sel]
            if slots.shape[0]:
                self._tick = max(self._tick, int(self._ticks[slots].max()))

    # ----------------------------------------------------------------- stats

    def content_digest(self) -> str:
        """sha256 of every live id with its stored row and optimizer state (order-free)."""
        with self._lock:
            high = self._high
            slots = np.flatnonzero(self._live[:high])
            slots = slots[np.argsort(self._slot_ids[slots], kind="stable")]
            h = hashlib.sha256()
            h.update(self._slot_ids[slots].tobytes())
            h.update(np.ascontiguousarray(self._rows[slots]).tobytes())
            for key in sorted(self._state):
                h.update(key.encode())
                h.update(np.ascontiguousarray(self._state[key][slots]).tobytes())
            return h.hexdigest()

    def nbytes(self) -> int:
        """Bytes held by the arena, optimizer state, bookkeeping and hash indexes."""
        arrays = [self._rows, self._slot_ids, self._live, self._dirty, self._ticks, self._uses,
                  self._last_used, self._mark, *self._state.values()]
        return int(sum(a.nbytes for a in arrays) + self._index.nbytes + self._pending.nbytes)

    def stats(self) -> dict[str, Any]:
        """Counters and sizes of this table (a JSON-ready dict)."""
        with self._lock:
            return {
                "name": self.config.name,
                "rows": self._num_live,
                "capacity": int(self._rows.shape[0]),
                "bytes": self.nbytes(),
                "pending_admission": len(self._pending),
                **self._counters,
            }


def warm_up(config: TableConfig) -> None:
    """Look up and push a few ids on a scratch table of ``config``, twice, so that numba loads
    (or compiles) every kernel a table of this kind runs now, not during the first training
    steps; the scratch table is dropped."""
    table = EmbeddingTable(replace(config, initial_capacity=16))
    ids = np.arange(4, dtype=np.uint64)
    for _ in range(2):
        table.lookup(ids)
        table.push(ids, np.zeros((ids.size, config.dim), dtype=np.float32))
