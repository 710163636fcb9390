"""Synchronous rows read ahead of compute: one worker, the shards in its process, window 1.

With no staleness every step must see every earlier step's update. Reading a batch's rows
only after the previous step's gradients are applied leaves a core idle while the other
waits. Here a batch's rows are read in a thread while the step before it computes, and the
compute thread, just before the batch's step, reads again only the rows that pushes applied
since then may have changed (:meth:`ReadAhead.patch`). An update touches only the rows it
names, so every other row read ahead is already what a read after the push would give: the
result is exactly the synchronous one, bit for bit. Under Zipf traffic the rows read again
are mostly the frequent ids: a few percent of a batch's.

A row's key is its id mixed with its table's index; two keys that collide only make a row
read again, never skipped.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

import numpy as np
from numba import njit

from services.common.sharding import ShardedIds
from services.worker.embedding.rows import DirectRows
from services.worker.pooling import BatchPlan

__all__ = ["READ_AHEAD", "ReadAhead"]

READ_AHEAD = 2  # batches read and not yet stepped: the one computing and the next
_KEPT = 16  # pushes remembered (a read older than them is read again whole)
_TABLE_MIX = np.uint64(0x9E3779B97F4A7C15)

Rows = list[np.ndarray]


@njit(cache=True, nogil=True)
def _member(keys, known):  # pragma: no cover - numba
    """For each of ``keys``, whether it is one of ``known`` (uint64 arrays; an open-addressing
    set of ``known`` built here: linear in both sizes, where np.isin sorts)."""
    size = 1
    while size < 2 * known.size:
        size *= 2
    mask = np.uint64(size - 1)
    slots = np.zeros(size, dtype=np.uint64)
    used = np.zeros(size, dtype=np.bool_)
    for k in known:
        h = (k * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(20) & mask
        while used[h] and slots[h] != k:
            h = (h + np.uint64(1)) & mask
        used[h], slots[h] = True, k
    out = np.zeros(keys.size, dtype=np.bool_)
    for j in range(keys.size):
        k = keys[j]
        h = (k * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(20) & mask
        while used[h]:
            if slots[h] == k:
                out[j] = True
                break
            h = (h + np.uint64(1)) & mask
    return out


def row_keys(layout: ShardedIds) -> np.ndarray:
    """Each id of ``layout`` mixed with its table's index (uint64)."""
    return layout.ids ^ (layout.table_index().astype(np.uint64) * _TABLE_MIX)


class ReadAhead:
    """The pushes applied so far, numbered, with the rows each changed; rows read ahead
    with the number of pushes they saw, and patched for the later ones."""

    def __init__(self, rows: DirectRows, groups: list[int]) -> None:
        self.rows = rows
        self.groups = groups
        self._lock = threading.Lock()
        self._applied = 0
        self._pushed: deque[tuple[int, list[np.ndarray]]] = deque(maxlen=_KEPT)
        self._seen: dict[int, int] = {}  # a plan's step -> pushes applied before its read
        self.read_again = self.read_total = 0  # rows: for the summary's curious
        _member(np.arange(4, dtype=np.uint64), np.arange(2, dtype=np.uint64))  # compiled now

    async def read(self, plan: BatchPlan, step: int) -> tuple[Rows, int]:
        """The groups' rows of ``plan`` (its step ``step``), read in a thread now."""
        return await asyncio.to_thread(self._read, plan, step), 0

    def _read(self, plan: BatchPlan, step: int) -> Rows:
        with self._lock:
            self._seen[step] = self._applied  # every push up to here is complete
        return [self.rows.lookup_now(plan.groups[i].layout) for i in self.groups]

    def patch(self, plan: BatchPlan, step: int, rows: Rows) -> None:
        """Read again the rows of ``plan`` that pushes after its read may have changed
        (from the compute thread, every earlier step's push applied)."""
        with self._lock:
            seen = self._seen.pop(step)
            later = [keys for number, keys in self._pushed if number > seen]
            complete = not self._pushed or self._pushed[0][0] <= seen + 1
        for n, i in enumerate(self.groups):
            layout = plan.groups[i].layout
            self.read_total += layout.ids.size
            if not complete:  # older than every push remembered: all of it again
                rows[n] = self.rows.lookup_now(layout)
                self.read_again += layout.ids.size
                continue
            if not later:
                continue
            changed = _member(row_keys(layout), np.concatenate([k[n] for k in later]))
            if changed.any():
                rows[n][changed] = self.rows.lookup_now(layout.subset(changed))
                self.read_again += int(changed.sum())

    def pushed(self, plan: BatchPlan) -> None:
        """Count a push of ``plan``'s rows as applied (after it was, in full)."""
        keys = [row_keys(plan.groups[i].layout) for i in self.groups]
        with self._lock:
            self._applied += 1
            self._pushed.append((self._applied, keys))
