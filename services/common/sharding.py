"""Placement of embedding ids on PS shards: the one function every service uses.

:func:`shard_of` owns the rule (splitmix64 of the id, modulo the shard count).
:class:`ShardedIds` is a worker's step laid out for the wire: the unique ids of several tables
ordered by shard, then table, so that each shard's share is one contiguous slice and the rows
that come back, concatenated in shard order, line up with the ids (:func:`place_ids` builds it
in one hash pass, with the index of every id of the batch into the layout).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from numba import njit

__all__ = ["GOLDEN", "ShardedIds", "mix64", "mix64_scalar", "place_ids", "rows_at",
           "shard_of", "split_by_shard"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: salts and strides


def mix64(ids: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer (:func:`mix64_scalar`) of every id: a bijection on uint64 that
    spreads sequential ids evenly."""
    z = np.asarray(ids, dtype=np.uint64)
    out = np.empty(z.size, dtype=np.uint64)
    _mix64_all(np.ascontiguousarray(z).reshape(-1), out)
    return out.reshape(z.shape)


def shard_of(ids: np.ndarray | int, num_shards: int) -> np.ndarray:
    """The shard (0..num_shards-1) that owns each id; stable across machines and runs."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    ids = np.asarray(ids, dtype=np.uint64)
    if num_shards == 1:
        return np.zeros(ids.shape, dtype=np.int64)
    return (mix64(ids) % np.uint64(num_shards)).astype(np.int64)


def split_by_shard(ids: np.ndarray, num_shards: int) -> list[np.ndarray]:
    """Positions into ``ids`` for each shard, in order, so results can be put back in place."""
    shards = shard_of(ids, num_shards)
    order = np.argsort(shards, kind="stable")
    bounds = np.searchsorted(shards[order], np.arange(num_shards + 1))
    return [order[bounds[k]:bounds[k + 1]] for k in range(num_shards)]


@njit(cache=True, inline="always")
def mix64_scalar(z):  # pragma: no cover - numba
    """:func:`mix64` of one uint64 inside numba kernels (wrapping arithmetic)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True, nogil=True)
def _mix64_all(ids, out):  # pragma: no cover - numba
    for i in range(ids.size):
        out[i] = mix64_scalar(ids[i])


@njit(cache=True, nogil=True, inline="always")
def _dedup_table(values, bounds, owner, table, slots, size, num_shards, num_tables, first,
                 unique_id, unique_key, count):  # pragma: no cover - numba
    """Dedup the values of ``table``'s segments in ``slots[:size]`` (each slot an (id,
    unique index + 1) pair on one cache line, 0: empty), numbering new ids from ``count``;
    returns the next number."""
    mask = np.uint64(size - 1)
    pow2 = num_shards & (num_shards - 1) == 0  # the modulo as a mask: no 64-bit division
    low = np.uint64(num_shards - 1)
    slots[:size, 1] = 0
    for s in range(owner.size):
        if owner[s] != table:
            continue
        for i in range(bounds[s], bounds[s + 1]):
            v = values[i]
            mixed = mix64_scalar(v)
            j = np.int64(mixed & mask)
            while True:
                taken = slots[j, 1]
                if taken == 0:
                    slots[j, 0] = v
                    slots[j, 1] = np.uint64(count + 1)
                    unique_id[count] = v
                    shard = mixed & low if pow2 else mixed % np.uint64(num_shards)
                    unique_key[count] = np.int64(shard) * num_tables + table
                    first[i] = count
                    count += 1
                    break
                if slots[j, 0] == v:
                    first[i] = np.int64(taken) - 1
                    break
                j = (j + 1) & np.int64(size - 1)
    return count


@njit(cache=True, nogil=True)
def _place(values, bounds, owner, num_tables, num_shards):  # pragma: no cover - numba
    """Dedup ``(owner table, id)`` pairs and order the unique ones by (shard, table, first
    appearance). Segment ``s`` of ``values`` (``bounds[s]:bounds[s + 1]``) belongs to table
    ``owner[s]``. Returns the ordered ids, the (shard, table) counts and, per value, its index
    into the ordered ids.

    One table at a time, in a hash table sized to that table's values (a batch's share of one
    table stays in cache; one for the whole batch missed it on every probe)."""
    n = values.size
    sizes = np.zeros(num_tables, dtype=np.int64)
    for s in range(owner.size):
        sizes[owner[s]] += bounds[s + 1] - bounds[s]
    capacity = 16
    while capacity < 2 * sizes.max():
        capacity *= 2
    slots = np.empty((capacity, 2), dtype=np.uint64)
    inverse = np.empty(n, dtype=np.int64)  # value -> unique index (table-major), then position
    unique_id = np.empty(n, dtype=np.uint64)
    unique_key = np.empty(n, dtype=np.int64)   # shard * num_tables + table
    count = 0
    for table in range(num_tables):
        if sizes[table]:
            size = 16
            while size < 2 * sizes[table]:
                size *= 2
            count = _dedup_table(values, bounds, owner, table, slots, size, num_shards,
                                 num_tables, inverse, unique_id, unique_key, count)
    counts = np.zeros(num_shards * num_tables, dtype=np.int64)
    for u in range(count):
        counts[unique_key[u]] += 1
    cursor = np.zeros(num_shards * num_tables, dtype=np.int64)
    for k in range(1, counts.size):
        cursor[k] = cursor[k - 1] + counts[k - 1]
    position = np.empty(count, dtype=np.int64)
    ids = np.empty(count, dtype=np.uint64)
    for u in range(count):
        p = cursor[unique_key[u]]
        cursor[unique_key[u]] += 1
        position[u] = p
        ids[p] = unique_id[u]
    for i in range(n):
        inverse[i] = position[inverse[i]]
    return ids, counts.reshape(num_shards, num_tables), inverse


