"""Hot rows: head ids (the rows of a large table that nearly every batch touches) and the hot
chain that keeps them, with the hot tables, under a window of their own.

Under a staleness window of S batches a row misses the updates of the batches in flight
that touched it. Under Zipf traffic that costs nothing for the tail of a table (an id seen
once in a thousand batches is rarely in flight twice) and much for its head: an id in every
batch misses S - 1 updates at every step, all of them pulling the same way. Hot *tables*
(:mod:`services.worker.embedding.pipeline`) keep whole small-vocabulary tables synchronous; head
ids do the same for the frequent ids of the large ones. The hot chain that carries them where the
rows are remote is :mod:`services.worker.embedding.hot_chain`; the replica's copies of them,
:mod:`services.worker.embedding.replica_seeds`.

:class:`HeadIds` counts, per table, how often each id occurs in the recent batches (the last
``memory``) and calls *head* the ids seen at least ``rate`` times per batch on average (and
twice at least). :meth:`HeadIds.split` splits each of a batch's windowed groups into its head
ids and the rest, which keeps the window. Where the rows live in this process the compute
thread reads the head ids just before its step and updates them just after (no round trip,
every earlier step's update seen); where a replica of them does (one worker, remote rows:
:class:`ReplicaSeeds`), a head id stays one for the run, and the new head ids of a decision
after the first batch switch ``defer`` batches later: meanwhile they are read with the rest and
their gradients held back, so that their copy needs no wait for the pushes in flight, and at
the switch the held gradients go to the copy and on to the PS in step order. Else they ride
:class:`HotChain` with the hot tables. Which ids are head only decides the path a row's update
takes, never whether it is applied: an id that moves between the two is applied once either
way.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from services.common.errors import ConfigError
from services.common.sharding import ShardedIds
from services.worker.embedding.head_vote import Ballot
from services.worker.head_kernels import (
    MIX,
    NO_MEMBERS,
    hash_set,
    members,
    partition,
    place_rows,
    totals,
)
from services.worker.pooling import BatchPlan

__all__ = ["HeadIds", "SplitBatch"]

Rows = list[np.ndarray]  # per group of tables, aligned with its layout's ids
Seen = collections.deque[tuple[np.ndarray, np.ndarray, ShardedIds]]  # keys, occurrences, layout


def _keys(layout: ShardedIds) -> np.ndarray:
    """One uint64 key per id of the layout, the same for an id of one table in every batch
    (ids of two tables may share a key: that only moves a row to the other path)."""
    tables = layout.table_index().astype(np.uint64) + np.uint64(1)
    return layout.ids ^ (tables * MIX)


@dataclass(frozen=True, slots=True)
class SplitBatch:
    """One batch's windowed groups split into head ids and the rest.

    ``remote`` is the batch's plan with each windowed group's layout holding the rest only
    (what the lookups under the window read), ``head`` the plan with each windowed group's
    layout holding its head ids only (possibly none); ``groups`` maps a windowed group's index
    to the positions of its head ids in the full layout and those of the rest. Ids decided
    head but not switched yet are among the rest, their gradients held back
    (:class:`ReplicaSeeds`): ``pushed`` is ``remote`` less them, and ``held`` maps a group that
    has some to their layout, their positions and those of the rest pushed. ``switched``: the
    batch is the first to read the ids last decided as head ids.
    """

    remote: BatchPlan
    head: BatchPlan
    groups: dict[int, tuple[np.ndarray, np.ndarray]]
    pushed: BatchPlan
    held: dict[int, tuple[ShardedIds, np.ndarray, np.ndarray]] = field(default_factory=dict)
    switched: bool = False

    def rows(self, group: int, rest: np.ndarray, head: np.ndarray) -> np.ndarray:
        """The group's rows in the full layout's order from the rest's and the head's."""
        out = self.spread(group, rest, head.shape[1] if head.size else rest.shape[1])
        self.place_head(group, out, head)
        return out

    def spread(self, group: int, rest: np.ndarray, dim: int) -> np.ndarray:
        """The group's rows in the full layout's order with the rest's in place and the head
        ids' unset until :meth:`place_head` (the compute thread reads those just before its
        step: spreading the rest before then keeps that copy off it)."""
        head_at, rest_at = self.groups[group]
        rest = self._fitted(group, rest, rest_at, dim, "others")
        out = np.empty((head_at.size + rest_at.size, dim), dtype=rest.dtype)
        place_rows(out, rest_at, rest)
        return out

    def place_head(self, group: int, out: np.ndarray, head: np.ndarray) -> None:
        """Write the head ids' rows into ``out``, the group's rows as :meth:`spread` gave."""
        head_at, rest_at = self.groups[group]
        head = self._fitted(group, head, head_at, out.shape[1], "head ids")
        if out.shape[0] != head_at.size + rest_at.size:
            raise ValueError(f"group {group}: {out.shape[0]} rows for "
                             f"{head_at.size + rest_at.size} ids")
        place_rows(out, head_at, head)

    @staticmethod
    def _fitted(group: int, rows: np.ndarray, at: np.ndarray, dim: int, what: str
                ) -> np.ndarray:
        """``rows`` as ``(len(at), dim)`` (an empty array of any shape fits none), or
        ValueError: the compiled placement reads what it is given."""
        rows = np.reshape(rows, (-1, dim)) if not rows.size else rows
        if rows.shape != (at.size, dim):
            raise ValueError(f"group {group}: rows {rows.shape} for {at.size} {what}")
        return rows

    def pushed_grads(self, grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Every group's gradients as ``pushed`` sends them."""
        return [g[self.held[i][2]] if i in self.held else
                g[self.groups[i][1]] if i in self.groups else g for i, g in enumerate(grads)]

    def held_back(self, grads: Sequence[np.ndarray]) -> list[tuple[ShardedIds, np.ndarray]]:
        """The held ids' layout and gradients, per group that has some."""
        return [(layout, grads[i][at]) for i, (layout, at, _) in self.held.items()]

    def head_grads(self, grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Every group's gradients as ``head`` sends them (the head ids' of windowed groups)."""
        return [g[self.groups[i][0]] if i in self.groups else g for i, g in enumerate(grads)]


class HeadIds:
    """Which ids of the windowed groups are head ids (see the module doc): the ids seen at
    least ``rate`` times per batch on average over the last ``memory`` batches (at most),
    decided after batches 1, 2, 4, ... up to ``memory`` and then every ``every`` batches.
    ``sticky``: a head id stays one for the rest of the run (a replica of the head rows then
    never holds a row that the PS has since updated); ``defer``: the new head ids of a
    decision after the first batch switch ``defer`` batches later (decisions then after
    batches 1 and ``memory`` only, then every ``every``)."""

    def __init__(self, groups: Sequence[int], rate: float, memory: int = 16,
                 every: int = 64, *, sticky: bool = False, defer: int = 0,
                 voting: bool = False) -> None:
        if not rate > 0:
            raise ConfigError(f"head rate must be > 0, got {rate!r}")
        if memory < 1 or every < 1:
            raise ConfigError(f"head memory and every must be >= 1, got {memory!r}, {every!r}")
        if voting and (sticky or defer):
            raise ConfigError("head ids voted on by every worker are neither sticky nor deferred")
        self.voting = voting
        self.groups = list(groups)
        self.rate = rate
        self.memory, self.every = memory, every
        self.defer = defer
        self._seen: dict[int, Seen] = {}
        self._head: dict[int, np.ndarray] = {}  # per group: a hash set of its head keys
        self._sticky: dict[int, np.ndarray] | None = {} if sticky else None  # every head key
        self._fresh: dict[int, ShardedIds] = {}  # sticky: head ids new since take_fresh()
        self.reset()

    def reset(self) -> None:
        """Forget every batch seen and every head id."""
        self._seen = {i: collections.deque(maxlen=self.memory) for i in self.groups}
        self._head, self._fresh = {}, {}
        self._sticky = None if self._sticky is None else {}
        self._count_now = self._batches = 0
        self._pending: dict[int, np.ndarray] = {}  # per group: head keys not switched yet
        self._pending_set: dict[int, np.ndarray] = {}  # the same as hash sets
        self._switch_at: int | None = None  # the batch that switches them
        self._ballot: Ballot | None = None  # voting: this worker's counts, for the vote

    def head_count(self) -> int:
        """Head ids decided so far, over every group."""
        return self._count_now

    @property
    def deferring(self) -> bool:
        """Whether head ids decided are waiting for their switch."""
        return self._switch_at is not None

    def take_fresh(self) -> dict[int, ShardedIds]:
        """``sticky``: per group, the layout of the head ids decided since the last call."""
        fresh, self._fresh = self._fresh, {}
        return fresh

    def split(self, plan: BatchPlan) -> SplitBatch:
        """Count ``plan``'s ids, then split its windowed groups by the head ids decided so
        far."""
        switched = self._batches + 1 == self._switch_at
        if switched:
            self._pending, self._pending_set, self._switch_at = {}, {}, None
            self._head = {i: hash_set(h) for i, h in (self._sticky or {}).items() if h.size}
        keys = {i: _keys(plan.groups[i].layout) for i in self.groups}
        self._count(plan, keys)
        remote, head, pushed = list(plan.groups), list(plan.groups), list(plan.groups)
        groups, held = {}, {}
        for i, k in keys.items():
            is_head = np.empty(k.size, dtype=bool)
            layout = plan.groups[i].layout
            head_cells, head_at, rest_at = partition(self._head.get(i, NO_MEMBERS), k,
                                                      layout.counts.ravel(), is_head)
            groups[i] = (head_at, rest_at)
            head_counts = head_cells.reshape(layout.counts.shape)
            mine = ShardedIds(layout.tables, layout.ids[head_at], head_counts, tag=layout.tag)
            head[i] = replace(head[i], layout=mine)
            if head_at.size:  # else the rest is the whole layout
                rest = ShardedIds(layout.tables, layout.ids[rest_at],
                                  layout.counts - head_counts, tag=layout.tag)
                remote[i] = replace(remote[i], layout=rest)
            pushed[i] = remote[i]
            if (pending := self._pending_set.get(i)) is not None:
                is_held = np.zeros(k.size, dtype=bool)
                members(pending, k, is_held)
                is_held &= ~is_head
                if is_held.any():
                    pushed[i] = replace(pushed[i], layout=layout.subset(~is_held & ~is_head))
                    held[i] = (layout.subset(is_held), np.flatnonzero(is_held),
                               np.flatnonzero(~is_held & ~is_head))
        return SplitBatch(replace(plan, groups=remote), replace(plan, groups=head), groups,
                          replace(plan, groups=pushed), held, switched)

    def _count(self, plan: BatchPlan, keys: dict[int, np.ndarray]) -> None:
        """Remember the batch's keys with how often each occurs; decide the head ids again
        when it is time. Sticky, with ``defer``: the new head ids of a decision after the
        first batch are switched ``defer`` batches later (until then their rows are read
        as the rest's and their gradients held back: their copy need not wait)."""
        for i, k in keys.items():
            occurs = np.bincount(plan.groups[i].inverse, minlength=k.size)
            self._seen[i].append((k, occurs, plan.groups[i].layout))
        self._batches += 1
        n = self._batches
        if not self._decides(n):
            return
        if self.voting:  # decided with every worker's counts: elect()
            self._ballot = Ballot({i: self._counts(seen) for i, seen in self._seen.items()},
                                  self._threshold(len(next(iter(self._seen.values())))))
            return
        heads: dict[int, np.ndarray] = {}
        defer = self.defer and n > 1
        for i, seen in self._seen.items():
            found, at = self._decide(seen)
            if self._sticky is not None:
                old = self._sticky.get(i, found[:0])
                if (new := ~np.isin(found, old)).any():
                    self._fresh[i] = self._layout_of(seen, at[new])
                    if defer:
                        self._pending[i] = np.union1d(self._pending.get(i, found[:0]),
                                                      found[new])
                found = self._sticky[i] = np.union1d(found, old)
            heads[i] = found
        if defer and self._fresh:
            self._switch_at = n + self.defer
            self._pending_set = {i: hash_set(p) for i, p in self._pending.items()}
        self._count_now = sum(h.size for h in heads.values())
        self._head = {i: hash_set(h) for i in heads
                      if (h := np.setdiff1d(heads[i], self._pending.get(i, heads[i][:0]))).size}

    def _decides(self, n: int) -> bool:
        """Whether to decide after batch ``n``: 1, 2, 4, ... up to ``memory``, then every
        ``every``; with ``defer``, after 1 and ``memory`` only, then every ``every`` (a
        decision while others wait for their switch delays those)."""
        if n % self.every == 0 or n == 1 or n == self.memory:
            return True
        return not self.defer and n & (n - 1) == 0 and n <= self.memory

    def _threshold(self, batches: int) -> float:
        """Occurrences in ``batches`` batches that make an id head."""
        return max(2.0, self.rate * batches)

    def _decide(self, seen: Seen) -> tuple[np.ndarray, np.ndarray]:
        """The head keys of ``seen`` and where each first occurs in its concatenated keys."""
        keys = np.concatenate([k for k, _, _ in seen])
        occurs = np.concatenate([c for _, c, _ in seen])
        first, total = np.empty(keys.size, dtype=np.int64), np.empty(keys.size, dtype=np.int64)
        n = totals(keys, occurs, first, total)
        at = first[:n][total[:n] >= self._threshold(len(seen))]
        at = at[np.argsort(keys[at], kind="stable")]  # in key order
        return keys[at], at

    @staticmethod
    def _counts(seen: Seen) -> tuple[np.ndarray, np.ndarray]:
        """The distinct keys of ``seen`` in key order, and how often each occurs."""
        keys = np.concatenate([k for k, _, _ in seen])
        occurs = np.concatenate([c for _, c, _ in seen])
        first, total = np.empty(keys.size, dtype=np.int64), np.empty(keys.size, dtype=np.int64)
        n = totals(keys, occurs, first, total)
        order = np.argsort(keys[first[:n]], kind="stable")
        return keys[first[:n]][order], total[:n][order]

    def take_ballot(self) -> Ballot | None:
        """Voting: this worker's counts when a decision is due (once), else None."""
        ballot, self._ballot = self._ballot, None
        return ballot

    def elect(self, heads: dict[int, np.ndarray]) -> None:
        """Voting: the head keys per group every worker agreed on; they split the batches
        from the next one on."""
        self._count_now = sum(h.size for h in heads.values())
        self._head = {i: hash_set(h) for i, h in heads.items() if h.size}

    @staticmethod
    def _layout_of(seen: Seen, at: np.ndarray) -> ShardedIds:
        """The layout of the ids at positions ``at`` of ``seen``'s concatenated keys."""
        ids = np.concatenate([layout.ids for _, _, layout in seen])[at]
        tables = np.concatenate([layout.table_index() for _, _, layout in seen])[at]
        last = seen[-1][2]
        return ShardedIds.of_tables({name: ids[tables == j] for j, name in enumerate(last.tables)},
                                    last.num_shards)[0]
