"""Numba kernels (GIL released) of the head ids' sets: build one, test keys against it,
split a layout by it, sum occurrences per distinct key, put rows in place."""

from __future__ import annotations

import numpy as np
from numba import njit

from services.common.sharding import GOLDEN

__all__ = ["MIX", "NO_MEMBERS", "hash_set", "members", "partition", "place_rows", "totals",
           "warm_up"]

MIX = GOLDEN  # spreads a table's index over the bits of its ids' keys
NO_MEMBERS = np.zeros(2, dtype=np.uint64)  # an empty set (:func:`hash_set`)


@njit(cache=True, nogil=True, inline="always")
def _bits(n):  # pragma: no cover - numba
    """The fewest bits (at least 1) whose table of ``1 << bits`` slots holds ``n``."""
    bits = 1
    while (1 << bits) < n:
        bits += 1
    return bits


@njit(cache=True, nogil=True)
def hash_set(keys):  # pragma: no cover - numba
    """An open-addressing set of ``keys`` (0 marks a free slot: a key 0 is never a member)."""
    bits = _bits(2 * keys.size)
    table = np.zeros(1 << bits, dtype=np.uint64)
    mask = np.uint64(table.size - 1)
    for key in keys:
        at = (key * MIX) >> np.uint64(64 - bits) & mask
        while table[at] != 0 and table[at] != key:
            at = (at + np.uint64(1)) & mask
        table[at] = key
    return table


@njit(cache=True, nogil=True, inline="always")
def _shift_mask(table):  # pragma: no cover - numba
    """The set ``table``'s hash shift and slot mask (:func:`hash_set`)."""
    return np.uint64(64 - _bits(table.size)), np.uint64(table.size - 1)


@njit(cache=True, nogil=True, inline="always")
def _has(table, key, shift, mask):  # pragma: no cover - numba
    """Whether ``key`` is in the set ``table`` (``shift``, ``mask``: :func:`_shift_mask`)."""
    at = (key * MIX) >> shift & mask
    while table[at] != 0:
        if table[at] == key:
            return True
        at = (at + np.uint64(1)) & mask
    return False


@njit(cache=True, nogil=True)
def members(table, keys, out):  # pragma: no cover - numba
    """``out[k]``: ``keys[k]`` is in the set ``table`` (:func:`hash_set`)."""
    shift, mask = _shift_mask(table)
    for k in range(keys.size):
        out[k] = _has(table, keys[k], shift, mask)


@njit(cache=True, nogil=True)
def partition(table, keys, cells, is_head):  # pragma: no cover - numba
    """Split a layout by membership of its ids' ``keys`` in the set ``table``
    (:func:`hash_set`; ``cells``: the layout's counts, flattened): ``is_head`` per id, then
    the head ids' count per cell, their positions and the rest's (each in layout order)."""
    shift, mask = _shift_mask(table)
    head_cells = np.zeros(cells.size, dtype=np.int64)
    heads = 0
    u = 0
    for c in range(cells.size):
        for _ in range(cells[c]):
            found = _has(table, keys[u], shift, mask)
            is_head[u] = found
            if found:
                head_cells[c] += 1
                heads += 1
            u += 1
    head_at = np.empty(heads, dtype=np.int64)
    rest_at = np.empty(keys.size - heads, dtype=np.int64)
    h = r = 0
    for u in range(keys.size):
        if is_head[u]:
            head_at[h] = u
            h += 1
        else:
            rest_at[r] = u
            r += 1
    return head_cells, head_at, rest_at


@njit(cache=True, nogil=True)
def totals(keys, occurs, first, total):  # pragma: no cover - numba
    """Per distinct key of ``keys`` (in first-appearance order): the position of its first
    occurrence and its summed ``occurs``; returns how many keys are distinct."""
    bits = _bits(2 * keys.size)
    table = np.full(1 << bits, -1, dtype=np.int64)  # -> its distinct key's number
    mask = np.uint64(table.size - 1)
    n = 0
    for j in range(keys.size):
        at = (keys[j] * MIX) >> np.uint64(64 - bits) & mask
        while table[at] >= 0 and keys[first[table[at]]] != keys[j]:
            at = (at + np.uint64(1)) & mask
        if table[at] < 0:
            table[at], first[n], total[n] = n, j, 0
            n += 1
        total[table[at]] += occurs[j]
    return n


@njit(cache=True, nogil=True)
def place_rows(out, at, rows):  # pragma: no cover - numba
    """``out[at] = rows`` (numpy's indexed assignment of rows takes ~5x as long)."""
    for j in range(at.size):
        for c in range(out.shape[1]):
            out[at[j], c] = rows[j, c]


def warm_up() -> None:
    """Run every kernel here once, on a few values of the types the head ids pass them, so
    that numba loads (or compiles) them before the first training step."""
    keys = np.arange(1, 5, dtype=np.uint64)
    table = hash_set(keys)
    members(table, keys, np.empty(keys.size, dtype=np.bool_))
    partition(table, keys, np.array([keys.size], dtype=np.int64),
              np.empty(keys.size, dtype=np.bool_))
    totals(keys, np.ones(keys.size, dtype=np.int64), np.empty(keys.size, dtype=np.int64),
           np.empty(keys.size, dtype=np.int64))
    rows = np.zeros((keys.size, 2), dtype=np.float32)
    place_rows(rows, np.arange(keys.size, dtype=np.int64), rows.copy())
