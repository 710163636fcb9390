"""A replica of the hot rows (one worker, remote rows): what it must hold before each step.

Where one worker alone writes its hot groups and head ids and the rows are remote, a
:class:`~services.worker.embedding.rows.RowsReplica` in this process keeps them: the compute
thread reads and updates it with no round trip, and :class:`ReplicaSeeds` copies each row from
the PS once every earlier step's push is acknowledged and sends the replica's updates on to
the PS in step order (:mod:`services.worker.embedding.heads` decides which ids).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np

from services.common.sharding import ShardedIds
from services.worker.embedding.exchange import EmbeddingPath
from services.worker.embedding.heads import HeadIds, SplitBatch
from services.worker.embedding.rows import RowsClient, RowsReplica, StatefulRows
from services.worker.pooling import BatchPlan

__all__ = ["Acknowledged", "ReplicaSeeds", "Seeds"]

Rows = list[np.ndarray]  # per group of tables, aligned with its layout's ids


class Acknowledged:
    """Which steps' pushes are acknowledged, in step order: :meth:`wait` returns once every
    step below a given one is. A replica of the head rows copies a new head id's row only
    then, so that the copy holds every update the id had while it was not yet head."""

    def __init__(self, first: int = 0) -> None:
        self.below = first  # every step below this one is acknowledged
        self._done: set[int] = set()
        self._moved = asyncio.Event()

    def add(self, step: int) -> None:
        """Step ``step``'s push is acknowledged."""
        self._done.add(step)
        while self.below in self._done:
            self._done.discard(self.below)
            self.below += 1
        self._moved.set()

    async def wait(self, step: int) -> None:
        """Return once every step below ``step`` is acknowledged."""
        while self.below < step:
            self._moved.clear()
            await self._moved.wait()


@dataclass(frozen=True, slots=True)
class Seeds:
    """What a replica must hold before a batch's step: ``fresh``, the layouts of the head ids
    decided at the batch, and ``mine``, of its head ids (both windowed rows before: copied
    once every earlier step's push is acknowledged; each of ``mine`` was ``fresh`` at an
    earlier batch, whose copy may still be under way); ``hot``, its hot groups' layouts (never
    windowed: copied where not held, without waiting). ``later``: ``fresh`` is switched at a
    later batch (copied meanwhile); ``switch``: batch ``step`` switches the ids last
    decided."""

    fresh: list[ShardedIds] = field(default_factory=list)
    mine: list[ShardedIds] = field(default_factory=list)
    hot: list[ShardedIds] = field(default_factory=list)
    later: bool = False
    switch: bool = False
    step: int | None = None  # the batch's


