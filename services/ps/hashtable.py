"""Numba hash tables of the PS store: id → value, and (table, id) → value, batch by batch.

Linear probing over a power-of-two array of keys and values (value ``-1`` marks an empty
bucket), deletion by backward shift (no tombstones, so probe chains never rot), growth by
doubling past load factor 3/4. Every operation takes a whole batch of ids; the loops run inside
numba with the GIL released, the next buckets prefetched (:mod:`services.ps.prefetch`). Here
too: :func:`unique_inverse`, a hash-based ``np.unique(return_inverse=True)`` that keeps
first-appearance order in O(n), and the splitmix64 helpers that the counter-based initializer
and admission draws are built on. The row arena's batch kernels are in :mod:`services.ps.arena`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from services.common.sharding import GOLDEN
from services.common.sharding import mix64_scalar as mix64
from services.ps.prefetch import PREFETCH_DISTANCE, prefetch

__all__ = ["GOLDEN", "IdHashTable", "PairHashTable", "mix64", "mix64_int", "to_unit",
           "unique_inverse"]

_S11 = np.uint64(11)
_EMPTY = -1
_MAX_VALUE = 2**31 - 1  # values are int32
_LOAD_NUM, _LOAD_DEN = 3, 4  # the index grows past a load factor of 3/4
def mix64_int(z: int) -> int:
    """:func:`mix64` on a Python int (taken modulo 2^64), for seeds computed outside numba."""
    return int(mix64(np.uint64(z & 0xFFFFFFFFFFFFFFFF)))


@njit(cache=True, inline="always")
def to_unit(z):  # pragma: no cover - numba
    """A uint64 to a float64 uniform in [0, 1) (its top 53 bits)."""
    return np.float64(z >> _S11) * (1.0 / 9007199254740992.0)


@njit(cache=True, inline="always")
def _prefetch_bucket(keys, vals, key, mask):  # pragma: no cover - numba
    home = np.int64(mix64(key) & np.uint64(mask))
    prefetch(keys, home)
    prefetch(vals, home)


@njit(cache=True, nogil=True)
def _find(keys, vals, ids, out):  # pragma: no cover - numba
    """``out[j]``: the value of ``ids[j]``, or -1 where absent."""
    mask = keys.shape[0] - 1
    n = ids.shape[0]
    for j in range(n):
        if j + PREFETCH_DISTANCE < n:
            _prefetch_bucket(keys, vals, ids[j + PREFETCH_DISTANCE], mask)
        k = ids[j]
        i = np.int64(mix64(k) & np.uint64(mask))
        while True:
            v = vals[i]
            if v == _EMPTY:
                out[j] = _EMPTY
                break
            if keys[i] == k:
                out[j] = v
                break
            i = (i + 1) & mask


@njit(cache=True, nogil=True)
def _insert(keys, vals, ids, values):  # pragma: no cover - numba
    """Insert or overwrite; returns how many keys were new."""
    mask = keys.shape[0] - 1
    added = 0
    n = ids.shape[0]
    for j in range(n):
        if j + PREFETCH_DISTANCE < n:
            _prefetch_bucket(keys, vals, ids[j + PREFETCH_DISTANCE], mask)
        k = ids[j]
        i = np.int64(mix64(k) & np.uint64(mask))
        while vals[i] != _EMPTY and keys[i] != k:
            i = (i + 1) & mask
        if vals[i] == _EMPTY:
            added += 1
        keys[i] = k
        vals[i] = values[j]
    return added


@njit(cache=True, nogil=True)
def _remove(keys, vals, ids, out):  # pragma: no cover - numba
    """Remove ids (backward-shift deletion); out[j] is the removed value or -1."""
    mask = keys.shape[0] - 1
    removed = 0
    n = ids.shape[0]
    for j in range(n):
        if j + PREFETCH_DISTANCE < n:
            _prefetch_bucket(keys, vals, ids[j + PREFETCH_DISTANCE], mask)
        k = ids[j]
        i = np.int64(mix64(k) & np.uint64(mask))
        while vals[i] != _EMPTY and keys[i] != k:
            i = (i + 1) & mask
        if vals[i] == _EMPTY:
            out[j] = _EMPTY
            continue
        out[j] = vals[i]
        removed += 1
        hole = i
        nxt = (i + 1) & mask
        while vals[nxt] != _EMPTY:
            home = np.int64(mix64(keys[nxt]) & np.uint64(mask))
            # the entry at nxt may fill the hole if the hole lies on its probe path home..nxt
            if ((nxt - home) & mask) >= ((nxt - hole) & mask):
                keys[hole] = keys[nxt]
                vals[hole] = vals[nxt]
                hole = nxt
            nxt = (nxt + 1) & mask
        vals[hole] = _EMPTY
    return removed


@njit(cache=True, nogil=True)
def _count_up(keys, vals, ids, out):  # pragma: no cover - numba
    """Add one to the value of each id (absent ids start at 0); out[j] is the new value."""
    mask = keys.shape[0] - 1
    added = 0
    n = ids.shape[0]
    for j in range(n):
        if j + PREFETCH_DISTANCE < n:
            _prefetch_bucket(keys, vals, ids[j + PREFETCH_DISTANCE], mask)
        k = ids[j]
        i = np.int64(mix64(k) & np.uint64(mask))
        while vals[i] != _EMPTY and keys[i] != k:
            i = (i + 1) & mask
        if vals[i] == _EMPTY:
            keys[i] = k
            vals[i] = 1
            added += 1
        else:
            vals[i] += 1
        out[j] = vals[i]
    return added


@njit(cache=True, nogil=True)
def _unique_inverse(ids, keys, vals, uniq, inv):  # pragma: no cover - numba
    mask = keys.shape[0] - 1
    count = 0
    n = ids.shape[0]
    for j in range(n):
        if j + PREFETCH_DISTANCE < n:
            _prefetch_bucket(keys, vals, ids[j + PREFETCH_DISTANCE], mask)
        k = ids[j]
        i = np.int64(mix64(k) & np.uint64(mask))
        while vals[i] != _EMPTY and keys[i] != k:
            i = (i + 1) & mask
        if vals[i] == _EMPTY:
            keys[i] = k
            vals[i] = count
            uniq[count] = k
            count += 1
        inv[j] = vals[i]
    return count


def _pow2_at_least(n: int) -> int:
    return 1 << max(3, (int(n) - 1).bit_length())


def unique_inverse(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(uniq, inverse)`` with ``uniq[inverse] == ids``; uniq in first-appearance order."""
    ids = np.ascontiguousarray(ids, dtype=np.uint64)
    size = _pow2_at_least(2 * ids.shape[0])
    keys = np.empty(size, dtype=np.uint64)
    vals = np.full(size, _EMPTY, dtype=np.int64)
    uniq = np.empty(ids.shape[0], dtype=np.uint64)
    inv = np.empty(ids.shape[0], dtype=np.int64)
    n = _unique_inverse(ids, keys, vals, uniq, inv)
    return uniq[:n].copy(), inv


