"""The worker's replica of its head rows and hot tables (:mod:`services.ps.replica`) where the
rows are remote: it trains exactly as the synchronous hot chain it replaces, with no round trip
a step, and the PS's copy follows it."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from services.common.errors import InvalidArgument, Unavailable
from services.common.sharding import ShardedIds
from services.loader.planted import SyntheticConfig, SyntheticDataset
from services.ps.config import PSConfig
from services.ps.inprocess import InProcessShards
from services.ps.replica import HeadReplica
from services.ps.shard import Shard
from services.ps.tables import OptimizerConfig, TableConfig
from services.worker.config import ps_table_configs
from services.worker.embedding.replica_seeds import ReplicaSeeds, Seeds
from services.worker.models import ModelConfig
from services.worker.pooling import BatchPlan, GroupPlan
from services.worker.trainer import Trainer

DATA = SyntheticConfig(seed=3)


class Remote:
    """In-process shards seen as remote rows (no ``lookup_now``/``push_now``: the pipeline
    cannot read them from its compute thread); counts the rows copied by state lookups."""

    def __init__(self, shards: InProcessShards) -> None:
        self.inner = shards
        self.state_lookups = 0
        self.copied = 0

    def __getattr__(self, name: str) -> Any:
        if name in ("direct", "lookup_now", "push_now"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    async def lookup_state_sharded(self, layout: ShardedIds) -> Any:
        self.state_lookups += 1
        self.copied += layout.ids.size
        return await self.inner.lookup_state_sharded(layout)


def shards() -> InProcessShards:
    return InProcessShards(ps_table_configs({f: 8 for f in DATA.sparse_names}), num_shards=2)


async def fit(rows: Remote, replica: HeadReplica | None, steps: int, **settings: Any
              ) -> tuple[Any, Trainer]:
    batches = list(SyntheticDataset(DATA).batches(128, 128 * steps))
    async with Trainer(model=ModelConfig(name="dlrm"), rows_client=rows, lr=3e-3, seed=7,
                       mode="hybrid", staleness=8, head_replica=replica, **settings) as t:
        return await t.fit(batches), t


async def test_the_replica_trains_exactly_as_the_synchronous_chain_with_no_round_trip() -> None:
    """Every table hot (no window): the chain reads each step's rows back from the PS after
    the last step's push; the replica holds them here. Same losses bit for bit, same PS rows
    at the end (the replica's updates went on to the PS), the replica's rows equal to the PS's,
    and each row copied once (not once a step)."""
    chained, replicated = Remote(shards()), Remote(shards())
    replica = HeadReplica()
    a, _ = await fit(chained, None, 12, hot_ratio=1.0, head_rate=0.0)
    b, t = await fit(replicated, replica, 12, hot_ratio=1.0, head_rate=0.0)
    assert (policy := t.pipeline.policy) is not None
    assert policy.seeding is not None and not policy.chain
    assert a.recent_losses == b.recent_losses and a.steps == b.steps == 12
    digests = [[tab.content_digest() for s in r.inner.shards for tab in s.tables.values()]
               for r in (chained, replicated)]
    assert digests[0] == digests[1]
    held = replica.num_rows
    assert held > 0 and replicated.copied == held  # each row copied once
    assert chained.state_lookups == 0
    ids = {name: tab.ids() for name, tab in replicated.inner.shards[0].tables.items()}
    ids = {name: np.unique(np.concatenate([s.tables[name].ids() for s in
                                           replicated.inner.shards])) for name in ids}
    layout, _ = ShardedIds.of_tables(ids, 2)
    np.testing.assert_array_equal(replica.lookup_now(layout), replicated.inner.lookup_now(layout))


@pytest.mark.parametrize("steps", [20, 40])
async def test_head_ids_use_the_replica_and_the_ps_follows_it(steps: int) -> None:
    """Zipf tables with head ids under a window: the head rows are copied once each, read
    and updated here, and their gradients reach the PS: its copy of every head row is the
    replica's, bit for bit. The last decision (after batch 16) switches its ids at batch 24:
    after the run's end (20 steps: the gradients held back for them are flushed then) or
    within it (40). (A row copied before the pushes of the earlier batches that updated it as
    a windowed row are acknowledged misses them; held gradients not sent on are missed too.
    The same over real gRPC, where the order of the updates is at stake:
    tests/integration/worker/test_replica_grpc.py.)"""
    rows, replica = Remote(shards()), HeadReplica()
    summary, t = await fit(rows, replica, steps)
    assert t.pipeline.policy is not None and t.pipeline.policy.seeding is not None
    assert t.pipeline.head_count() > 0
    assert rows.copied == replica.num_rows == summary.replicated_rows > 0
    assert_ps_follows(replica, rows.inner.shards)
    assert np.isfinite(summary.loss)


def assert_ps_follows(replica: HeadReplica, shards: list[Shard]) -> None:
    """Every row the replica holds (updated here: not its initial row) is the same, bit for
    bit, on the shard that owns it."""
    same = total = 0
    for name, ids in replica.held().items():
        layout, _ = ShardedIds.of_tables({name: ids}, 1)
        mine = replica.lookup_now(layout)
        held = [s.tables[name].peek(ids) for s in shards]
        theirs = held[0][0].copy()
        for rows, present in held[1:]:
            theirs[present] = rows[present]  # each id's row on the shard owning it
        assert ids.size == 0 or not np.array_equal(mine, shards[0].tables[name].initial_rows(ids))
        same += int((mine == theirs).all(axis=1).sum())
        total += ids.size
    assert same == total > 0, (same, total)


async def test_not_used_where_the_rows_live_in_this_process() -> None:
    """Embedded shards are read and updated in place: no replica needed, none used."""
    direct = shards()
    summary, t = await fit(direct, HeadReplica(), 4)  # type: ignore[arg-type]
    assert t.pipeline.policy is not None and t.pipeline.policy.seeding is None
    assert summary.replicated_rows == 0


def test_a_state_lookup_of_tables_with_different_state_layouts_is_refused() -> None:
    shard = Shard(PSConfig(tables=[
        TableConfig(name="a", dim=4, optimizer=OptimizerConfig(kind="adagrad")),
        TableConfig(name="b", dim=4, optimizer=OptimizerConfig(kind="sgd"))]))
    state: dict[str, np.ndarray] = {}
    with pytest.raises(InvalidArgument, match="different layouts"):
        shard.lookup_many_sync(["a", "b"], [2, 2], np.arange(4, dtype=np.uint64), state=state)
    assert shard.table("a").num_rows == shard.table("b").num_rows == 0 and not state


class FailingRemote(Remote):
    """Remote rows whose pushes of one step fail."""

    def __init__(self, shards: InProcessShards, step: int) -> None:
        super().__init__(shards)
        self.step = step

    async def push_sharded(self, layout: ShardedIds, grads: np.ndarray) -> Any:
        if layout.tag is not None and layout.tag[1] == self.step:
            raise Unavailable(f"the push of step {self.step} failed")
        return await self.inner.push_sharded(layout, grads)


async def test_a_failed_push_fails_the_run_and_no_copy_waits_for_it() -> None:
    """Step 6's push fails: the run ends with its error, and the step counts as acknowledged
    for the replica's copies (a copy waiting for it would wait for ever, and with it the
    step whose rows it brings, while the compute thread waits for that step)."""
    batches = list(SyntheticDataset(DATA).batches(128, 128 * 24))
    async with Trainer(model=ModelConfig(name="dlrm"), rows_client=FailingRemote(shards(), 6),
                       lr=3e-3, seed=7, mode="hybrid", staleness=8,
                       head_replica=HeadReplica()) as t:
        with pytest.raises(Unavailable, match="step 6"):
            await asyncio.wait_for(t.fit(batches), 60)
        assert t.pipeline.policy is not None and (seeding := t.pipeline.policy.seeding)
        assert seeding.acknowledged_below > 6


async def test_the_replica_updates_rows_as_the_ps_does_across_optimizers_and_dtypes() -> None:
    """Tables of three optimizer configs and two storage dtypes in one layout (three arenas
    of the replica): after the same pushes, NaN rows among them, the replica's rows and
    push results equal the PS's bit for bit (an arena shared by tables of different
    optimizers, or float16 rows updated without widening, fails)."""
    configs = [TableConfig(name="a", dim=4, optimizer=OptimizerConfig(kind="adagrad", lr=0.1)),
               TableConfig(name="b", dim=4, dtype="float16",
                           optimizer=OptimizerConfig(kind="adagrad", lr=0.1)),
               TableConfig(name="c", dim=4, optimizer=OptimizerConfig(kind="adam", lr=0.01))]
    ps, replica = InProcessShards(configs, num_shards=2), HeadReplica()
    ids = {name: np.arange(5, 25, dtype=np.uint64) * np.uint64(7919) for name in "abc"}
    layout, _ = ShardedIds.of_tables(ids, 2)
    for name in "abc":  # a state lookup serves tables of one state layout
        assert await replica.seed(ps, ShardedIds.of_tables({name: ids[name]}, 2)[0]) == 20
    rng = np.random.default_rng(5)
    for step in range(4):
        grads = rng.normal(size=(layout.ids.size, 4)).astype(np.float32)
        grads[step] = np.nan
        assert replica.push_now(layout, grads) == ps.push_now(layout, grads)
    np.testing.assert_array_equal(replica.lookup_now(layout), ps.lookup_now(layout))
    assert replica.num_arenas == 3 and replica.num_rows == layout.ids.size
    assert await replica.seed(ps, layout) == 0  # held: nothing copied again


async def test_a_second_run_copies_its_head_rows_again() -> None:
    """A new run of the same trainer clears the replica (the PS's rows may have changed in
    between): its head ids are decided and copied anew, and the PS still follows it (head
    ids kept from the first run would be read from an empty replica)."""
    rows, replica = Remote(shards()), HeadReplica()
    batches = list(SyntheticDataset(DATA).batches(128, 128 * 24))
    async with Trainer(model=ModelConfig(name="dlrm"), rows_client=rows, lr=3e-3, seed=7,
                       mode="hybrid", staleness=8, head_replica=replica) as t:
        await t.fit(batches[:12])
        copied = rows.copied
        summary = await t.fit(batches[12:])
    assert rows.copied > copied and summary.replicated_rows == replica.num_rows > 0
    assert_ps_follows(replica, rows.inner.shards)


async def test_a_push_after_the_replica_was_cleared_updates_the_rows_where_they_are_now(
        ) -> None:
    """A step's push_now finds its rows where its lookup_now found them; once the replica is
    cleared and copied anew (another order: other slots), a push of the same layout updates
    the new copy's rows of its ids (a push to the slots found before the clear fails)."""
    configs = [TableConfig(name="a", dim=4, optimizer=OptimizerConfig(kind="adagrad", lr=0.1))]
    ps, replica = InProcessShards(configs), HeadReplica()
    every, _ = ShardedIds.of_tables({"a": np.arange(10, 20, dtype=np.uint64)}, 1)
    tail, _ = ShardedIds.of_tables({"a": np.arange(15, 20, dtype=np.uint64)}, 1)
    head, _ = ShardedIds.of_tables({"a": np.arange(10, 15, dtype=np.uint64)}, 1)
    await replica.seed(ps, every)
    replica.lookup_now(tail)
    replica.clear()
    await replica.seed(ps, tail)  # now first in the arena
    await replica.seed(ps, head)
    grads = np.random.default_rng(4).normal(size=(5, 4)).astype(np.float32)
    assert replica.push_now(tail, grads) == ps.push_now(tail, grads)
    np.testing.assert_array_equal(replica.lookup_now(every), ps.lookup_now(every))


