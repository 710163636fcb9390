"""The id ↔ slot map of a row arena in 8 bytes a slot and 4 a bucket.

A table's rows live in slots; it needs each slot's id (eviction, snapshots, demotion) and each
id's slot (every lookup and push). :class:`SlotIndex` keeps the first as an array ``slot_ids``
and the second as a linear-probing hash table whose buckets are an int32 each (-1 for empty):
the slot (a table's slots stay below its bucket count) and, in the bits above it, a tag of the
id's hash (7 bits at 10M rows), so that a probe reads ``slot_ids`` to compare the id almost
only at the right bucket. Against a table of (id, slot) buckets (12 bytes at a load of 3/8 to
3/4: 16-32 bytes a row) that is 5-11 bytes a row, for a dependent read, which the kernels
prefetch in two stages (the bucket, then its slot's id). Deletion by backward shift (reading
the id of each entry it passes), growth by doubling past a load of 3/4, as
:class:`~services.ps.hashtable.IdHashTable`."""

from __future__ import annotations

import numpy as np
from numba import njit

from services.ps.arena import committed
from services.ps.hashtable import mix64
from services.ps.prefetch import PREFETCH_DISTANCE, prefetch

__all__ = ["SlotIndex", "find_slots"]

_EMPTY = -1
_MAX_SLOT = 2**31 - 1
_LOAD_NUM, _LOAD_DEN = 3, 4
_NEAR, _FAR = PREFETCH_DISTANCE, 2 * PREFETCH_DISTANCE  # ids ahead: slot ids, then buckets


@njit(cache=True, inline="always")
def _geometry(buckets):  # pragma: no cover - numba
    """(bucket mask, bits of a slot number, their mask): a slot is below the bucket count."""
    bits = 1
    while (1 << bits) < buckets.shape[0]:
        bits += 1
    return buckets.shape[0] - 1, bits, (np.int64(1) << bits) - 1


@njit(cache=True, inline="always")
def _tag(h, bits):  # pragma: no cover - numba
    """A bucket's bits above its slot (up to bit 30): the top bits of the id's hash ``h``."""
    if bits >= 31:
        return np.int64(0)
    return np.int64(h >> np.uint64(33 + bits)) << bits


@njit(cache=True, inline="always")
def _home(k, mask):  # pragma: no cover - numba
    return np.int64(mix64(k) & np.uint64(mask))


@njit(cache=True, inline="always")
def _prefetch_ahead(buckets, slot_ids, ids, j, mask, low):  # pragma: no cover - numba
    """Prefetch the home bucket of ``ids[j + _FAR]`` and the id of the slot in the home
    bucket of ``ids[j + _NEAR]`` (a guess: right unless its probe goes on; an empty bucket's
    is harmless)."""
    n = ids.shape[0]
    prefetch(buckets, _home(ids[min(j + _FAR, n - 1)], mask))
    prefetch(slot_ids, np.int64(buckets[_home(ids[min(j + _NEAR, n - 1)], mask)]) & low)


@njit(cache=True, inline="always")
def _probe(buckets, slot_ids, k, mask, bits, low):  # pragma: no cover - numba
    """The bucket of id ``k``, or the empty bucket that ends its probe chain."""
    h = mix64(k)
    i = np.int64(h & np.uint64(mask))
    tag = _tag(h, bits)
    while True:
        e = np.int64(buckets[i])
        if e == _EMPTY or ((e & ~low) == tag and slot_ids[e & low] == k):
            return i
        i = (i + 1) & mask


@njit(cache=True, nogil=True)
def find_slots(buckets, slot_ids, ids, out):  # pragma: no cover - numba
    """``out[j]``: the slot of ``ids[j]`` in the index of arrays ``(buckets, slot_ids)``
    (:attr:`SlotIndex.arrays`), or -1 where absent."""
    mask, bits, low = _geometry(buckets)
    n = ids.shape[0]
    for j in range(n):
        _prefetch_ahead(buckets, slot_ids, ids, j, mask, low)
        e = np.int64(buckets[_probe(buckets, slot_ids, ids[j], mask, bits, low)])
        out[j] = _EMPTY if e == _EMPTY else e & low


@njit(cache=True, nogil=True)
def _insert(buckets, slot_ids, ids, slots):  # pragma: no cover - numba
    """Map ``ids[j]`` to ``slots[j]`` (moving a present id); returns how many ids were new."""
    mask, bits, low = _geometry(buckets)
    added = 0
    for j in range(ids.shape[0]):
        _prefetch_ahead(buckets, slot_ids, ids, j, mask, low)
        k = ids[j]
        i = _probe(buckets, slot_ids, k, mask, bits, low)
        added += buckets[i] == _EMPTY
        if slot_ids[slots[j]] != k:  # slot_ids may be a file's records: keep its pages clean
            slot_ids[slots[j]] = k
        buckets[i] = _tag(mix64(k), bits) | slots[j]
    return added


@njit(cache=True, nogil=True)
def _place(buckets, slot_ids, ids, slots):  # pragma: no cover - numba
    """Map ``ids[j]`` (distinct, none held) to ``slots[j]`` at the first empty bucket from
    each home: no id is read to compare."""
    mask, bits, _ = _geometry(buckets)
    for j in range(ids.shape[0]):
        h = mix64(ids[j])
        i = np.int64(h & np.uint64(mask))
        while buckets[i] != _EMPTY:
            i = (i + 1) & mask
        if slot_ids[slots[j]] != ids[j]:
            slot_ids[slots[j]] = ids[j]
        buckets[i] = _tag(h, bits) | slots[j]


