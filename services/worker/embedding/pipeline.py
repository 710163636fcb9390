"""The embedding pipeline of one worker: planning, staleness slots, riders, lookahead, pushes.

size: feed, riders and pushes share one run's state (slots, chain, seeds) and its order of
events; the window, hot policy, chain and seeds are modules of their own beside it.

It is the part of a training step that talks to the embedding rows, apart from the model (as
torchrec's ``TrainPipelineSparseDist`` is): it plans each batch (dedup ids per table, laid out by
shard), looks its rows up ahead of compute and pushes its row gradients back, through a
:class:`services.worker.embedding.rows.RowsClient` only (gRPC, a child process, or the PS's shards
in this process). What a lookup and a push carry is its embedding path's
(:mod:`services.worker.embedding.exchange`: unique rows, or DES's per-sample partial sums); the
slots, riders and hot tables below are the same for both.

The bound on staleness is ``window`` slots (:mod:`services.worker.embedding.slots`): a batch takes
one before its lookup, and its push task's completion frees it (a done-callback, as arq's worker
releases its semaphore), or hands it to a *rider*, a batch whose lookup that push carried. The
staleness of a batch is the number of earlier batches whose push is not yet acknowledged when its
lookup starts, so it is at most ``window - 1``; ``window=None`` (async mode) has no bound, only
``prefetch`` lookups ahead of compute, and no hot tables or head ids (nothing synchronous).

With a ``barrier`` (a wait for every worker, e.g. across the gloo ranks), every push, once
acknowledged, waits at the barrier before it frees its slot, and no batch rides on a push: with one
slot that is the *globally synchronous* mode, where every worker's push of step t is applied at
every shard before any worker's lookup of step t + 1 starts.

With a ``step_gate`` (a collective of every worker: does every worker have a batch for this
step?), each batch waits at it before it takes a slot or rides a push, and the next batch waits
until it holds its slot: no worker starts step t before every worker holds its slot of step
t - 1, so a lookup misses at most S pushes of any worker (stale synchronous parallel, with S
the window), and every worker stops at the step where the first one runs out of batches.

Every batch a run trains has its layouts tagged (worker rank, step, workers): the PS counts, per
lookup, the earlier pushes of every worker it did not see (``services.ps.staleness``).

*Hot tables* (whose first batch holds at most ``hot_ratio`` distinct ids per sample) and the *head
ids* of the others (their most frequent ids, ``head_rate``, :mod:`services.worker.embedding.heads`)
are rows nearly every batch touches, which stale updates hurt most. They have a window of their own,
``hot_window`` (1: synchronous): batch t gets them only once the push of batch t - hot_window to
them is acknowledged, in the same message (:class:`HotChain`), or, where the rows are in this
process, the compute thread reads them just before its step (:meth:`Prepared.read_hot`) and
applies their gradients just after (:meth:`Prepared.apply_hot`), through the batch it was
handed. Which group goes which way is decided at the first plan
(:mod:`services.worker.embedding.routes`).

Usage (the Trainer runs compute in a thread between ``feed`` and ``push``)::

    pipeline = EmbeddingPipeline(rows_client, window=8)
    pipeline.begin()
    feeding = asyncio.create_task(pipeline.feed(batches, queue.put, errors.append))
    while (item := await queue.get()) is not None:
        pipeline.push(item, row_grads(item))   # a background task
    await pipeline.drain()
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from services.common.batch import Batch, Batches, iterate
from services.common.codecs import WireStats
from services.common.errors import ConfigError, InvalidArgument, Unavailable
from services.worker.embedding.exchange import (
    EmbeddingPath,
    RowsPath,
    StepTimers,
    lookup_groups,
)
from services.worker.embedding.head_vote import Ballot
from services.worker.embedding.heads import HeadIds, SplitBatch
from services.worker.embedding.hot_chain import HotChain
from services.worker.embedding.replica_seeds import ReplicaSeeds, Seeds
from services.worker.embedding.routes import DirectHot, HotPolicy, RouteSettings
from services.worker.embedding.rows import RowsCapabilities, RowsClient, RowsReplica
from services.worker.embedding.slots import Rider, Slots
from services.worker.embedding.window import WindowTuner
from services.worker.pooling import BatchPlan, PooledBatch, plan_batch

if TYPE_CHECKING:
    import torch

__all__ = ["EmbeddingPipeline", "Prepared", "StepTimers"]  # StepTimers: exchange.py's

PLANNED_AHEAD = 2  # synchronous route: batches planned and not yet stepped (this and the next)

Rows = list[np.ndarray]  # per group of tables, aligned with its layout's ids


@dataclass(slots=True)
class Prepared:
    """A batch whose rows came back, ready for compute: the compute thread works on it alone,
    never on the pipeline. Its rows kept in this process (``direct``: direct hot groups and
    head ids) are read just before its step (:meth:`read_hot`) and updated just after
    (:meth:`apply_hot`); :meth:`pool` gives the model's inputs as its ``path`` pools them."""

    batch: Batch
    plan: BatchPlan
    rows: Rows
    staleness: int
    path: EmbeddingPath
    split: SplitBatch | None = None  # its head ids, read and updated by the compute thread
    direct: DirectHot | None = None

    def read_hot(self) -> None:
        """Fill the direct groups' rows and the head ids' now: they include every earlier
        step's :meth:`apply_hot`."""
        if self.direct is not None:
            self.direct.read(self.plan, self.rows, self.split)

    def pool(self, device: torch.device | str = "cpu") -> PooledBatch:
        """The model's pooled inputs; their leaves' gradients are the row gradients."""
        return self.path.pool(self.plan, self.rows, device=device)

    def apply_hot(self, grads: Rows) -> None:
        """Apply the direct groups' and head ids' gradients now; the pipeline's
        :meth:`~EmbeddingPipeline.push` sends the rest."""
        if self.direct is not None:
            self.direct.apply(self.plan, grads, self.split)