async def test_updates_in_another_thread_survive_copies_that_grow_the_arena() -> None:
    """The compute thread updates held rows while the event loop copies new ones in (the
    arena and index grow by reallocation): no update is lost (the rows equal the PS's after
    the same pushes; unguarded, an update written to the old arena during a growth is)."""
    configs = [TableConfig(name="a", dim=8, optimizer=OptimizerConfig(kind="adagrad", lr=0.1))]
    ps, replica = InProcessShards(configs), HeadReplica()
    first, _ = ShardedIds.of_tables({"a": np.arange(64, dtype=np.uint64)}, 1)
    await replica.seed(ps, first)
    grads = np.random.default_rng(2).normal(size=(64, 8)).astype(np.float32)
    pushed, stop = [0], asyncio.Event()

    def update() -> None:
        while not stop.is_set() or pushed[0] < 50:
            replica.push_now(first, grads)
            pushed[0] += 1

    worker = asyncio.get_running_loop().run_in_executor(None, update)
    for k in range(1, 40):  # each copy grows the arena past its size
        more, _ = ShardedIds.of_tables({"a": np.arange(64 * k, 64 * (k + 1) + 64 * k,
                                                       dtype=np.uint64)}, 1)
        await replica.seed(ps, more)
        await asyncio.sleep(0)
    stop.set()
    await worker
    for _ in range(pushed[0]):
        ps.push_now(first, grads)
    np.testing.assert_array_equal(replica.lookup_now(first), ps.lookup_now(first))


