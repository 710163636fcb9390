"""Head ids: the rows of a large table that nearly every batch touches, kept synchronous.

Under a staleness window of S batches a row misses the updates of the batches in flight
that touched it. Under Zipf traffic that costs nothing for the tail of a table (an id seen
once in a thousand batches is rarely in flight twice) and much for its head: an id in every
batch misses S - 1 updates at every step, all of them pulling the same way. Hot *tables*
(:mod:`services.worker.pipeline`) keep whole small-vocabulary tables synchronous; head ids do
the same for the frequent ids of the large ones.

:class:`HeadIds` counts, per table, how often each id occurs in the recent batches (the last
``memory``) and calls *head* the ids seen at least ``rate`` times per batch on average (and
twice at least). Where the rows live in this process, :meth:`HeadIds.split` splits each of a
batch's windowed groups into its head ids, which the compute thread reads just before its step
and updates just after (no round trip, every earlier step's update seen), and the rest, which
keep the window. Which ids are head only decides the path a row's update takes, never whether
it is applied: an id that moves between the two is applied once either way.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from numba import njit

from services.common.errors import ConfigError
from services.common.sharding import ShardedIds
from services.worker.pooling import BatchPlan

__all__ = ["HeadIds", "SplitBatch"]

_MIX = np.uint64(0x9E3779B97F4A7C15)  # spreads a table's index over the bits of its ids' keys


def _keys(layout: ShardedIds) -> np.ndarray:
    """One uint64 key per id of the layout, the same for an id of one table in every batch
    (ids of two tables may share a key: that only moves a row to the other path)."""
    tables = layout.table_index().astype(np.uint64) + np.uint64(1)
    return layout.ids ^ (tables * _MIX)


@njit(cache=True, nogil=True)
def _hash_set(keys):  # pragma: no cover - numba
    """An open-addressing set of ``keys`` (0 marks a free slot: a key 0 is never a member)."""
    size = 2
    while size < 2 * keys.size:
        size *= 2
    table = np.zeros(size, dtype=np.uint64)
    mask = np.uint64(size - 1)
    for key in keys:
        at = (key * _MIX) >> np.uint64(40) & mask
        while table[at] != 0 and table[at] != key:
            at = (at + np.uint64(1)) & mask
        table[at] = key
    return table


@njit(cache=True, nogil=True)
def _members(table, keys, out):  # pragma: no cover - numba
    """``out[k]``: ``keys[k]`` is in the set ``table`` (:func:`_hash_set`)."""
    mask = np.uint64(table.size - 1)
    for k in range(keys.size):
        key = keys[k]
        at = (key * _MIX) >> np.uint64(40) & mask
        out[k] = False
        while table[at] != 0:
            if table[at] == key:
                out[k] = True
                break
            at = (at + np.uint64(1)) & mask


@dataclass(frozen=True, slots=True)
class SplitBatch:
    """One batch's windowed groups split into head ids and the rest.

    ``remote`` is the batch's plan with each split group's layout holding the rest only (what
    the lookups and pushes under the window send); ``groups`` maps a split group's index to
    the positions of its head ids in the full layout, their layout, and the positions of the
    rest."""

    remote: BatchPlan
    groups: dict[int, tuple[np.ndarray, ShardedIds, np.ndarray]]

    def rows(self, group: int, rest: np.ndarray, head: np.ndarray) -> np.ndarray:
        """The group's rows in the full layout's order from the rest's and the head's."""
        head_at, _, rest_at = self.groups[group]
        out = np.empty((head_at.size + rest_at.size, head.shape[1]), dtype=head.dtype)
        out[head_at] = head
        out[rest_at] = rest
        return out

    def remote_grads(self, grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Every group's gradients as the remote plan sends them (the rest's of split
        groups)."""
        return [g[self.groups[i][2]] if i in self.groups else g for i, g in enumerate(grads)]


class HeadIds:
    """Which ids of the windowed groups are head ids (see the module doc): the ids seen at
    least ``rate`` times per batch on average over the last ``memory`` batches (at most),
    decided after batches 1, 2, 4, ... up to ``memory`` and then every ``every`` batches."""

    def __init__(self, groups: Sequence[int], rate: float, memory: int = 16,
                 every: int = 64) -> None:
        if not rate > 0:
            raise ConfigError(f"head rate must be > 0, got {rate!r}")
        if memory < 1 or every < 1:
            raise ConfigError(f"head memory and every must be >= 1, got {memory!r}, {every!r}")
        self.groups = list(groups)
        self.rate = rate
        self.memory, self.every = memory, every
        self._seen: dict[int, collections.deque[tuple[np.ndarray, np.ndarray]]] = {
            i: collections.deque(maxlen=memory) for i in self.groups}
        self._head: dict[int, np.ndarray] = {}  # per group: a hash set of its head keys
        self._count_now = 0
        self._batches = 0

    def head_count(self) -> int:
        """Head ids now, over every group."""
        return self._count_now

    def split(self, plan: BatchPlan) -> SplitBatch | None:
        """Count ``plan``'s ids, then split its groups by the head ids decided so far (None
        where no group holds one)."""
        keys = {i: _keys(plan.groups[i].layout) for i in self.groups}
        self._count(plan, keys)
        groups = {}
        for i, k in keys.items():
            head = self._head.get(i)
            if head is None or not k.size:
                continue
            is_head = np.empty(k.size, dtype=bool)
            _members(head, k, is_head)
            if is_head.any():
                layout = plan.groups[i].layout
                groups[i] = (np.flatnonzero(is_head), layout.subset(is_head),
                             np.flatnonzero(~is_head))
        if not groups:
            return None
        remote = list(plan.groups)
        for i, (_, _, rest_at) in groups.items():
            layout = plan.groups[i].layout
            keep = np.zeros(layout.ids.size, dtype=bool)
            keep[rest_at] = True
            remote[i] = replace(remote[i], layout=layout.subset(keep))
        return SplitBatch(replace(plan, groups=remote), groups)

    def _count(self, plan: BatchPlan, keys: dict[int, np.ndarray]) -> None:
        """Remember the batch's keys with how often each occurs; decide the head ids again
        when it is time."""
        for i, k in keys.items():
            occurs = np.bincount(plan.groups[i].inverse, minlength=k.size)
            self._seen[i].append((k, occurs))
        self._batches += 1
        n = self._batches
        if n & (n - 1) == 0 and n <= self.memory or n % self.every == 0:
            heads = {i: self._decide(seen) for i, seen in self._seen.items()}
            self._count_now = sum(h.size for h in heads.values())
            self._head = {i: _hash_set(h) for i, h in heads.items() if h.size}

    def _decide(self, seen: collections.deque[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        keys = np.concatenate([k for k, _ in seen])
        occurs = np.concatenate([c for _, c in seen])
        unique, where = np.unique(keys, return_inverse=True)
        total = np.bincount(where, weights=occurs, minlength=unique.size)
        return unique[total >= max(2.0, self.rate * len(seen))]