@dataclass(frozen=True, slots=True)
class ShardedIds:
    """Unique ids of several tables ordered by shard, then table.

    The ids of ``tables[j]`` on shard ``k`` are ``ids[start:start + counts[k, j]]``, shard
    ``k``'s whole share is ``ids[bounds[k]:bounds[k + 1]]``. ``tag`` (worker rank, training
    step, number of workers) travels with the layout's lookup and push, so that the PS counts the staleness of
    each lookup over every worker's pushes (``services.ps.staleness``).
    """

    tables: tuple[str, ...]
    ids: np.ndarray     # uint64 (U,)
    counts: np.ndarray  # int64 (num_shards, len(tables))
    bounds: np.ndarray = field(init=False)  # (num_shards + 1,): each shard's share, lo to hi
    tag: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        bounds = np.zeros(self.counts.shape[0] + 1, dtype=np.int64)
        np.cumsum(self.counts.sum(axis=1), out=bounds[1:])
        object.__setattr__(self, "bounds", bounds)

    @property
    def num_shards(self) -> int:
        return int(self.counts.shape[0])

    def subset(self, keep: np.ndarray) -> ShardedIds:
        """The layout of the ids where the boolean mask ``keep`` holds, in the same order,
        with the same tables and tag."""
        counts = np.bincount(self._cells()[keep], minlength=self.counts.size)
        return ShardedIds(self.tables, self.ids[keep], counts.reshape(self.counts.shape),
                          tag=self.tag)

    def _cells(self) -> np.ndarray:
        """For every id, its (shard, table) cell's index in ``counts.ravel()``."""
        return np.repeat(np.arange(self.counts.size), self.counts.ravel())

    def table_index(self) -> np.ndarray:
        """For every id, the index of its table in ``tables``."""
        cells = np.arange(self.counts.size) % len(self.tables)
        return np.repeat(cells, self.counts.ravel())

    def table_ids(self, table: str) -> np.ndarray:
        """The ids of one table, shard by shard."""
        j = self.tables.index(table)
        starts = self.bounds[:-1] + self.counts[:, :j].sum(axis=1)
        return np.concatenate([self.ids[s:s + c] for s, c in
                               zip(starts, self.counts[:, j], strict=True)])

    @classmethod
    def of_tables(cls, ids_by_table: Mapping[str, np.ndarray], num_shards: int, *,
                  dedup: bool = True) -> tuple[ShardedIds, dict[str, np.ndarray]]:
        """The layout of already-unique ids per table, and for each table where its ids
        went (``layout.ids[where[t]] == ids_by_table[t]``). ``dedup=False`` (lookups, where
        an id twice only reads its row twice): one shard's layout is the ids as given, with
        no hashing."""
        tables = list(ids_by_table)
        parts = [np.asarray(ids_by_table[t], dtype=np.uint64).reshape(-1) for t in tables]
        bounds = np.cumsum([0] + [p.size for p in parts])
        if not dedup and num_shards == 1:
            layout = cls(tuple(tables), np.concatenate(parts) if parts else
                         np.empty(0, dtype=np.uint64), np.diff(bounds).reshape(1, -1))
            return layout, {t: np.arange(lo, hi) for t, lo, hi in
                            zip(tables, bounds[:-1], bounds[1:], strict=True)}
        layout, inverse = place_ids(parts, list(range(len(tables))), tables, num_shards)
        return layout, {t: inverse[lo:hi] for t, lo, hi in
                        zip(tables, bounds[:-1], bounds[1:], strict=True)}


def rows_at(rows: np.ndarray, where: np.ndarray) -> np.ndarray:
    """``rows[where]``: a view of ``rows`` where ``where`` is one run of consecutive
    positions (one shard: every table's ids are one run of the layout), else a copy."""
    if where.size and where[-1] - where[0] == where.size - 1 \
            and (where.size == 1 or bool(np.all(where[1:] > where[:-1]))):
        return rows[int(where[0]):int(where[-1]) + 1]
    return rows[where]


def place_ids(segments: Sequence[np.ndarray], owners: Sequence[int], tables: Sequence[str],
              num_shards: int) -> tuple[ShardedIds, np.ndarray]:
    """Dedup and lay out ids: segment ``s`` (uint64) holds ids of ``tables[owners[s]]``.

    Returns the :class:`ShardedIds` and, for every id of the concatenated segments, its
    index into ``layout.ids``. Ids that repeat within a table are placed once.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    values = (np.concatenate(segments) if len(segments) != 1 else segments[0]).astype(
        np.uint64, copy=False)
    bounds = np.zeros(len(segments) + 1, dtype=np.int64)
    np.cumsum([s.size for s in segments], out=bounds[1:])
    ids, counts, inverse = _place(values, bounds, np.asarray(owners, dtype=np.int64),
                                  len(tables), num_shards)
    return ShardedIds(tuple(tables), ids, counts), inverse