def _plan_of(layout: ShardedIds) -> BatchPlan:
    """A plan of one group looking up ``layout`` and pooling nothing."""
    none = np.empty(0, dtype=np.int64)
    return BatchPlan(batch_size=0, groups=[GroupPlan(layout, (), none, none)], features={})


async def test_a_head_row_not_held_is_copied_once_the_earlier_pushes_are_acknowledged() -> None:
    """A batch's head id whose row the replica lacks (two tables' ids can share a head key:
    the id was never decided itself) is copied, but only after the pushes of the steps
    before (it was a windowed row); a held one costs no lookup."""
    rows, replica = Remote(shards()), HeadReplica()
    seeds = ReplicaSeeds(replica, 0)
    layout, _ = ShardedIds.of_tables({DATA.sparse_names[0]: np.arange(9, dtype=np.uint64)}, 2)
    layout = replace(layout, tag=(0, 3, 1))  # worker 0's step 3 of 1 worker
    copying = asyncio.create_task(seeds.copy(rows, Seeds(mine=[layout])))
    for step in range(3):
        await asyncio.sleep(0.01)
        assert not copying.done() and rows.state_lookups == 0  # steps 0-2 not all acknowledged
        seeds.acknowledged(_plan_of(replace(layout, tag=(0, step, 1))))
    await asyncio.wait_for(copying, 5)
    assert replica.holds(layout) and rows.state_lookups == 1
    await seeds.copy(rows, Seeds(mine=[layout]))
    assert rows.state_lookups == 1