@dataclass(slots=True)
class _Ahead:
    """A batch on its way to compute: its rows and staleness, once looked up (``hot``: the
    hot groups', from the synchronous chain)."""

    batch: Batch
    plan: BatchPlan
    looked_up: asyncio.Task[tuple[Rows, int]]
    hot: asyncio.Future[Rows] | None = None
    split: SplitBatch | None = None


@dataclass(slots=True)
class _Push:
    """One push task's hand-off: the rider it carried and the rows it brought back."""

    rider: Rider | None = None
    rows: Rows | None = field(default=None)


class EmbeddingPipeline:
    """Lookups ahead of compute and pushes behind it, for one worker (see the module doc).

    ``rows`` is the rows client; ``chain_rows``, where given, the hot chain's: a lane of its
    own beside ``rows`` when that carries the bulk traffic (a PS client process), so that the
    requests a step waits for skip that queue. ``tables`` maps each sparse feature to its table
    (default: every feature of the first batch, table named like the feature). ``window``:
    staleness slots (None: unbounded, async mode); ``prefetch``: lookups ahead of compute when
    unbounded. ``timers`` get the seconds of every lookup and push. ``hot_ratio``: tables whose
    first batch has at most this many distinct ids per sample get ``hot_window`` slots of their own
    (None or 0: no hot tables; only with a window above ``hot_window``). ``worker`` of
    ``workers``: this worker's rank and the number of workers, in the step tags;
    ``barrier``: awaited by every acknowledged push before its slot is freed (then no batch
    rides on a push; see the module doc). ``path``: what a lookup and a push send
    (:mod:`services.worker.embedding.exchange`; default unique rows). ``head_rate``: ids seen at
    least this often per batch are head ids (None: none); ``hot_barrier``: awaited by every
    acknowledged push of the hot chain (hot rows synchronous across the workers);
    ``step_gate(has_batch)``: awaited before each batch takes a slot, True while every worker
    has a batch for the step (the bound across workers; see the module doc); ``head_vote``:
    decides the head ids with every worker's counts (:mod:`services.worker.embedding.head_vote`);
    ``replica``: keeps the head rows where the rows are remote and this is the only worker
    (:mod:`services.worker.embedding.routes`); ``tuner``: sizes the window again as the run
    goes (:meth:`retune`, ``staleness auto``)."""

    def __init__(self, rows: RowsClient, *, window: int | None, prefetch: int = 8,
                 chain_rows: RowsClient | None = None,
                 tables: Mapping[str, str] | None = None,
                 timers: StepTimers | None = None, hot_ratio: float | None = None,
                 hot_window: int = 1, worker: int = 0, workers: int = 1,
                 barrier: Callable[[], Awaitable[Any]] | None = None,
                 path: EmbeddingPath | None = None, head_rate: float | None = None,
                 hot_barrier: Callable[[], Awaitable[Any]] | None = None,
                 step_gate: Callable[[bool], Awaitable[bool]] | None = None,
                 head_vote: Callable[[Ballot], Awaitable[dict[int, np.ndarray]]] | None = None,
                 replica: RowsReplica | None = None, tuner: WindowTuner | None = None
                 ) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ConfigError(f"window must be an int >= 1 or None, got {window!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigError(f"prefetch must be an int >= 1, got {prefetch!r}")
        self.rows = rows
        self.chain_rows = chain_rows
        self.path = path if path is not None else RowsPath()
        self.window, self.prefetch = window, prefetch
        self.tables: dict[str, str] | None = dict(tables) if tables is not None else None
        if self.tables is not None and not self.tables:
            raise ConfigError("tables must map at least one feature to a PS table")
        if hot_ratio is not None and not 0 <= hot_ratio <= 1:
            raise ConfigError(f"hot_ratio must be in [0, 1] or None, got {hot_ratio!r}")
        if isinstance(hot_window, bool) or not isinstance(hot_window, int) or hot_window < 1:
            raise ConfigError(f"hot_window must be an int >= 1, got {hot_window!r}")
        if not 0 <= worker < workers:
            raise ConfigError(f"worker must be in [0, workers), got {worker} of {workers}")
        if (barrier is not None or step_gate is not None) and window is None:
            raise ConfigError("a barrier needs a window: pushes are waited for")
        self._timers, self.worker, self.workers = timers, worker, workers
        self._barrier, self._hot_barrier, self._step_gate = barrier, hot_barrier, step_gate
        self._head_vote = head_vote
        self._steps = 0  # batches fed so far, over every run: the step of the next tag
        self._hot_ratio = hot_ratio if window is not None and window > hot_window else None
        self._hot_window = hot_window
        self.hot_tables: list[str] = []  # decided at the first plan
        self._chain: HotChain | None = None
        self._policy: HotPolicy | None = None  # the routes, decided at the first plan
        self._direct: DirectHot | None = None  # groups the compute thread reads and updates
        self.replica = replica  # a copy of the head rows (one worker, remote rows): plan()
        self._seeding: ReplicaSeeds | None = None  # where the replica is used (the first plan)
        # head ids only under a window: async mode has no bound and no head ids
        self._head_rate = head_rate if window is not None and window > 1 else None
        self.heads: HeadIds | None = None  # the windowed groups' head ids, once decided
        self._groups: list[list[str]] | None = None  # tables of one dim, sent together
        self._windowed: list[int] = []  # the groups under the staleness window (not hot)
        self._slots = Slots(window)  # the staleness window (services.worker.embedding.slots)
        self._pushes: set[asyncio.Task[None]] = set()
        self._acknowledge: Callable[[Batch], Awaitable[Any]] | None = None
        self.tuner = tuner  # staleness auto: the window measured again as the job runs

    # ---- tables and plans ---------------------------------------------------------------

    def features(self, batch: Batch) -> dict[str, Any]:
        """The batch's sparse features the tables use (the first batch sets the tables when
        none were given)."""
        if self.tables is None:
            self.tables = {name: name for name in batch.sparse}
        missing = sorted(set(self.tables) - set(batch.sparse))
        if missing:
            raise InvalidArgument(f"batch {batch.batch_id} lacks sparse features {missing}")
        return {name: batch.sparse[name] for name in self.tables}

    def check_tables(self) -> None:
        """The rows client serves the path, and every table the features use exists (as far
        as it knows)."""
        self.path.check(self.rows)
        if self.tables is None:
            return
        dims = self.rows.dims
        unknown = sorted(t for t in self.tables.values() if t not in dims)
        if unknown:
            raise ConfigError(f"PS tables {unknown} do not exist; the PS has {sorted(dims)}")

    async def feature_dims(self) -> dict[str, int]:
        """Each feature's dim (its table's), from the tables the rows client reports now."""
        if self.tables is None:
            raise InvalidArgument("the features are not known before the first batch")
        await self.rows.tables()
        self.check_tables()
        return {f: self.rows.dims[t] for f, t in self.tables.items()}

    async def _ensure_dims(self) -> None:
        assert self.tables is not None  # set by features() before any plan
        if any(t not in self.rows.dims for t in self.tables.values()):
            await self.rows.tables()
            self.check_tables()

    def _table_groups(self, hot: Sequence[str] = ()) -> list[list[str]]:
        """The tables pooled and sent together: those of one dim, hot ones apart."""
        assert self.tables is not None
        by_kind: dict[tuple[bool, int], list[str]] = {}
        for table in dict.fromkeys(self.tables.values()):
            by_kind.setdefault((table in hot, self.rows.dims[table]), []).append(table)
        return list(by_kind.values())

    async def plan(self, batch: Batch) -> BatchPlan:
        """Dedup and lay out the batch's ids (it needs no PS state, so it runs ahead of the
        staleness slot). The first plan decides the hot tables."""
        features = self.features(batch)
        if self._groups is None:
            await self._ensure_dims()
            self._groups = self._table_groups()
            hot: list[int] = []
            if self._hot_ratio:
                first = plan_batch(features, table_of=self.tables, groups=self._groups)
                limit = self._hot_ratio * max(batch.size, 1)
                self.hot_tables = [t for t, ids in first.unique.items() if ids.size <= limit]
                self._groups = self._table_groups(self.hot_tables)
                hot = [i for i, g in enumerate(self._groups) if g[0] in self.hot_tables]
            policy = self._policy = HotPolicy.decide(
                len(self._groups), hot, capabilities=RowsCapabilities.of(self.rows),
                path=self.path, replica=self.replica, step=self._steps,
                settings=RouteSettings(window=self.window, hot_window=self._hot_window,
                                       workers=self.workers, barrier=self._barrier is not None,
                                       head_rate=self._head_rate,
                                       voting=self._head_vote is not None))
            self._windowed, self._direct = policy.windowed, policy.direct
            self._seeding, self.heads = policy.seeding, policy.heads
            if policy.synchronous:
                self._slots.reset(PLANNED_AHEAD)
            if policy.chain:
                self._chain = HotChain(self.chain_client, self.path, policy.chain,
                                       self._hot_window, self._hot_barrier, self._timers)
        return plan_batch(features, table_of=self.tables, num_shards=self.rows.num_shards,
                          groups=self._groups)

    async def lookup(self, plan: BatchPlan, groups: Sequence[int] | None = None) -> Rows:
        """The rows of every group of the plan, or of ``groups`` (indices) only, as the path
        looks them up (:func:`~services.worker.embedding.exchange.lookup_groups`)."""
        return await lookup_groups(self.path, self.rows, plan, groups, self._timers)

    @property
    def chain_client(self) -> RowsClient:
        """The rows client of the hot chain: its lane where it has one, else ``rows``."""
        return self.rows if self.chain_rows is None else self.chain_rows

    def clients(self) -> list[RowsClient]:
        """The rows clients the steps use: ``rows``, and the hot chain's lane if any."""
        lane = self.chain_client
        return [self.rows] if lane is self.rows else [self.rows, lane]

    def wire_bytes(self) -> dict[str, int]:
        """Bytes on the wire per stream, over :meth:`clients`."""
        counts = [client.wire_bytes() for client in self.clients()]
        return {key: sum(c.get(key, 0) for c in counts) for key in counts[0]}

    def codec_stats(self) -> WireStats:
        """Raw and wire bytes per stream and codec, over :meth:`clients`."""
        return WireStats.merged(*(client.codec_stats for client in self.clients()))

    def _copy(self, seeds: Seeds) -> Awaitable[Any]:
        return self._seeding.copy(self.rows, seeds) if self._seeding else asyncio.sleep(0)

    async def retune(self, steps: int, compute_wall_s: float) -> bool:
        """Measure the window again (``staleness auto``: :class:`WindowTuner`) after
        ``steps`` steps of ``compute_wall_s`` compute, and resize it where that changes it;
        whether it was measured now."""
        if self.tuner is None or self._synchronous:
            return False
        measured = len(self.tuner.choice.remeasured)
        if (window := self.tuner.measure(steps, compute_wall_s)) is not None:
            await self._slots.resize(window)
            self.window = window
        return len(self.tuner.choice.remeasured) > measured

    def head_count(self) -> int:
        """Head ids now (0 without head ids)."""
        return self.heads.head_count() if self.heads is not None else 0

    @property
    def _synchronous(self) -> bool:
        """Every group read and updated by the compute thread (one worker, window 1, rows in
        process): slots bound only the batches planned ahead."""
        return self._policy is not None and self._policy.synchronous

    @property
    def policy(self) -> HotPolicy | None:
        """Where each group gets its rows (None before the first plan decides it)."""
        return self._policy

    @property
    def _direct_hot(self) -> list[int]:
        return self._policy.direct_groups if self._policy is not None else []

    # ---- one run: lookups ahead of compute ----------------------------------------------

    def begin(self, *, acknowledge: Callable[[Batch], Awaitable[Any]] | None = None) -> None:
        """Start a run with every slot free. ``acknowledge(batch)`` runs once a batch's push
        is acknowledged, before its slot is freed (a loader's ack)."""
        if self._pushes:
            raise InvalidArgument("a run is still pushing; await settle() first")
        self._slots.reset(PLANNED_AHEAD if self._synchronous else self.window)
        self._acknowledge = acknowledge
        if self._chain is not None:
            self._chain.reset()
        if self._seeding is not None:
            self._seeding.begin(self._steps, self.heads)

    async def feed(self, batches: Batches, put: Callable[[Prepared | None], Awaitable[Any]],
                   fail: Callable[[BaseException], Any], *, steps: int | None = None,
                   planned: tuple[Batch, BatchPlan] | None = None) -> None:
        """Plan ``batches`` (at most ``steps`` of them, after ``planned``: a first batch its
        caller already planned) and start their lookups ahead of compute, each after taking
        a slot, so that as many lookups are in flight as there are slots (``prefetch`` when
        unbounded). Once every slot is taken, batches queue as riders (as many as there are
        slots), so that each push finds one waiting. Each batch goes to ``put`` in order once
        its rows arrived; ``put(None)`` ends the run. An error (of a plan, a lookup or
        ``put``) goes to ``fail`` instead."""
        ahead: asyncio.Queue[_Ahead | None] = asyncio.Queue(
            maxsize=(self.tuner.most if self.tuner is not None else self.window)
            or self.prefetch)
        feeder = asyncio.create_task(self._hand_over(ahead, put, fail))
        try:
            source = batches if isinstance(batches, AsyncIterator) else iterate(batches)
            taken = 0
            while steps is None or taken < steps:
                if planned is None:
                    if (got := await anext(source, None)) is None:
                        # this worker ran out (before ``steps``): the others stop here too
                        if self._step_gate is not None:
                            await self._step_gate(False)
                        break
                    planned = got, await self.plan(got)
                (batch, plan), planned = planned, None
                plan = self._tagged(plan)
                if self._step_gate is not None and not await self._step_gate(True):
                    break  # another worker has no batch for this step
                await ahead.put(await self._start(batch, plan,
                                                  hold=self._step_gate is not None))
                taken += 1
            await ahead.put(None)
            await feeder
        except BaseException as exc:  # handed to the consumer, which raises it
            feeder.cancel()
            while not ahead.empty():
                if (item := ahead.get_nowait()) is not None:
                    item.looked_up.cancel()
                    if item.looked_up.done() and not item.looked_up.cancelled():
                        item.looked_up.exception()  # retrieved: the feeder never awaits it
            await asyncio.gather(feeder, return_exceptions=True)
            fail(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _start(self, batch: Batch, plan: BatchPlan, *, hold: bool) -> _Ahead:
        """Start the lookups of a tagged plan: its hot groups' on the chain, the rest's once
        it has a slot (riding on the push that frees one, or its own; on the synchronous
        route every group is the compute thread's, and the slot bounds planning). ``hold``:
        return only once the batch holds its slot (a rider too: the step gate's bound)."""
        split = self.heads.split(plan) if self.heads is not None else None
        if self._head_vote is not None and self.heads is not None \
                and (ballot := self.heads.take_ballot()) is not None:
            self.heads.elect(await self._head_vote(ballot))  # from the next batch on
        wire = split.remote if split is not None else plan  # what the window reads
        seeds = (Seeds() if self._seeding is None else
                 self._seeding.layouts(plan, split, self._direct_hot, self.heads))
        hot = (self._chain.request(split.head if split is not None else plan)
               if self._chain is not None else None)
        slots = self._slots  # (the first plan may choose the synchronous route's)
        if slots.full and not self._synchronous:  # ride on the push that frees one
            rider = slots.wait_as_rider(wire)
            looked_up = asyncio.create_task(self._ride(rider, seeds))
            if hold:
                await asyncio.wait([rider.future])  # its error is raised by _ride
        else:
            looked_up = asyncio.create_task(self._look_up(wire, await slots.take(), seeds))
        return _Ahead(batch, plan, looked_up, hot, split)

    def _tagged(self, plan: BatchPlan) -> BatchPlan:
        """``plan`` with every layout tagged (worker, step, workers) for the PS's staleness."""
        tag = (self.worker, self._steps, self.workers)
        self._steps += 1
        plan.groups[:] = [replace(g, layout=replace(g.layout, tag=tag)) for g in plan.groups]
        return plan

    async def _look_up(self, plan: BatchPlan, staleness: int, seeds: Seeds) -> tuple[Rows, int]:
        """The windowed groups' rows (the replica copies ``seeds`` meanwhile)."""
        started = time.perf_counter()
        done = await asyncio.gather(self.lookup(plan, self._windowed), self._copy(seeds))
        if self.tuner is not None:
            self.tuner.lookup_took(time.perf_counter() - started)
        return cast(Rows, done[0]), staleness

    async def _ride(self, rider: Rider, seeds: Seeds) -> tuple[Rows, int]:
        """A rider's rows: from the push it rode on, or its own lookup when it was handed the
        slot only (it came after that push had left); the replica copies ``seeds`` once the
        rider has its slot."""
        rows, staleness = await rider.future
        looking = [self.lookup(rider.plan, self._windowed)] if rows is None else []
        done = await asyncio.gather(*looking, self._copy(seeds))
        return cast(Rows, done[0]) if rows is None else rows, staleness

    async def _hand_over(self, ahead: asyncio.Queue[_Ahead | None],
                         put: Callable[[Prepared | None], Awaitable[Any]],
                         fail: Callable[[BaseException], Any]) -> None:
        """Hand the batches to compute in their order, each once its rows have arrived."""
        try:
            while (item := await ahead.get()) is not None:
                rows, staleness = await item.looked_up
                hot = await item.hot if item.hot is not None else None
                if not self._windowed:
                    staleness = 0  # every table is hot: each lookup saw every earlier push
                assert self._policy is not None  # decided at the first plan
                rows = self._policy.merge(item.plan, rows, hot, item.split, self.rows.dims)
                await put(Prepared(item.batch, item.plan, rows, staleness, self.path, item.split,
                                   self._direct))
            await put(None)
        except Exception as exc:  # a failed lookup: the consumer raises it
            fail(exc)

    # ---- pushes behind compute ----------------------------------------------------------

    def push(self, item: Prepared, grads: Rows) -> None:
        """Push ``item``'s row gradients (one array per group) in a background task; raise
        the error of an earlier push that failed."""
        state = _Push()
        task = asyncio.create_task(self._push(item, grads, state))
        task.add_done_callback(functools.partial(self._release, state))
        self._pushes.add(task)
        for done in [t for t in self._pushes if t.done()]:  # acknowledged: forget them
            self._pushes.discard(done)
            if not done.cancelled() and (exc := done.exception()) is not None:
                raise exc

    async def drain(self) -> None:
        """Wait until every push is acknowledged; raise the first error."""
        await asyncio.gather(*list(self._pushes))
        self._pushes.clear()
        if self._seeding is not None:
            await self._seeding.flush(self.rows)

    async def settle(self) -> None:
        """End a run, failed or not: wait for every push to finish, forget waiting riders."""
        pushes, self._pushes = list(self._pushes), set()
        await asyncio.gather(*pushes, return_exceptions=True)
        self._slots.forget_riders()
        if self._chain is not None:
            self._chain.reset()

    async def _push(self, item: Prepared, grads: Rows, state: _Push) -> None:
        """Push a batch's row gradients, then acknowledge the batch. A batch waiting for a
        slot (a rider) rides on the push: its lookup travels in the same message per shard,
        after the gradients."""
        rider = state.rider = self._slots.carry() if self._barrier is None else None
        hot_push = self._hot_push(item, grads)
        plan, sent = ((item.plan, grads) if item.split is None else  # heads: applied, and
                      (item.split.pushed, item.split.pushed_grads(grads)))  # some held back
        try:
            started = time.perf_counter()
            if rider is None:
                await asyncio.gather(*(self.path.push(self.rows, plan, i, sent[i])
                                       for i in self._windowed))
            else:
                state.rows = await self._push_then_lookup(plan, sent, rider.plan)
                if self._timers is not None:
                    self._timers.lookup_seconds.observe(time.perf_counter() - started)
                if self.tuner is not None:
                    self.tuner.lookup_took(time.perf_counter() - started)
            if hot_push is not None:
                await hot_push
            if self._timers is not None:
                self._timers.push_seconds.observe(time.perf_counter() - started)
            if self._acknowledge is not None:
                await self._acknowledge(item.batch)
            if self._barrier is not None:
                await self._barrier()
        except BaseException as exc:
            if rider is not None and not rider.future.done():
                rider.future.set_exception(exc if isinstance(exc, Exception)
                                           else Unavailable("the push it rode on was cancelled"))
            if hot_push is not None and not hot_push.done():
                hot_push.cancel()
            raise
        finally:  # failed too: no copy of the replica may wait for it (the run fails anyway)
            if self._seeding is not None:
                self._seeding.acknowledged(item.plan)

    def _hot_push(self, item: Prepared, grads: Rows) -> asyncio.Future[Any] | None:
        """The push of ``item``'s hot rows: the chain's, or the replica's updates sent on."""
        if self._seeding is not None:  # (the held back gradients kept first)
            self._seeding.hold(item.plan, item.split, grads)
            return self._seeding.send(self.path, self.rows, item.plan, item.split, grads,
                                      self._direct_hot)
        if self._chain is None:
            return None
        split = item.split
        return asyncio.ensure_future(self._chain.push(item.plan, grads) if split is None else
                                     self._chain.push(split.head, split.head_grads(grads)))

    def _release(self, state: _Push, task: asyncio.Task[None]) -> None:
        """The push task's done-callback: its slot passes to the rider it carried (with the
        rows it brought back), else on to the next batch (:class:`Slots`)."""
        if not task.cancelled():
            task.exception()  # retrieved here; push() and drain() raise it
        self._slots.acknowledged(state.rider, state.rows)

    async def _push_then_lookup(self, plan: BatchPlan, grads: Rows, then: BatchPlan) -> Rows:
        """Push ``plan``'s gradients and look ``then`` up (rows: in one message per shard and
        group; every batch has the same features, so both plans have the same groups)."""
        return list(await asyncio.gather(*(self.path.push_then_lookup(
            self.rows, plan, i, grads[i], then) for i in self._windowed)))
