"""Batch kernels of a table's row arena: slots are int64, -1 = no row.

The arena's memory committed up front, a bit per slot (:class:`SlotBits`: live, dirty, seen),
and the per-batch kernels over slots: gather rows, dedup slots, sum gradient rows by inverse,
find non-finite rows, touch the use bookkeeping, and eviction's k smallest keys.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from services.common.sharding import GOLDEN
from services.ps.prefetch import prefetch_row

__all__ = ["SlotBits", "committed", "dedup_slots", "gather_rows", "nonfinite_rows",
           "set_bits", "smallest_keys", "sum_rows_by_inverse", "touch_slots"]

# rows ahead a gather prefetches: its loop only copies a row, so it needs a longer lead than
# the probes' and optimizers' PREFETCH_DISTANCE (64k random rows of dim 16 out of 1M, AMD
# EPYC: 1.7 ms without, 1.2 ms at 8, 0.7 ms at 16)
GATHER_AHEAD = 16


def committed(shape: tuple[int, ...], dtype: Any, fill: int = 0) -> np.ndarray:
    """An array whose memory is written now (``np.zeros`` would defer the page faults to the
    first batches that touch it): an arena preallocated for real."""
    a = np.empty(shape, dtype=dtype)
    a.fill(fill)
    return a


@njit(cache=True, nogil=True)
def set_bits(data, slots, values):  # pragma: no cover - numba
    """Bit ``slots[j]`` of ``data`` := ``values[j]`` (``values[0]`` for all if it has one)."""
    one = values.shape[0] == 1
    for j in range(slots.shape[0]):
        s = slots[j]
        bit = np.uint8(1 << (s & 7))
        if values[0] if one else values[j]:
            data[s >> 3] |= bit
        else:
            data[s >> 3] &= ~bit


@njit(cache=True, nogil=True)
def _get_bits(data, slots, out):  # pragma: no cover - numba
    for j in range(slots.shape[0]):
        out[j] = (data[slots[j] >> 3] >> (slots[j] & 7)) & 1


class SlotBits:
    """One flag a slot (live, dirty), eight to a byte, indexed like a bool array: by an
    int array of slots, or by ``[:n]`` (the first n slots)."""

    __slots__ = ("data",)

    def __init__(self, slots: int) -> None:
        self.data = committed(((int(slots) + 7) // 8,), np.uint8)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def grown(self, slots: int) -> SlotBits:
        """A copy with room for ``slots`` slots (the new ones clear)."""
        out = SlotBits(slots)
        out.data[:self.data.shape[0]] = self.data
        return out

    @staticmethod
    def _stop(key: slice) -> int:
        if key.start not in (None, 0) or key.step not in (None, 1) or key.stop is None:
            raise IndexError("SlotBits takes [:n] or an array of slots")
        return int(key.stop)

    def __getitem__(self, key: slice | np.ndarray) -> np.ndarray:
        if isinstance(key, slice):
            return np.unpackbits(self.data, count=self._stop(key), bitorder="little").view(bool)
        slots = np.ascontiguousarray(key, dtype=np.int64)
        out = np.empty(slots.shape[0], dtype=bool)
        _get_bits(self.data, slots, out)
        return out

    def __setitem__(self, key: slice | np.ndarray, value: bool | np.ndarray) -> None:
        values = np.ascontiguousarray(np.atleast_1d(value), dtype=bool)
        if isinstance(key, slice) and values.shape[0] == 1:  # [:n] = flag: whole bytes at once
            n = self._stop(key)
            self.data[:n // 8] = 0xFF if values[0] else 0
            slots = np.arange(n // 8 * 8, n, dtype=np.int64)
        elif isinstance(key, slice):
            slots = np.arange(self._stop(key), dtype=np.int64)
        else:
            slots = np.ascontiguousarray(key, dtype=np.int64)
        set_bits(self.data, slots, values)


@njit(cache=True, nogil=True)
def touch_slots(slots, ticks, uses, last_used, tick, now):  # pragma: no cover - numba
    for j in range(slots.shape[0]):
        s = slots[j]
        if s >= 0:
            ticks[s] = tick
            uses[s] += 1
            last_used[s] = now


@njit(cache=True, nogil=True)
def gather_rows(rows, slots, out):  # pragma: no cover - numba
    """out[j] = rows[slots[j]] for slots >= 0, the row ``GATHER_AHEAD`` further prefetched."""
    n = slots.shape[0]
    for j in range(n):
        ahead = slots[min(j + GATHER_AHEAD, n - 1)]
        if ahead >= 0:
            prefetch_row(rows, ahead)
        s = slots[j]
        if s >= 0:
            for c in range(rows.shape[1]):
                out[j, c] = rows[s, c]


@njit(cache=True, nogil=True)
def dedup_slots(slots, seen, uslots, first, inv):  # pragma: no cover - numba
    """The distinct slots >= 0 of ``slots`` in first-appearance order at ``uslots[:k]``,
    ``first[p]`` where ``uslots[p]`` first appears, ``inv[i]`` the position in ``uslots`` of
    ``slots[i]`` (-1 for a negative slot). Returns (k, whether a slot repeats).

    ``seen`` is the table's scratch bitmap, one bit a slot, all clear (and left so): it finds
    that no slot repeats, the usual case, in one pass; where one does, a hash of the
    request's own (2n buckets) maps slots to positions."""
    n = slots.shape[0]
    k = 0
    dups = False
    for i in range(n):
        s = slots[i]
        if s < 0:
            inv[i] = -1
            continue
        bit = np.uint8(1 << (s & 7))
        if seen[s >> 3] & bit:
            dups = True
            break
        seen[s >> 3] |= bit
        uslots[k] = s
        first[k] = i
        inv[i] = k
        k += 1
    for p in range(k):
        seen[uslots[p] >> 3] = 0
    if not dups:
        return k, False
    size, bits = 8, 3
    while size < 2 * n:
        size, bits = 2 * size, bits + 1
    shift = np.uint64(64 - bits)
    mask = size - 1
    table = np.full(size, -1, dtype=np.int64)  # slot << 32 | position; -1: empty
    k = 0
    for i in range(n):
        s = slots[i]
        if s < 0:
            inv[i] = -1
            continue
        h = np.int64((np.uint64(s) * GOLDEN) >> shift)
        while True:
            e = table[h]
            if e < 0:
                table[h] = (s << 32) | k
                uslots[k] = s
                first[k] = i
                inv[i] = k
                k += 1
                break
            if (e >> 32) == s:
                inv[i] = e & 0xFFFFFFFF
                break
            h = (h + 1) & mask
    return k, True


