"""The in-memory embedding table of one PS shard: hash index + row arena + optimizer state.

Layout: a :class:`~services.ps.slotindex.SlotIndex` maps id ↔ slot; slot ``s`` owns ``rows[s]``
(storage dtype), the optimizer state rows ``state[name][s]`` and per-slot bookkeeping (live and
dirty flags, a bit each; last-use tick and time and use count only where eviction, TTL or the disk
tier reads them: 24 bytes a slot less without). Freed slots go on a free list; the arena and the
index grow by doubling. Every public method works on whole batches (numpy and numba, no Python
loop per id) and holds the table's lock, so the gRPC server may call it from worker threads.

Row life cycle: a row is created on first sight (lookup or push) once admitted, with the
deterministic :func:`~services.ps.tables.initial_rows`; it is dropped by eviction (when
``max_rows`` is reached, LRU or LFU, never an id of the batch being served), by TTL
(:meth:`EmbeddingTable.expire`) or by :meth:`EmbeddingTable.delete`, leaving a tombstone for the
next snapshot. An id without a row always reads as its initial row.

Disk tier (``storage.tier: disk``): past ``storage.ram_rows``, the least recently used rows move
with their state and bookkeeping to a :class:`~services.ps.disk.DiskTier` (after each batch, down
to 7/8 of ``ram_rows``) and move back when touched, so every update runs on the RAM arena,
bit-identically. Eviction, TTL, deletes, snapshots and restores see both tiers.

Snapshots (full or incremental) and restores are the table's
:class:`~services.ps.table_snapshots.TableSnapshots` part.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from services.ps.arena import (
    SlotBits,
    committed,
    dedup_slots,
    gather_rows,
    nonfinite_rows,
    smallest_keys,
    sum_rows_by_inverse,
    touch_slots,
)
from services.ps.disk import DiskTier, record_dtype
from services.ps.hashtable import IdHashTable, unique_inverse
from services.ps.optimizers import apply_update, init_state, state_layout
from services.ps.slotindex import SlotIndex
from services.ps.table_io import (
    PlainTable,
    PushResult,
    TableSnapshot,
    validate_grads,
    validate_ids,
)
from services.ps.table_snapshots import TableSnapshots
from services.ps.tables import (
    EvictionPolicy,
    OptimizerConfig,
    StorageTier,
    TableConfig,
    admission_uniform,
    initial_rows,
)

__all__ = ["EmbeddingTable", "PushResult", "TableSnapshot"]

_COUNTERS = ("lookups", "pushes", "ids_looked_up", "ids_pushed", "misses", "evictions",
             "expired", "deleted", "dropped_nonfinite", "refused_nonfinite", "not_admitted",
             "promoted", "demoted")


class EmbeddingTable(TableSnapshots):
    """One embedding table held in memory, with its optimizer, admission and eviction."""

    def __init__(self, config: TableConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.dim = config.dim
        self._clock = clock
        self.lock = threading.RLock()  # held by every read or change of its arrays
        self._dtype = config.storage_dtype
        cap = int(config.initial_capacity)
        self._index = SlotIndex(cap)
        self._pending = IdHashTable(64)  # sightings of ids not admitted yet
        self._rows = committed((cap, self.dim), self._dtype)
        self._state = {name: committed((cap, *shape), dt)
                       for name, (shape, dt) in state_layout(config.optimizer, self.dim).items()}
        self._live, self._dirty = SlotBits(cap), SlotBits(cap)
        self._seen = SlotBits(cap)  # push scratch (dedup_slots), all clear between pushes
        # last-use tick and time, use count: read by eviction, TTL and the disk tier only
        self._tracks_use = (config.max_rows is not None or config.ttl_s is not None
                            or config.storage.tier is StorageTier.DISK)
        used = cap if self._tracks_use else 0
        self._ticks = committed((used,), np.int64)
        self._uses = committed((used,), np.int64)
        self._last_used = committed((used,), np.float64)
        self._free = np.empty(0, dtype=np.int64)  # stack of freed slots below _high
        self._high = 0  # slots >= _high were never used
        self._num_live = 0
        self._tick = 0
        self._tombstones: list[np.ndarray] = []
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._disk: DiskTier | None = None
        if config.storage.tier is StorageTier.DISK:
            layout = state_layout(config.optimizer, self.dim)
            self._disk = DiskTier(str(config.storage.path), config.name,
                                  record_dtype(self.dim, self._dtype, layout), cap)

    # ----------------------------------------------------------------- validation

    def validate_lookup(self, ids: Any) -> np.ndarray:
        """``ids`` as a contiguous uint64 vector, or :class:`InvalidArgument`."""
        return validate_ids(self.config.name, ids)

    def validate_push(self, ids: Any, grads: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(ids uint64, grads float32 (n, dim))`` or :class:`InvalidArgument`."""
        ids = validate_ids(self.config.name, ids)
        return ids, validate_grads(self.config, ids, grads)

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
        with self.lock:
            slots = self._index.find(ids)
            rows, present = self._gather(ids, slots), slots >= 0
            self._read_cold(ids, present, {"row": rows})
            return rows, present

    def state_of(self, ids: Any) -> dict[str, np.ndarray]:
        """The optimizer state of ``ids`` by name (request order; a new row's where absent),
        exactly as stored: what a worker's replica of the rows starts from. Changes nothing."""
        ids = self.validate_lookup(ids)
        out = {k: np.empty((ids.shape[0], *shape), dt) for k, (shape, dt)
               in state_layout(self.config.optimizer, self.dim).items()}
        with self.lock:
            slots = self._index.find(ids)
            present = slots >= 0
            for k, arr in out.items():
                arr[present] = self._state[k][slots[present]]
            self._read_cold(ids, present, {f"state:{k}": arr for k, arr in out.items()})
        absent = np.flatnonzero(~present)
        init_state(self.config.optimizer, out, absent, initial_rows(self.config, ids[absent]))
        return out

    def _read_cold(self, ids: np.ndarray, present: np.ndarray, out: dict[str, Any]) -> None:
        """Fill ``out`` (disk field -> array) from the disk tier where not ``present``."""
        if self._disk is not None and not present.all():
            cold = np.flatnonzero(~present)
            rec, found = self._disk.read(ids[cold])
            for name, arr in out.items():
                arr[cold[found]] = rec[name][found]
            present[cold[found]] = True

    def ids(self) -> np.ndarray:
        """Every id that has a row, sorted."""
        with self.lock:
            return self._all_rows(dirty_only=False)["id"]

    def lookup(self, ids: Any) -> np.ndarray:
        """Rows of ``ids`` (float32, request order); creates admitted rows, marks rows used."""
        ids = self.validate_lookup(ids)
        with self.lock:
            self._counters["lookups"] += 1
            self._counters["ids_looked_up"] += ids.shape[0]
            slots = self._index.find(ids)
            self._promote(ids, slots)
            missing = slots < 0
            if missing.any():
                pos = np.flatnonzero(missing)
                mids, inv = unique_inverse(ids[pos])
                created = self._admit_and_create(mids, protected=slots[~missing])
                slots[pos] = created[inv]
            self._mark_used(slots)
            out = self._gather(ids, slots)
            self._spill()
            return out

    def plain_view(self) -> PlainTable | None:
        """Its arrays for kernels over several tables (:mod:`.multitable`), for a caller that
        holds :attr:`lock`; None unless a lookup or push of held ids is a probe, an update
        and a mark of use (float32 rows in RAM: no disk tier). A ``max_rows`` or TTL table
        is plain: held ids create no row, so only creation (table by table) evicts."""
        if self._disk is not None or self._dtype != np.float32:
            return None
        return PlainTable(*self._index.arrays, self._rows, self._seen, self._dirty,
                          self._counters, self._apply, self.config.optimizer, self._state,
                          self._ticks, self._uses, self._last_used,
                          self._next_use if self._tracks_use else None)

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
        """Apply gradients (duplicates summed first); non-finite ones are dropped and counted,
        and so are rows whose update would not be finite (refused: counted in the result's
        ``dropped_nonfinite`` too)."""
        ids, grads = self.validate_push(ids, grads)
        with self.lock:
            self._counters["pushes"] += 1
            self._counters["ids_pushed"] += ids.shape[0]
            slots = self._index.find(ids)
            self._promote(ids, slots)
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
            refused = self._apply(uslots, summed)
            self._dirty[uslots] = True
            self._mark_used(uslots)
            self._spill()
            return PushResult(applied=int(uslots.shape[0]) - refused,
                              dropped_nonfinite=dropped + refused, not_admitted=not_admitted)

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
        uslots, first, inv = (np.empty(n, dtype=np.int64) for _ in range(3))
        k, dups = dedup_slots(slots, self._seen.data, uslots, first, inv)
        uslots = uslots[:k]
        if not dups:
            summed = grads if k == n else grads[first[:k]]
        else:
            summed = np.zeros((k, self.dim), dtype=np.float32)
            sum_rows_by_inverse(inv, grads, summed)
        return uslots, summed

    def _apply(self, slots: np.ndarray, grads: np.ndarray) -> int:
        """The optimizer's update of distinct ``slots``; returns (and counts) the rows it
        refused because their new values would not all be finite."""
        opt = self.config.optimizer
        if self._dtype == np.float32:
            refused = apply_update(opt, self._rows, slots, self._state, slots, grads)
        else:
            wide = self._rows[slots].astype(np.float32)
            refused = apply_update(opt, wide, np.arange(slots.shape[0]), self._state, slots,
                                   grads, storage=self._dtype)
            self._rows[slots] = wide.astype(self._dtype)
        self._counters["refused_nonfinite"] += refused
        return refused

    def set_optimizer(self, **changes: Any) -> OptimizerConfig:
        """Change optimizer settings (not its kind: :meth:`TableConfig.optimizer_with`
        checks them); the state is kept."""
        with self.lock:
            new = self.config.optimizer_with(changes)
            self.config = replace(self.config, optimizer=new)
            return new

    def delete(self, ids: Any) -> int:
        """Drop the rows of ``ids`` (absent ids are ignored); returns how many were dropped."""
        ids = self.validate_lookup(ids)
        with self.lock:
            self._pending.remove(ids)
            uids = np.unique(ids)
            slots = self._index.find(uids)
            slots = slots[slots >= 0]
            self._drop(slots, "deleted")
            return int(slots.shape[0]) + self._drop_disk(uids, "deleted")

    def expire(self) -> int:
        """Drop rows untouched for ``ttl_s`` seconds of the table's clock; returns how many."""
        if self.config.ttl_s is None:
            return 0
        with self.lock:
            now = self._clock()
            high = self._high
            old = self._live[:high] & (now - self._last_used[:high] > self.config.ttl_s)
            slots = np.flatnonzero(old)
            self._drop(slots, "expired")
            on_disk = (0 if self._disk is None else
                       self._drop_disk(self._disk.idle_ids(now, self.config.ttl_s), "expired"))
            return int(slots.shape[0]) + on_disk

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
            b = committed((cap, *a.shape[1:]), a.dtype, fill)
            b[:a.shape[0]] = a
            return b

        self._rows = grown(self._rows)
        self._state = {k: grown(v) for k, v in self._state.items()}
        for name in self._use_columns():
            setattr(self, name, grown(getattr(self, name)))
        self._live, self._dirty = self._live.grown(cap), self._dirty.grown(cap)
        self._index.grow_slots(cap)
        self._seen = SlotBits(cap)

    def _create(self, ids: np.ndarray) -> np.ndarray:
        """New rows (initial values, fresh state) for unique absent ids; returns their slots."""
        slots = self._allocate(ids.shape[0])
        self._index.insert(ids, slots)
        rows = initial_rows(self.config, ids)
        self._rows[slots] = rows
        init_state(self.config.optimizer, self._state, slots, rows)
        self._live[slots] = self._dirty[slots] = True
        if self._tracks_use:
            self._uses[slots] = 0
            self._ticks[slots] = self._tick
            self._last_used[slots] = self._clock()
        self._num_live += ids.shape[0]
        self._counters["misses"] += ids.shape[0]
        return slots

    def _use_columns(self) -> tuple[str, ...]:
        """The per-slot arrays of the use bookkeeping, where this table keeps it."""
        return ("_ticks", "_uses", "_last_used") if self._tracks_use else ()

    def _mark_used(self, slots: np.ndarray) -> None:
        self._tick += 1
        if self._tracks_use:
            touch_slots(slots, self._ticks, self._uses, self._last_used, self._tick,
                        float(self._clock()))

    def _next_use(self) -> tuple[int, float]:
        """A use begins (one lookup or push): its tick and time, as :meth:`_mark_used`'s."""
        self._tick += 1
        return self._tick, float(self._clock())

    def _evict(self, k: int, protected: np.ndarray) -> None:
        high = self._high
        candidates = self._live[:high].copy()
        candidates[protected[protected >= 0]] = False
        cand = np.flatnonzero(candidates)
        ticks, uses, ids = self._ticks[cand], self._uses[cand], self._index.slot_ids[cand]
        if self._disk is not None:
            dslots = self._disk.live_slots()
            ticks, uses, ids = (np.concatenate([mine, self._disk.field(name, dslots)]) for
                                mine, name in ((ticks, "tick"), (uses, "uses"), (ids, "id")))
        if self.config.eviction is EvictionPolicy.LFU:
            picked = smallest_keys(k, uses, ticks, ids)
        else:
            picked = smallest_keys(k, ticks, uses, ids)
        in_ram = picked < cand.shape[0]
        self._drop(cand[picked[in_ram]], "evictions")
        self._drop_disk(ids[picked[~in_ram]], "evictions")

    def _release(self, slots: np.ndarray) -> np.ndarray:
        """Free RAM slots (their rows leave the RAM tier); returns their ids."""
        ids = self._index.slot_ids[slots]
        self._index.remove(ids)
        self._live[slots] = False
        self._dirty[slots] = False
        self._free = np.concatenate([self._free, slots.astype(np.int64)])
        return ids

    def _drop(self, slots: np.ndarray, counter: str | None) -> None:
        """Free rows; with a counter name, count them and leave tombstones."""
        if not slots.shape[0]:
            return
        ids = self._release(slots)
        self._num_live -= slots.shape[0]
        if counter is not None:
            self._tombstones.append(ids)
            self._counters[counter] += slots.shape[0]

    def _drop_disk(self, ids: np.ndarray, counter: str | None) -> int:
        """Drop the disk rows of unique ``ids`` (others are ignored); returns how many."""
        if self._disk is None or not ids.shape[0]:
            return 0
        gone = self._disk.remove(ids)
        self._num_live -= gone.shape[0]
        if counter is not None and gone.shape[0]:
            self._tombstones.append(gone)
            self._counters[counter] += gone.shape[0]
        return int(gone.shape[0])

    # ----------------------------------------------------------------- disk tier

    def _promote(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Move the disk rows of ``ids`` absent from RAM (``slots`` -1) into RAM; fills slots."""
        if self._disk is None or not len(self._disk):
            return
        pos = np.flatnonzero(slots < 0)
        on_disk = self._disk.find(ids[pos])
        hit = pos[on_disk >= 0]
        if not hit.shape[0]:
            return
        uids, inv = unique_inverse(ids[hit])
        dslots = np.empty(uids.shape[0], dtype=np.int64)
        dslots[inv] = on_disk[on_disk >= 0]  # the disk slot of each uid
        new = self._allocate(uids.shape[0])
        self._index.insert(uids, new)
        self._dirty[new] = self._disk.take(dslots, self._columns(), new)
        self._live[new] = True
        slots[hit] = new[inv]
        self._counters["promoted"] += uids.shape[0]

    def _spill(self) -> None:
        """Past ``ram_rows`` rows in RAM, move the least recently used to disk (to 7/8)."""
        limit = int(self.config.storage.ram_rows or 0)
        if self._disk is None or self._num_live - len(self._disk) <= limit:
            return
        live = np.flatnonzero(self._live[:self._high])
        k = self._num_live - len(self._disk) - (limit - limit // 8)
        ids = self._index.slot_ids[live]
        # in slot order: the write-back reads the arena's columns front to back
        victims = np.sort(live[smallest_keys(k, self._ticks[live], self._uses[live], ids)])
        self._disk.put(self._columns(), victims, self._dirty[victims])
        self._release(victims)
        self._counters["demoted"] += k

    def _columns(self) -> dict[str, np.ndarray]:
        """The RAM arena's per-slot arrays (those a disk record has) by record field name."""
        use = {"tick": self._ticks, "uses": self._uses,
               "last_used": self._last_used} if self._tracks_use else {}
        return {"id": self._index.slot_ids, **use, "row": self._rows,
                **{f"state:{k}": v for k, v in self._state.items()}}

    def nbytes(self) -> int:
        """Bytes held in RAM: arena, optimizer state, bookkeeping, both tiers' indexes."""
        arrays = [self._rows, self._ticks, self._uses, self._last_used, *self._state.values()]
        disk = 0 if self._disk is None else self._disk.nbytes_ram
        bits = self._live.nbytes + self._dirty.nbytes + self._seen.nbytes
        return int(sum(a.nbytes for a in arrays) + bits + self._index.nbytes
                   + self._pending.nbytes + disk)

    def stats(self) -> dict[str, Any]:
        """Counters and sizes of this table (a JSON-ready dict)."""
        with self.lock:
            disk = self._disk
            return {"name": self.config.name, "rows": self._num_live,
                    "capacity": int(self._rows.shape[0]), "bytes": self.nbytes(),
                    "disk_rows": 0 if disk is None else len(disk),
                    "disk_bytes": 0 if disk is None else disk.nbytes_disk,
                    "pending_admission": len(self._pending), **self._counters}

