"""The in-memory embedding table of one PS shard: its rows, their optimizer and life cycle.

Its rows live in a RAM arena (:class:`~services.ps.ram.RamArena`: id ↔ slot index, rows,
optimizer state, per-slot bookkeeping) and, with ``storage.tier: disk``, those beyond
``storage.ram_rows`` in a disk tier (:class:`~services.ps.disk.DiskTier`), which moves rows
out of the arena and back in when touched, so every update runs on the RAM arena. Eviction, TTL,
deletes, snapshots and restores see both tiers. Every public method works on whole batches
(numpy and numba, no Python loop per id) and holds the table's lock, so the gRPC server may
call it from worker threads.

Row life cycle: a row is created on first sight (lookup or push) once admitted, with the
deterministic :func:`~services.ps.tables.initial_rows`; it is dropped by eviction (when
``max_rows`` is reached, LRU or LFU, never an id of the batch being served), by TTL
(:meth:`EmbeddingTable.expire`) or by :meth:`EmbeddingTable.delete`, leaving a tombstone for the
next snapshot. An id without a row always reads as its initial row.

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

from services.common.errors import InvalidArgument
from services.common.kernel_arrays import RefsMemo
from services.common.messages import TableCounters
from services.ps.arena import (
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
from services.ps.ram import RamArena
from services.ps.table_io import (
    PLAIN_DTYPES,
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
_NO_ACCUM = np.empty(0, dtype=np.float32)  # the accumulator row of a table without one


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
        layout = state_layout(config.optimizer, self.dim)
        tiered = config.storage.tier is StorageTier.DISK
        # last-use tick and time, use count: read by eviction, TTL and the disk tier only
        self._ram = RamArena(cap, self.dim, self._dtype, layout, tracks_use=(
            config.max_rows is not None or config.ttl_s is not None or tiered))
        self._disk = (DiskTier(str(config.storage.path), config.name,
                               record_dtype(self.dim, self._dtype, layout), cap)
                      if tiered else None)
        self._pending = IdHashTable(64)  # sightings of ids not admitted yet
        self._tick = 0
        self._tombstones: list[np.ndarray] = []
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._refs = RefsMemo(PLAIN_DTYPES)  # plain_view's kernel row

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
        """Rows held, in both tiers."""
        return self._ram.count + (0 if self._disk is None else len(self._disk))

    def initial_rows(self, ids: Any) -> np.ndarray:
        """The deterministic initial rows of ``ids`` (float32); stores nothing."""
        return initial_rows(self.config, self.validate_lookup(ids))

    def peek(self, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, present)``: current rows (initial rows where absent); changes nothing."""
        ids = self.validate_lookup(ids)
        with self.lock:
            slots = self._ram.index.find(ids)
            rows, present = self._gather(ids, slots), slots >= 0
            if self._disk is not None:
                self._disk.read_into(ids, present, {"row": rows})
            return rows, present

    def state_of(self, ids: Any) -> dict[str, np.ndarray]:
        """The optimizer state of ``ids`` by name (request order; a new row's where absent),
        exactly as stored: what a worker's replica of the rows starts from. Changes nothing."""
        ids = self.validate_lookup(ids)
        out = {k: np.empty((ids.shape[0], *shape), dt) for k, (shape, dt)
               in state_layout(self.config.optimizer, self.dim).items()}
        with self.lock:
            slots = self._ram.index.find(ids)
            present = slots >= 0
            for k, arr in out.items():
                arr[present] = self._ram.state[k][slots[present]]
            if self._disk is not None:
                self._disk.read_into(ids, present, {f"state:{k}": a for k, a in out.items()})
        absent = np.flatnonzero(~present)
        init_state(self.config.optimizer, out, absent, initial_rows(self.config, ids[absent]))
        return out

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
            slots = self._ram.index.find(ids)
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

    @property
    def creates_freely(self) -> bool:
        """Whether a lookup makes a row for every absent id, evicting none (every id
        admitted, no row cap): :meth:`create_rows` may run ahead of it."""
        return self.config.admits_all and self.config.max_rows is None

    def create_rows(self, ids: np.ndarray) -> None:
        """The rows a lookup of the absent ``ids`` (unique uint64) creates, before it: for
        kernels over several tables (:mod:`.multitable`) whose caller holds :attr:`lock`;
        only where :attr:`creates_freely` (else InvalidArgument, nothing changed)."""
        if not self.creates_freely:
            raise InvalidArgument(f"table {self.config.name!r} admits ids or caps its rows: "
                                  "its lookups create its rows")
        self._create(ids)

    def plain_view(self) -> PlainTable | None:
        """Its arrays for kernels over several tables (:mod:`.multitable`), for a caller that
        holds :attr:`lock`; None unless a lookup or push of held ids is a probe, an update
        and a mark of use (float32 rows in RAM: no disk tier). A ``max_rows`` or TTL table
        is plain: held ids create no row, so only creation (table by table) evicts."""
        if self._disk is not None or self._dtype != np.float32:
            return None
        ram = self._ram
        arrays = (*ram.index.arrays, ram.rows, ram.seen.data, ram.dirty.data,
                  ram.state.get("accum", _NO_ACCUM), ram.ticks, ram.uses, ram.last_used)
        return PlainTable(self._refs.of(arrays), self._counters, self._apply,
                          self.config.optimizer, self._next_use if ram.tracks_use else None)

    def _gather(self, ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        out = np.empty((ids.shape[0], self.dim), dtype=np.float32)
        if self._dtype == np.float32:
            gather_rows(self._ram.rows, slots, out)
        else:
            valid = slots >= 0
            out[valid] = self._ram.rows[slots[valid]]
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
            slots = self._ram.index.find(ids)
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
            self._ram.dirty[uslots] = True
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
        k, dups = dedup_slots(slots, self._ram.seen.data, uslots, first, inv)
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
        opt, ram = self.config.optimizer, self._ram
        if self._dtype == np.float32:
            refused = apply_update(opt, ram.rows, slots, ram.state, slots, grads)
        else:
            wide = ram.rows[slots].astype(np.float32)
            refused = apply_update(opt, wide, np.arange(slots.shape[0]), ram.state, slots,
                                   grads, storage=self._dtype)
            ram.rows[slots] = wide.astype(self._dtype)
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
            slots = self._ram.index.find(uids)
            slots = slots[slots >= 0]
            self._drop(slots, "deleted")
            return int(slots.shape[0]) + self._drop_disk(uids, "deleted")

    def expire(self) -> int:
        """Drop rows untouched for ``ttl_s`` seconds of the table's clock; returns how many."""
        if self.config.ttl_s is None:
            return 0
        with self.lock:
            now, ram = self._clock(), self._ram
            high = ram.high
            old = ram.live[:high] & (now - ram.last_used[:high] > self.config.ttl_s)
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
            excess = self.num_rows + pos.shape[0] - cfg.max_rows
            if excess > 0:
                self._evict(excess, protected)
            pos = pos[:max(0, cfg.max_rows - self.num_rows)]
        if pos.shape[0]:
            new_ids = mids[pos]
            out[pos] = self._create(new_ids)
            if not cfg.admits_all:
                self._pending.remove(new_ids)
        return out

    def _create(self, ids: np.ndarray) -> np.ndarray:
        """New rows (initial values, fresh state) for unique absent ids; returns their slots."""
        ram = self._ram
        slots = ram.add(ids)
        rows = initial_rows(self.config, ids)
        ram.rows[slots] = rows
        init_state(self.config.optimizer, ram.state, slots, rows)
        ram.dirty[slots] = True
        if ram.tracks_use:
            ram.uses[slots] = 0
            ram.ticks[slots] = self._tick
            ram.last_used[slots] = self._clock()
        self._counters["misses"] += ids.shape[0]
        return slots

    def _mark_used(self, slots: np.ndarray) -> None:
        self._tick += 1
        ram = self._ram
        if ram.tracks_use:
            touch_slots(slots, ram.ticks, ram.uses, ram.last_used, self._tick,
                        float(self._clock()))

    def _next_use(self) -> tuple[int, float]:
        """A use begins (one lookup or push): its tick and time, as :meth:`_mark_used`'s."""
        self._tick += 1
        return self._tick, float(self._clock())

    def _evict(self, k: int, protected: np.ndarray) -> None:
        ram = self._ram
        candidates = ram.live[:ram.high].copy()
        candidates[protected[protected >= 0]] = False
        cand = np.flatnonzero(candidates)
        ticks, uses, ids = ram.ticks[cand], ram.uses[cand], ram.index.slot_ids[cand]
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

    def _drop(self, slots: np.ndarray, counter: str | None) -> None:
        """Free rows; with a counter name, count them and leave tombstones."""
        if not slots.shape[0]:
            return
        ids = self._ram.release(slots)
        if counter is not None:
            self._tombstones.append(ids)
            self._counters[counter] += slots.shape[0]

    def _drop_disk(self, ids: np.ndarray, counter: str | None) -> int:
        """Drop the disk rows of unique ``ids`` (others are ignored); returns how many."""
        if self._disk is None or not ids.shape[0]:
            return 0
        gone = self._disk.remove(ids)
        if counter is not None and gone.shape[0]:
            self._tombstones.append(gone)
            self._counters[counter] += gone.shape[0]
        return int(gone.shape[0])

    # ----------------------------------------------------------------- disk tier

    def _promote(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Move the disk rows of ``ids`` absent from RAM (``slots`` -1) into RAM; fills slots."""
        if self._disk is not None:
            self._counters["promoted"] += self._disk.promote(self._ram, ids, slots)

    def _spill(self) -> None:
        """Past ``ram_rows`` rows in RAM, move the least recently used to disk (to 7/8)."""
        if self._disk is not None:
            self._counters["demoted"] += self._disk.spill(
                self._ram, int(self.config.storage.ram_rows or 0))

    def nbytes(self) -> int:
        """Bytes held in RAM: arena, optimizer state, bookkeeping, both tiers' indexes."""
        disk = 0 if self._disk is None else self._disk.nbytes_ram
        return self._ram.nbytes + self._pending.nbytes + disk

    def stats(self) -> TableCounters:
        """Counters and sizes of this table."""
        with self.lock:
            disk = self._disk
            return TableCounters(name=self.config.name, rows=self.num_rows,
                                 capacity=self._ram.capacity, bytes=self.nbytes(),
                                 disk_rows=0 if disk is None else len(disk),
                                 disk_bytes=0 if disk is None else disk.nbytes_disk,
                                 pending_admission=len(self._pending), **self._counters)

