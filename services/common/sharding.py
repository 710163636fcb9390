"""Placement of embedding ids on PS shards: the one function every service uses."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["mix64", "shard_of", "split_by_shard", "split_tables_by_shard"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(ids: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer: a bijection on uint64 that spreads sequential ids evenly."""
    z = np.asarray(ids, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


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


def split_tables_by_shard(ids_by_table: Mapping[str, np.ndarray], num_shards: int
                          ) -> dict[str, list[np.ndarray]]:
    """:func:`split_by_shard` of every table's ids at once (one placement pass and one sort
    for a whole training step instead of one per table)."""
    names = list(ids_by_table)
    sizes = np.array([np.size(ids_by_table[t]) for t in names], dtype=np.int64)
    starts = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    if not names or starts[-1] == 0:
        return {t: [np.empty(0, dtype=np.int64) for _ in range(num_shards)] for t in names}
    if num_shards == 1:
        return {t: [np.arange(n, dtype=np.int64)] for t, n in zip(names, sizes, strict=True)}
    ids = np.concatenate([np.asarray(ids_by_table[t], dtype=np.uint64) for t in names])
    key = np.repeat(np.arange(len(names), dtype=np.int64) * num_shards, sizes)
    key += shard_of(ids, num_shards)
    order = np.argsort(key, kind="stable")
    bounds = np.searchsorted(key[order], np.arange(len(names) * num_shards + 1))
    return {t: [order[bounds[i * num_shards + k]:bounds[i * num_shards + k + 1]] - starts[i]
                for k in range(num_shards)] for i, t in enumerate(names)}
