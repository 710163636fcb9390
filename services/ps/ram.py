"""The RAM tier of an embedding table: its rows in a slot-addressed arena.

:class:`RamArena` holds, per slot ``s``: the row ``rows[s]`` (storage dtype), the optimizer
state rows ``state[name][s]``, a live and a dirty bit, and, where eviction, TTL or the disk
tier reads them (``tracks_use``), the last-use tick and time and the use count (24 bytes a
slot less without). A :class:`~services.ps.slotindex.SlotIndex` maps id ↔ slot. Freed slots
go on a free list; the arrays and the index grow by doubling. The table that owns the arena
decides what its rows hold (:mod:`services.ps.store`); the disk tier moves rows in and out
of it (:mod:`services.ps.disk`).
"""

from __future__ import annotations

import numpy as np

from services.ps.arena import SlotBits, committed
from services.ps.slotindex import SlotIndex

__all__ = ["RamArena", "StateLayout"]

StateLayout = dict[str, tuple[tuple[int, ...], np.dtype]]  # as services.ps.optimizers makes it


class RamArena:
    """Rows of one table in RAM, by slot (see the module). Its arrays are the table's to read
    and write; ``seen`` is a push's scratch (:func:`~services.ps.arena.dedup_slots`), all
    clear between pushes. Not thread-safe: the owning table serialises access under its lock.
    """

    def __init__(self, capacity: int, dim: int, dtype: np.dtype, state: StateLayout, *,
                 tracks_use: bool) -> None:
        cap = int(capacity)
        self.index = SlotIndex(cap)
        self.rows = committed((cap, dim), dtype)
        self.state = {name: committed((cap, *shape), dt) for name, (shape, dt) in state.items()}
        self.live, self.dirty, self.seen = SlotBits(cap), SlotBits(cap), SlotBits(cap)
        self.tracks_use = tracks_use
        used = cap if tracks_use else 0
        self.ticks = committed((used,), np.int64)
        self.uses = committed((used,), np.int64)
        self.last_used = committed((used,), np.float64)
        self.high = 0  # slots >= high were never used
        self.count = 0  # live slots
        self._free = np.empty(0, dtype=np.int64)  # stack of freed slots below high

    @property
    def capacity(self) -> int:
        return int(self.rows.shape[0])

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Live slots for unique ``ids`` that have none (their arrays as they were left):
        freed slots first, then fresh ones, growing the arena as needed."""
        n = ids.shape[0]
        take = min(n, self._free.shape[0])
        reused = self._free[self._free.shape[0] - take:][::-1]
        self._free = self._free[:self._free.shape[0] - take]
        fresh = np.arange(self.high, self.high + n - take, dtype=np.int64)
        self.high += n - take
        if self.high > self.capacity:
            self._grow(self.high)
        slots = np.concatenate([reused, fresh])
        self.index.insert(ids, slots)
        self.live[slots] = True
        self.count += n
        return slots

    def release(self, slots: np.ndarray) -> np.ndarray:
        """Free live ``slots`` (their rows leave RAM); returns their ids."""
        ids = self.index.slot_ids[slots]
        self.index.remove(ids)
        self.live[slots] = False
        self.dirty[slots] = False
        self._free = np.concatenate([self._free, slots.astype(np.int64)])
        self.count -= slots.shape[0]
        return ids

    def _grow(self, need: int) -> None:
        cap = self.capacity
        while cap < need:
            cap *= 2

        def grown(a: np.ndarray) -> np.ndarray:
            b = committed((cap, *a.shape[1:]), a.dtype)
            b[:a.shape[0]] = a
            return b

        self.rows = grown(self.rows)
        self.state = {k: grown(v) for k, v in self.state.items()}
        if self.tracks_use:
            self.ticks, self.uses = grown(self.ticks), grown(self.uses)
            self.last_used = grown(self.last_used)
        self.live, self.dirty = self.live.grown(cap), self.dirty.grown(cap)
        self.index.grow_slots(cap)
        self.seen = SlotBits(cap)

    def columns(self) -> dict[str, np.ndarray]:
        """The per-slot arrays a disk record has (:func:`services.ps.disk.record_dtype`), by
        record field name: ``id``, the use bookkeeping where kept, ``row``, ``state:<name>``."""
        use = {"tick": self.ticks, "uses": self.uses,
               "last_used": self.last_used} if self.tracks_use else {}
        return {"id": self.index.slot_ids, **use, "row": self.rows,
                **{f"state:{k}": v for k, v in self.state.items()}}

    @property
    def nbytes(self) -> int:
        """Bytes held: the arrays, the bits and the index."""
        arrays = [self.rows, self.ticks, self.uses, self.last_used, *self.state.values()]
        bits = self.live.nbytes + self.dirty.nbytes + self.seen.nbytes
        return int(sum(a.nbytes for a in arrays) + bits + self.index.nbytes)