@njit(cache=True, nogil=True)
def _rehash(buckets, slot_ids, old):  # pragma: no cover - numba
    """Put every slot of the ``old`` buckets into the empty, larger ``buckets``."""
    mask, bits, _ = _geometry(buckets)
    _, _, old_low = _geometry(old)
    for b in range(old.shape[0]):
        e = np.int64(old[b])
        if e != _EMPTY:
            s = e & old_low
            h = mix64(slot_ids[s])
            i = np.int64(h & np.uint64(mask))
            while buckets[i] != _EMPTY:
                i = (i + 1) & mask
            buckets[i] = _tag(h, bits) | s


@njit(cache=True, nogil=True)
def _remove(buckets, slot_ids, ids, out):  # pragma: no cover - numba
    """Unmap ids (backward-shift deletion); ``out[j]`` is the slot ``ids[j]`` had, or -1."""
    mask, bits, low = _geometry(buckets)
    removed = 0
    for j in range(ids.shape[0]):
        _prefetch_ahead(buckets, slot_ids, ids, j, mask, low)
        i = _probe(buckets, slot_ids, ids[j], mask, bits, low)
        if buckets[i] == _EMPTY:
            out[j] = _EMPTY
            continue
        out[j] = np.int64(buckets[i]) & low
        removed += 1
        hole = i
        nxt = (i + 1) & mask
        ahead = nxt  # the cluster's next ids, fetched together rather than one miss after another
        for _ in range(_NEAR):
            e = np.int64(buckets[ahead])
            if e == _EMPTY:
                break
            prefetch(slot_ids, e & low)
            ahead = (ahead + 1) & mask
        while buckets[nxt] != _EMPTY:
            home = np.int64(mix64(slot_ids[np.int64(buckets[nxt]) & low]) & np.uint64(mask))
            # the entry at nxt may fill the hole if the hole lies on its probe path home..nxt
            if ((nxt - home) & mask) >= ((nxt - hole) & mask):
                buckets[hole] = buckets[nxt]
                hole = nxt
            nxt = (nxt + 1) & mask
        buckets[hole] = _EMPTY
    return removed


def _buckets_for(rows: int) -> int:
    return 1 << max(3, (_LOAD_DEN * max(1, rows) // _LOAD_NUM).bit_length())


class SlotIndex:
    """Which slot holds each id and which id each slot holds (``slot_ids``; a freed slot
    keeps its last id until reused). Not thread-safe: its table serialises access.

    ``slot_ids`` is its own array of ``slots`` ids, or one of the caller's (``slot_ids=``, say
    the id field of records on disk), which it then reads and writes in place and which the
    caller points it at anew (``index.slot_ids = ...``) when the records move."""

    __slots__ = ("_buckets", "_owns_ids", "_size", "slot_ids")

    def __init__(self, slots: int, slot_ids: np.ndarray | None = None) -> None:
        self._owns_ids = slot_ids is None
        self.slot_ids = committed((int(slots),), np.uint64) if slot_ids is None else slot_ids
        self._buckets = committed((_buckets_for(slots),), np.int32, _EMPTY)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        """Bytes in RAM: the buckets, and ``slot_ids`` where it is the index's own."""
        return int(self._buckets.nbytes + (self.slot_ids.nbytes if self._owns_ids else 0))

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(buckets, slot_ids)`` as stored, for :func:`find_slots` (valid until it grows)."""
        return self._buckets, self.slot_ids

    def grow_slots(self, slots: int) -> None:
        """Room for slots up to ``slots`` (the arena grew) in the index's own ``slot_ids``."""
        old = self.slot_ids
        if self._owns_ids and slots > old.shape[0]:
            self.slot_ids = committed((int(slots),), np.uint64)
            self.slot_ids[:old.shape[0]] = old

    def has_room(self, more: int) -> bool:
        """Whether ``more`` entries (of slots below the bucket count) fit without growing."""
        return _buckets_for(self._size + more) <= self._buckets.shape[0]

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id (int64), -1 where absent."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        out = np.empty(ids.shape[0], dtype=np.int64)
        find_slots(self._buckets, self.slot_ids, ids, out)
        return out

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Map distinct ``ids[j]`` to ``slots[j]`` (below :meth:`grow_slots`'s), slots no
        other id holds; an id already held moves to its new slot."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        if slots.shape != ids.shape or (slots.size and (
                slots.min() < 0 or slots.max() >= min(self.slot_ids.shape[0], _MAX_SLOT + 1))):
            raise ValueError("insert needs one slot in [0, slots) per id")
        # a table's slots stay below its most rows ever, so below the bucket count, which
        # bounds the slot bits of a bucket; a slot beyond is met by more buckets
        size = max(_buckets_for(self._size + ids.shape[0]),
                   1 << int(slots.max(initial=0)).bit_length())
        if size > self._buckets.shape[0]:
            old = self._buckets
            self._buckets = committed((size,), np.int32, _EMPTY)
            _rehash(self._buckets, self.slot_ids, old)
        self._size += int(_insert(self._buckets, self.slot_ids, ids, slots))

    def insert_new(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """:meth:`insert` of distinct ids the index does not hold (say, to build it anew from
        stored rows), without reading any id: past the page cache, a compare of records' ids is
        a random read of the file each."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        if not self.has_room(ids.shape[0]) or (slots.size and slots.max() >= min(
                self._buckets.shape[0], self.slot_ids.shape[0])):
            raise ValueError("insert_new needs room for the ids and slots below the bucket count")
        _place(self._buckets, self.slot_ids, ids, slots)
        self._size += ids.shape[0]

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Unmap ids; returns the slots they had (-1 where absent)."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        out = np.empty(ids.shape[0], dtype=np.int64)
        self._size -= int(_remove(self._buckets, self.slot_ids, ids, out))
        return out
