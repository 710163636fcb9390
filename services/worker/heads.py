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
    least ``rate`` times per batch on average over the last ``memory`` batches, decided again
    after batches 1, 2, 4, ... and then every ``memory`` batches."""

    def __init__(self, groups: Sequence[int], rate: float, memory: int = 16) -> None:
        if not rate > 0:
            raise ConfigError(f"head rate must be > 0, got {rate!r}")
        if memory < 1:
            raise ConfigError(f"head memory must be >= 1, got {memory!r}")
        self.groups = list(groups)
        self.rate = rate
        self.memory = memory
        self._seen: dict[int, collections.deque[tuple[np.ndarray, np.ndarray]]] = {
            i: collections.deque(maxlen=memory) for i in self.groups}
        self._head: dict[int, np.ndarray] = {i: np.empty(0, np.uint64) for i in self.groups}
        self._batches = 0

    def head_count(self) -> int:
        """Head ids now, over every group."""
        return sum(h.size for h in self._head.values())

    def split(self, plan: BatchPlan) -> SplitBatch | None:
        """Count ``plan``'s ids, then split its groups by the head ids decided so far (None
        where no group holds one)."""
        keys = {i: _keys(plan.groups[i].layout) for i in self.groups}
        self._count(plan, keys)
        groups = {}
        for i, k in keys.items():
            head = self._head[i]
            if not head.size or not k.size:
                continue
            at = np.minimum(np.searchsorted(head, k), head.size - 1)
            is_head = head[at] == k
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
        if n & (n - 1) == 0 and n <= self.memory or n % self.memory == 0:
            for i, seen in self._seen.items():
                self._head[i] = self._decide(seen)

    def _decide(self, seen: collections.deque[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        keys = np.concatenate([k for k, _ in seen])
        occurs = np.concatenate([c for _, c in seen])
        unique, where = np.unique(keys, return_inverse=True)
        total = np.bincount(where, weights=occurs, minlength=unique.size)
        return unique[total >= max(2.0, self.rate * len(seen))]