@njit(cache=True, nogil=True)
def sum_rows_by_inverse(inv, grads, out):  # pragma: no cover - numba
    """out[inv[i]] += grads[i] in request order (inv < 0 skipped): :func:`dedup_slots`'s sums."""
    for i in range(inv.shape[0]):
        p = inv[i]
        if p >= 0:
            for c in range(grads.shape[1]):
                out[p, c] += grads[i, c]


@njit(cache=True, nogil=True)
def nonfinite_rows(x, out):  # pragma: no cover - numba
    """out[i] = any element of row i is NaN or ±Inf; returns how many rows are."""
    bad = 0
    for i in range(x.shape[0]):
        flag = False
        for c in range(x.shape[1]):
            if not np.isfinite(x[i, c]):
                flag = True
        out[i] = flag
        bad += flag
    return bad


def _kth_smallest(values: np.ndarray, k: int) -> int:
    """The k-th smallest (k >= 1) of integer ``values``, in O(n)."""
    lo = int(values.min())
    if int(values.max()) - lo < 4 * values.shape[0]:  # counting: introselect crawls on ties
        return lo + int(np.searchsorted(np.cumsum(np.bincount(values - lo)), k))
    return int(values[np.argpartition(values, k - 1)[k - 1]])


def smallest_keys(k: int, primary: np.ndarray, secondary: np.ndarray,
                  ids: np.ndarray) -> np.ndarray:
    """Positions of the k smallest entries by integer (primary, secondary, unique id), in
    O(n), in no particular order (eviction's and demotion's victims: LRU by (tick, uses), LFU
    by (uses, tick)). Each key is selected on, not sorted by: a bulk load leaves most rows
    on one tick, a tie a sort would pay n log n for."""
    if k >= primary.shape[0]:
        return np.arange(primary.shape[0])
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    kth = _kth_smallest(primary, k)
    below = np.flatnonzero(primary < kth)
    ties = np.flatnonzero(primary == kth)
    need = k - below.shape[0]
    second = secondary[ties]
    kth = _kth_smallest(second, need)
    below2, ties = ties[second < kth], ties[second == kth]
    need -= below2.shape[0]
    if need < ties.shape[0]:
        ties = ties[np.argpartition(ids[ties], need - 1)[:need]]
    return np.concatenate([below, below2, ties])
