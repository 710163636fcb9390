"""Numba kernels of the PS store: an open-addressing hash table id → value, and batch helpers.

Linear probing over a power-of-two array of keys and values (value ``-1`` marks an empty
bucket), deletion by backward shift (no tombstones, so probe chains never rot), growth by
doubling past load factor 3/4. Every operation takes a whole batch of ids; the loops run inside
numba with the GIL released. The same module holds the splitmix64 mixer that the
counter-based initializer and admission draws are built on, and :func:`unique_inverse`,
a hash-based ``np.unique(return_inverse=True)`` that keeps first-appearance order in O(n),
and the per-slot batch kernels of the row arena (gather, dedup, sum, touch, eviction's k
smallest). Where a loop does real work per random row, the next rows are prefetched
(``llvm.prefetch``): on this kind of machine that halves the time of hash probes and
optimizer updates.
"""

from __future__ import annotations

from typing import Any

import llvmlite.binding
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from services.common.sharding import GOLDEN
from services.common.sharding import mix64_scalar as mix64

__all__ = ["GOLDEN", "PREFETCH_DISTANCE", "IdHashTable", "PairHashTable", "SlotBits",
           "committed", "dedup_slots", "gather_rows", "mix64", "mix64_int", "nonfinite_rows",
           "prefetch", "prefetch_row", "smallest_keys", "sum_rows_by_inverse", "to_unit",
           "touch_slots", "unique_inverse"]

_S11 = np.uint64(11)
_EMPTY = -1
_MAX_VALUE = 2**31 - 1  # values are int32
_LOAD_NUM, _LOAD_DEN = 3, 4  # the index grows past a load factor of 3/4
PREFETCH_DISTANCE = 8  # rows ahead: random rows cost a DRAM round trip each otherwise
_I32 = ir.IntType(32)
_PREFETCH_NAME = ("llvm.prefetch.p0" if llvmlite.binding.llvm_version_info >= (15,)
                  else "llvm.prefetch.p0i8")


@intrinsic
def _prefetch(typingctx, array, row, col):  # pragma: no cover - compiled into numba kernels
    """Hint the CPU to fetch ``array[row, col]`` (``array[row]`` if 1-D) into cache."""
    sig = types.void(array, row, col)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        index = [args[1]] + [args[2]] * min(1, aryty.ndim - 1)
        index += [context.get_constant(types.intp, 0)] * (aryty.ndim - len(index))
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, index,
                                       wraparound=False, boundscheck=False)
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH_NAME)
        # rw=1 (will write), locality=3 (keep in all cache levels), cache type 1 (data)
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(_I32, 1), ir.Constant(_I32, 3),
                          ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def prefetch(array, index):  # pragma: no cover - numba
    """Prefetch ``array[index]`` of a 1-D array."""
    _prefetch(array, index, 0)


@njit(cache=True, inline="always")
def prefetch_row(array, row):  # pragma: no cover - numba
    """Prefetch every cache line of row ``row`` of a 2-D array."""
    step = max(1, 64 // array.itemsize)
    for col in range(0, array.shape[1], step):
        _prefetch(array, row, col)


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


# ---- batch kernels of the row arena (slots are int64, -1 = no row) ----------------------------


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
    """out[j] = rows[slots[j]] for slots >= 0."""
    for j in range(slots.shape[0]):
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