class IdHashTable:
    """A map uint64 id → value in [0, 2**31) (a row slot, or a sighting count), stored in 12
    bytes a bucket (uint64 keys, int32 values); results come back as int64.

    Not thread-safe: the owner (one :class:`~services.ps.store.EmbeddingTable`) serialises
    access. All methods take and return whole arrays.
    """

    __slots__ = ("_keys", "_size", "_vals")

    def __init__(self, capacity: int = 1024) -> None:
        size = _pow2_at_least(_LOAD_DEN * max(1, capacity) // _LOAD_NUM + 1)
        self._keys = np.empty(size, dtype=np.uint64)
        self._keys.fill(0)  # written now, so the first inserts do not page-fault
        self._vals = np.full(size, _EMPTY, dtype=np.int32)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def buckets(self) -> int:
        return int(self._keys.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self._keys.nbytes + self._vals.nbytes)

    def reserve(self, more: int) -> None:
        """Grow (by doubling) so that ``more`` new keys keep the load factor <= 3/4."""
        need = self._size + int(more)
        if _LOAD_DEN * need <= _LOAD_NUM * self.buckets:
            return
        size = self.buckets
        while _LOAD_DEN * need > _LOAD_NUM * size:
            size *= 2
        keys, vals = self.items()
        self._keys = np.empty(size, dtype=np.uint64)
        self._keys.fill(0)
        self._vals = np.full(size, _EMPTY, dtype=np.int32)
        _insert(self._keys, self._vals, keys, vals)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The value of each id, or -1 where absent."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        out = np.empty(ids.shape[0], dtype=np.int64)
        _find(self._keys, self._vals, ids, out)
        return out

    def insert(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Set ``ids[j] → values[j]`` (values in [0, 2**31))."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        values = np.ascontiguousarray(values, dtype=np.int64)
        if values.shape != ids.shape or (values.size and (values.min() < 0
                                                          or values.max() > _MAX_VALUE)):
            raise ValueError("insert needs one value in [0, 2**31) per id")
        self.reserve(ids.shape[0])
        self._size += int(_insert(self._keys, self._vals, ids, values))

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Remove ids; returns the removed values (-1 where an id was absent)."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        out = np.empty(ids.shape[0], dtype=np.int64)
        self._size -= int(_remove(self._keys, self._vals, ids, out))
        return out

    def count_up(self, ids: np.ndarray) -> np.ndarray:
        """Increment a counter per id (absent ids start from 0); returns the new counts."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        self.reserve(ids.shape[0])
        out = np.empty(ids.shape[0], dtype=np.int64)
        self._size += int(_count_up(self._keys, self._vals, ids, out))
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, values)`` of every entry, in bucket order."""
        used = self._vals != _EMPTY
        return self._keys[used], self._vals[used].astype(np.int64)

    def clear(self) -> None:
        self._vals.fill(_EMPTY)
        self._size = 0


@njit(cache=True, nogil=True)
def _find_pairs(owners, keys, vals, tables, ids, out):  # pragma: no cover - numba
    mask = keys.shape[0] - 1
    for j in range(ids.shape[0]):
        t, k = tables[j], ids[j]
        i = np.int64(mix64(k ^ (np.uint64(t) * GOLDEN)) & np.uint64(mask))
        out[j] = _EMPTY
        while vals[i] != _EMPTY:
            if keys[i] == k and owners[i] == t:
                out[j] = vals[i]
                break
            i = (i + 1) & mask


@njit(cache=True, nogil=True)
def _insert_pairs(owners, keys, vals, tables, ids, values):  # pragma: no cover - numba
    """Insert absent pairs (a present one is overwritten); returns how many were new."""
    mask = keys.shape[0] - 1
    added = 0
    for j in range(ids.shape[0]):
        t, k = tables[j], ids[j]
        i = np.int64(mix64(k ^ (np.uint64(t) * GOLDEN)) & np.uint64(mask))
        while vals[i] != _EMPTY and not (keys[i] == k and owners[i] == t):
            i = (i + 1) & mask
        if vals[i] == _EMPTY:
            added += 1
        owners[i], keys[i], vals[i] = t, k, values[j]
    return added


class PairHashTable:
    """A map (table number, uint64 id) → value >= 0: one probe for the ids of many tables
    (where an :class:`IdHashTable` per table would take a call per table). No removal."""

    __slots__ = ("_keys", "_owners", "_size", "_vals")

    def __init__(self, capacity: int = 1024) -> None:
        self._allocate(_pow2_at_least(_LOAD_DEN * max(1, capacity) // _LOAD_NUM + 1))

    def _allocate(self, size: int) -> None:
        self._owners = np.zeros(size, dtype=np.int64)
        self._keys = np.zeros(size, dtype=np.uint64)
        self._vals = np.full(size, _EMPTY, dtype=np.int64)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def find(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The value of each ``(tables[j], ids[j])``, or -1 where absent."""
        out = np.empty(ids.shape[0], dtype=np.int64)
        _find_pairs(self._owners, self._keys, self._vals,
                    np.ascontiguousarray(tables, dtype=np.int64),
                    np.ascontiguousarray(ids, dtype=np.uint64), out)
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tables, ids, values)`` of every entry, in bucket order."""
        used = self._vals != _EMPTY
        return self._owners[used], self._keys[used], self._vals[used]

    def insert(self, tables: np.ndarray, ids: np.ndarray, values: np.ndarray) -> None:
        """Set ``(tables[j], ids[j]) → values[j]``, growing by doubling past a load of 3/4."""
        need = self._size + ids.shape[0]
        if _LOAD_DEN * need > _LOAD_NUM * self._keys.shape[0]:
            old = self.items()
            self._allocate(_pow2_at_least(_LOAD_DEN * need // _LOAD_NUM + 1))
            self._size = int(_insert_pairs(self._owners, self._keys, self._vals, *old))
        self._size += int(_insert_pairs(
            self._owners, self._keys, self._vals, np.ascontiguousarray(tables, dtype=np.int64),
            np.ascontiguousarray(ids, dtype=np.uint64),
            np.ascontiguousarray(values, dtype=np.int64)))