class ReplicaSeeds:
    """What a :class:`services.worker.embedding.rows.RowsReplica` of the hot groups and head ids
    must hold before each batch's step, copied from the PS once every earlier step's push is
    acknowledged (an id's updates from before it was head are then in its copy), and its
    updates sent on to the PS in step order."""

    def __init__(self, replica: RowsReplica, first_step: int) -> None:
        self.replica = replica
        self._copying: set[asyncio.Future[None]] = set()  # copies under way
        self._later: asyncio.Future[None] | None = None  # copies of ids switched later
        self.begin(first_step, None)

    def begin(self, first_step: int, heads: HeadIds | None) -> None:
        """A new run, whose first step is ``first_step``: the replica copies every row again
        (the PS's may have changed between runs), so the head ids are decided anew."""
        self.replica.clear()
        if self._later is not None:
            self._later.cancel()  # a failed run's, left waiting
        self._acked = Acknowledged(first_step)  # steps whose push is acknowledged
        self._done = Acknowledged(first_step)  # steps whose gradients are pushed or held
        self._later = None
        self._held: list[list[tuple[ShardedIds, np.ndarray]]] = []  # per step, in order
        self._released: list[asyncio.Future[Any]] = []  # held gradients on their way
        if heads is not None:
            heads.reset()

    def hold(self, plan: BatchPlan, split: SplitBatch | None, grads: Rows) -> None:
        """``plan``'s step is done: keep the gradients it holds back. Call it in step order."""
        if split is not None and split.held:
            self._held.append(split.held_back(grads))
        if (tag := plan.groups[0].layout.tag) is not None:
            self._done.add(tag[1])

    async def flush(self, rows: RowsClient) -> None:
        """The run's end: the gradients held back go to the replica and on to the PS."""
        await self._release(rows, None)

    async def _release(self, rows: RowsClient, step: int | None) -> None:
        """Once the ids held back are copied and every step before ``step`` is done (None:
        every step), apply the gradients held for them to the replica and send them on to
        the PS, in step order (before any later step's)."""
        if self._later is not None:
            await self._later
        if step is not None:
            await self._done.wait(step)
        held, self._held = self._held, []
        sent = []
        for layout, grads in (part for parts in held for part in parts):
            self.replica.push_now(layout, grads)
            sent.append(rows.push_sharded(replace(layout, tag=None), grads))
        if sent:  # on their way now, before any later step's (the run's end awaits them)
            self._released.append(asyncio.ensure_future(asyncio.gather(*sent)))
        if step is None:
            await asyncio.gather(*self._released)

    async def _copy_later(self, source: StatefulRows, fresh: list[ShardedIds],
                          before: asyncio.Future[None] | None) -> None:
        """Copy ``fresh`` once every step before its decision is acknowledged (no later push
        touches those rows: their gradients are held back)."""
        if before is not None:
            await before
        tag = fresh[0].tag
        await self._acked.wait(tag[1] if tag is not None else 0)
        for layout in fresh:
            await self.replica.seed(source, layout)

    def send(self, path: EmbeddingPath, rows: RowsClient, plan: BatchPlan,
             split: SplitBatch | None, grads: Rows, hot: Sequence[int]) -> asyncio.Future[Any]:
        """Push ``plan``'s updates of the replicated rows (its hot groups' ``hot`` and its head
        ids') on to the PS. Call it in step order: the pushes leave in that order, each shard
        receives them on its one push stream and serves a stream's messages in order, so it
        applies them in step order, as the replica did, without waiting for the previous
        step's acknowledgement (Adagrad's result depends on the order). A push retried after
        a broken connection can land after later ones."""
        heads = [] if split is None else [i for i, (at, _) in split.groups.items() if at.size]
        head_grads = split.head_grads(grads) if split is not None else grads
        for released in self._released:  # a held gradient's push failed: so does this one
            if released.done() and released.exception() is not None:
                raise cast(BaseException, released.exception())
        return asyncio.ensure_future(asyncio.gather(
            *(path.push(rows, plan, i, grads[i]) for i in hot),
            *(path.push(rows, cast(SplitBatch, split).head, i, head_grads[i]) for i in heads)))

    @property
    def acknowledged_below(self) -> int:
        """Every step below this one has its push acknowledged (a failed push's counts too)."""
        return self._acked.below

    def acknowledged(self, plan: BatchPlan) -> None:
        """``plan``'s push is acknowledged."""
        if (tag := plan.groups[0].layout.tag) is not None:
            self._acked.add(tag[1])

    @staticmethod
    def layouts(plan: BatchPlan, split: SplitBatch | None, hot: Sequence[int],
                heads: HeadIds | None) -> Seeds:
        """What the replica must hold before ``plan``'s step (``hot``: its hot groups)."""
        tag = plan.groups[0].layout.tag
        fresh = [] if heads is None else [replace(layout, tag=tag) for layout in
                                          heads.take_fresh().values()]
        mine = [] if split is None else [split.head.groups[i].layout
                                         for i, (at, _) in split.groups.items() if at.size]
        return Seeds(fresh, mine, [plan.groups[i].layout for i in hot],
                     later=heads is not None and heads.deferring and bool(fresh),
                     switch=split is not None and split.switched,
                     step=tag[1] if tag is not None else None)

    async def copy(self, rows: RowsClient, seeds: Seeds) -> None:
        """Copy the rows of ``seeds`` (of one tagged step) the replica lacks from ``rows``,
        after the copies under way (one copy of a row, not one per batch that needs it; the
        batches after a decision wait for its copy only), a head id's once every earlier
        step's push is acknowledged; ids switched later are copied meanwhile, and switched
        with the gradients held back for them."""
        source = cast(StatefulRows, rows)
        if seeds.later:
            self._later = asyncio.ensure_future(self._copy_later(source, seeds.fresh,
                                                                 self._later))
            seeds = replace(seeds, fresh=[])
        if seeds.switch:
            await self._release(rows, seeds.step)
        holds = self.replica.holds
        if not seeds.fresh and all(holds(layout) for layout in seeds.mine + seeds.hot):
            return
        earlier = list(self._copying)
        done = asyncio.get_running_loop().create_future()
        self._copying.add(done)
        try:
            await asyncio.gather(*earlier, return_exceptions=True)
            mine = [layout for layout in seeds.mine if not holds(layout)]  # else copied since
            if seeds.fresh or mine:  # (two tables' ids may share a head key: not yet copied)
                tag = (seeds.fresh + mine)[0].tag
                await self._acked.wait(tag[1] if tag is not None else 0)
            for layout in seeds.fresh + mine + seeds.hot:  # in turn: one may hold ids of another
                await self.replica.seed(source, layout)
        finally:
            self._copying.discard(done)
            done.set_result(None)
