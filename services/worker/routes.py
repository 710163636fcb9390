"""Where each group of a worker's tables gets its rows: the decision made at the first plan.

A group of tables (one dim, sent together) is *windowed* (looked up under the staleness
window), on the *hot chain* (:class:`~services.worker.heads.HotChain`: its own window,
``hot_window``), or *direct*: read by the compute thread just before its step and updated just
after, with no round trip (:class:`DirectHot`), where the rows live in this process (a
:class:`clients.rows.DirectRows`, e.g. embedded shards) or, for the only worker, in a
:class:`clients.rows.RowsReplica` of them (``seeding``: the replica's copies and updates sent
on to the PS, :class:`~services.worker.heads.ReplicaSeeds`). The windowed groups' *head ids*
(:class:`~services.worker.heads.HeadIds`) go direct where rows are, else on the hot chain.
With window 1, one worker, no barrier and rows in process, every group is direct and read
ahead (:mod:`services.worker.readahead`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from clients.rows import DirectRows, RowsClient, RowsReplica, StatefulRows
from services.common.sharding import ShardedIds
from services.worker.exchange import EmbeddingPath, RowsPath
from services.worker.heads import HeadIds, ReplicaSeeds, SplitBatch
from services.worker.pooling import BatchPlan
from services.worker.readahead import ReadAhead

__all__ = ["DirectHot", "Routes", "route_groups"]

Rows = list[np.ndarray]


class DirectHot:
    """Groups ``groups`` and the head ids of a step, read from and applied to ``rows`` by
    the compute thread (with ``read_ahead``: every group's rows read in a thread ahead of
    the step, then only what pushes since changed read again)."""

    def __init__(self, rows: DirectRows, groups: list[int], *, read_ahead: bool = False
                 ) -> None:
        self.rows, self.groups = rows, groups
        self.read_ahead = ReadAhead(rows, groups) if read_ahead else None

    def read(self, plan: BatchPlan, step: int, rows: Rows, split: SplitBatch | None) -> None:
        """Fill ``rows`` of the direct groups and of the head ids now: they include every
        earlier step's :meth:`apply`."""
        if self.read_ahead is not None:
            self.read_ahead.patch(plan, step, rows)
            return
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
        if self.read_ahead is not None:
            self.read_ahead.pushed(plan)

    @staticmethod
    def _heads(split: SplitBatch | None) -> list[tuple[int, ShardedIds, np.ndarray]]:
        """(group, layout, positions) of the head ids, per windowed group with some."""
        return [] if split is None else [(i, split.head.groups[i].layout, at) for i, (at, _)
                                         in split.groups.items() if at.size]


@dataclass
class Routes:
    """The groups by route (indices into the plan's groups)."""

    windowed: list[int]
    chain: list[int] = field(default_factory=list)  # on the hot chain (head ids' groups too)
    direct: DirectHot | None = None
    seeding: ReplicaSeeds | None = None
    heads: HeadIds | None = None


def route_groups(groups: int, hot: list[int], *, rows: RowsClient, path: EmbeddingPath,
                 replica: RowsReplica | None, window: int | None, hot_window: int,
                 workers: int, barrier: bool, head_rate: float | None, step: int,
                 voting: bool = False) -> Routes:
    """The routes of ``groups`` groups, ``hot`` of them hot tables, for a pipeline with these
    settings (``step``: the next batch's, where a replica starts seeding; ``voting``: the
    head ids are decided by every worker's counts, :mod:`services.worker.head_vote`)."""
    windowed = [i for i in range(groups) if i not in hot]
    unique_rows = isinstance(path, RowsPath)
    direct: DirectRows | None = rows if (
        isinstance(rows, DirectRows) and rows.direct and unique_rows) else None
    seeding = None
    if direct is None and hot_window == 1 and workers == 1 and replica is not None \
            and unique_rows and isinstance(rows, StatefulRows):
        direct = replica
        seeding = ReplicaSeeds(replica, step)
    if window == 1 and workers == 1 and direct is not None and not barrier:
        every = list(range(groups))  # every group read ahead, then patched
        return Routes([], direct=DirectHot(direct, every, read_ahead=True), seeding=seeding)
    routes = Routes(windowed, seeding=seeding)
    if hot and hot_window == 1 and direct is not None:
        routes.direct, hot = DirectHot(direct, hot), []
    if head_rate and windowed and unique_rows:
        replicated = seeding is not None
        routes.heads = HeadIds(windowed, head_rate, sticky=replicated,
                               defer=(window or 1) if replicated else 0,
                               voting=voting and not replicated)
        if direct is not None:
            routes.direct = routes.direct or DirectHot(direct, [])
        else:  # the head ids ride the hot chain
            hot = sorted(hot + windowed)
    routes.chain = hot
    return routes
