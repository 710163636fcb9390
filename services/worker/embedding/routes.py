"""Where each group of a worker's tables gets its rows: the hot policy, decided at the first plan.

A group of tables (one dim, sent together) is *windowed* (looked up under the staleness
window), on the *hot chain* (:class:`~services.worker.embedding.hot_chain.HotChain`: its own
window, ``hot_window``), or *direct*: read by the compute thread just before its step and
updated just after, with no round trip (:class:`DirectHot`), where the rows live in this
process (a ``DirectRows``, e.g. embedded shards) or, for the only worker, in a ``RowsReplica``
of them (``seeding``: the replica's copies and updates sent on to the PS,
:class:`~services.worker.embedding.replica_seeds.ReplicaSeeds`). The windowed groups' *head
ids* (:class:`~services.worker.embedding.heads.HeadIds`) go direct where rows are, else on the
hot chain. With window 1, one worker, no barrier and rows in process, every group is direct
(``synchronous``): the compute thread reads a batch's rows after every earlier step's update,
as a sync run over the wire does, and the event loop only plans ahead. The decision reads one typed record of what
the rows can do (:class:`~services.worker.embedding.rows.RowsCapabilities`), taken once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.common.sharding import ShardedIds
from services.worker.embedding.exchange import EmbeddingPath
from services.worker.embedding.heads import HeadIds, SplitBatch
from services.worker.embedding.replica_seeds import ReplicaSeeds
from services.worker.embedding.rows import DirectRows, RowsCapabilities, RowsReplica
from services.worker.pooling import BatchPlan

__all__ = ["DirectHot", "HotPolicy", "RouteSettings"]

Rows = list[np.ndarray]
_NOT_READ = np.empty((0, 0), dtype=np.float32)  # a direct hot group's rows before it is read


class DirectHot:
    """Groups ``groups`` and the head ids of a step, read from and applied to ``rows`` by
    the compute thread."""

    def __init__(self, rows: DirectRows, groups: list[int]) -> None:
        self.rows, self.groups = rows, groups

    def read(self, plan: BatchPlan, rows: Rows, split: SplitBatch | None) -> None:
        """Fill ``rows`` of the direct groups and of the head ids now: they include every
        earlier step's :meth:`apply`."""
        for i in self.groups:
            rows[i] = self.rows.lookup_now(plan.groups[i].layout)
        for i, layout, _ in self._heads(split):
            assert split is not None  # the rest's rows spread by the pipeline's merge
            split.place_head(i, rows[i], self.rows.lookup_now(layout))

    def apply(self, plan: BatchPlan, grads: Rows, split: SplitBatch | None) -> None:
        """Apply the direct groups' and the head ids' gradients ``grads`` now."""
        for i in self.groups:
            self.rows.push_now(plan.groups[i].layout, grads[i])
        for i, layout, head_at in self._heads(split):
            self.rows.push_now(layout, grads[i][head_at])

    @staticmethod
    def _heads(split: SplitBatch | None) -> list[tuple[int, ShardedIds, np.ndarray]]:
        """(group, layout, positions) of the head ids, per windowed group with some."""
        return [] if split is None else [(i, split.head.groups[i].layout, at) for i, (at, _)
                                         in split.groups.items() if at.size]


@dataclass(frozen=True, slots=True)
class RouteSettings:
    """The pipeline's settings the routes depend on (``barrier``: pushes wait for every
    worker; ``voting``: the head ids are decided by every worker's counts,
    :mod:`services.worker.embedding.head_vote`)."""

    window: int | None
    hot_window: int
    workers: int
    barrier: bool
    head_rate: float | None
    voting: bool = False


@dataclass
class HotPolicy:
    """The groups by route (indices into the plan's groups), decided once (:meth:`decide`)."""

    windowed: list[int]
    chain: list[int] = field(default_factory=list)  # on the hot chain (head ids' groups too)
    direct: DirectHot | None = None
    seeding: ReplicaSeeds | None = None
    heads: HeadIds | None = None
    # every group direct (window 1, one worker, rows in process): batches planned ahead only
    synchronous: bool = False

    @classmethod
    def decide(cls, groups: int, hot: list[int], *, capabilities: RowsCapabilities,
               path: EmbeddingPath, replica: RowsReplica | None, settings: RouteSettings,
               step: int) -> HotPolicy:
        """The routes of ``groups`` groups, ``hot`` of them hot tables, over rows that can
        do ``capabilities`` (``step``: the next batch's, where a replica starts seeding)."""
        s = settings
        windowed = [i for i in range(groups) if i not in hot]
        direct: DirectRows | None = capabilities.direct if path.unique_rows else None
        seeding = None
        if direct is None and s.hot_window == 1 and s.workers == 1 and replica is not None \
                and path.unique_rows and capabilities.stateful is not None:
            direct = replica
            seeding = ReplicaSeeds(replica, step)
        if s.window == 1 and s.workers == 1 and direct is not None and not s.barrier:
            return cls([], direct=DirectHot(direct, list(range(groups))), seeding=seeding,
                       synchronous=True)
        policy = cls(windowed, seeding=seeding)
        if hot and s.hot_window == 1 and direct is not None:
            policy.direct, hot = DirectHot(direct, hot), []
        if s.head_rate and windowed and path.unique_rows:
            replicated = seeding is not None
            policy.heads = HeadIds(windowed, s.head_rate, sticky=replicated,
                                   defer=(s.window or 1) if replicated else 0,
                                   voting=s.voting and not replicated)
            if direct is not None:
                policy.direct = policy.direct or DirectHot(direct, [])
            else:  # the head ids ride the hot chain
                hot = sorted(hot + windowed)
        policy.chain = hot
        return policy

    @property
    def direct_groups(self) -> list[int]:
        """The groups the compute thread reads and updates."""
        return self.direct.groups if self.direct is not None else []

    def merge(self, plan: BatchPlan, windowed: Rows, hot: Rows | None,
              split: SplitBatch | None, dims: dict[str, int]) -> Rows:
        """Every group's rows in group order (a windowed group's head ids from the hot chain
        where they ride it); a direct hot group's are empty, and direct head ids' rows unset
        (the rest's spread around them), until the compute thread reads them."""
        heads = split.groups if split is not None and self.direct is not None else {}
        if hot is None and not self.direct_groups and not heads:
            return windowed
        out = [_NOT_READ] * len(plan.groups)
        for i, rows in zip(self.windowed, windowed, strict=True):
            out[i] = rows
        if hot is not None:
            for i, rows in zip(self.chain, hot, strict=True):
                out[i] = rows if split is None or i not in split.groups else \
                    split.rows(i, out[i], rows)
        for i, (head_at, _) in heads.items():
            if head_at.size:
                assert split is not None
                out[i] = split.spread(i, out[i], dims[plan.groups[i].layout.tables[0]])
        return out
