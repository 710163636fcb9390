"""The embedding pipeline's staleness bound, riders and pushes, through the PS's own shards in
this process (no sockets).

The table is SGD with lr = 1 and zero initial rows, every batch is one sample with the same
id, and batch ``b`` pushes the gradient ``-e_b``: a looked-up row is then exactly the
indicator of the pushes applied before its lookup. A :class:`PushGate` holds every push until
the test releases it (the oldest first, only once the pipeline cannot go on without it), so
each lookup runs as stale as the pipeline allows.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import pytest

from services.common.batch import Batch, Jagged
from services.common.errors import ConfigError, InvalidArgument
from services.common.sharding import ShardedIds
from services.ps.inprocess import InProcessShards, PushGate
from services.worker.embedding.pipeline import EmbeddingPipeline, Prepared

N = 16  # batches per run; also the table's dim (one coordinate per batch's push)
ROW_ID = 7


def table(dim: int = N, name: str = "t") -> dict[str, object]:
    return {"name": name, "dim": dim, "initializer": "zeros",
            "optimizer": {"kind": "sgd", "lr": 1.0}}


def batch(b: int, ids: tuple[int, ...] = (ROW_ID,)) -> Batch:
    return Batch(batch_id=b, labels=np.zeros(1, np.float32), dense=np.zeros((1, 1), np.float32),
                 sparse={"f": Jagged(np.array(ids, np.uint64), np.array([len(ids)], np.int32))})


class RecordingShards(InProcessShards):
    """The in-process shards, remembering which push each push-then-lookup carried and the
    rows it brought back."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.rides: list[tuple[int, np.ndarray]] = []  # (pushed batch, rows returned)
        self.lookups = 0

    async def lookup_sharded(self, layout):  # type: ignore[no-untyped-def]
        self.lookups += 1
        return await super().lookup_sharded(layout)

    async def push_then_lookup(self, layout, grads, then):  # type: ignore[no-untyped-def]
        ack, rows = await super().push_then_lookup(layout, grads, then)
        self.rides.append((int(np.argmin(grads[0])), rows))
        return ack, rows


@dataclass
class Seen:
    """What the lookup of batch ``b`` saw."""

    b: int
    applied: set[int]      # the batches whose push its rows include
    staleness: int         # as the pipeline reported it
    rows: np.ndarray

    @property
    def missed(self) -> int:
        """Earlier batches whose push its rows lack."""
        return self.b - len(self.applied & set(range(self.b)))


IDLE_ROUNDS = 100  # event-loop rounds after which nothing more can happen without a release


async def next_item(prepared: asyncio.Queue[Prepared | None], gate: PushGate | None
                    ) -> Prepared | None:
    """The next prepared batch; while none can come, release the oldest held push.

    The in-process shards serve every lookup and push inline on the event loop, so once the
    loop has gone ``IDLE_ROUNDS`` rounds without a batch arriving, the next one waits for a
    push to be acknowledged: only then is one released, so every lookup is as stale as the
    pipeline allows."""
    while gate is not None and prepared.empty():
        for _ in range(IDLE_ROUNDS):
            await asyncio.sleep(0)
            if not prepared.empty():
                break
        else:
            if not gate.held:
                break
            gate.release(1)
    return await prepared.get()


async def run(shards: InProcessShards, window: int | None, *, gate: PushGate | None = None,
              batches: int = N, lazy: bool = False) -> list[Seen]:
    """Train ``batches`` batches through a pipeline of ``window`` slots, pushes held by
    ``gate`` until the pipeline cannot go on without one (:func:`next_item`). ``lazy``: the
    source yields the next batch only once a push has left, so that no batch rides on it."""
    pipeline = EmbeddingPipeline(shards, window=window, tables={"f": "t"})
    source: asyncio.Queue[Batch | None] = asyncio.Queue()
    queued = min(window or 4, batches) if lazy else batches
    for b in range(queued):
        source.put_nowait(batch(b))
    if queued == batches:
        source.put_nowait(None)

    async def stream() -> AsyncIterator[Batch]:
        while (b := await source.get()) is not None:
            yield b

    pipeline.begin()
    prepared: asyncio.Queue[Prepared | None] = asyncio.Queue()
    errors: list[BaseException] = []

    def fail(exc: BaseException) -> None:
        errors.append(exc)
        prepared.put_nowait(None)

    feeding = asyncio.create_task(pipeline.feed(stream(), prepared.put, fail))
    seen = []
    try:
        async with asyncio.timeout(30):  # a pipeline that deadlocks fails, never hangs
            while (item := await next_item(prepared, gate)) is not None:
                b = item.batch.batch_id
                rows = item.rows[0]
                assert rows.shape == (1, N)
                applied = set(np.flatnonzero(np.round(rows[0]) == 1).tolist())
                assert np.array_equal(np.round(rows[0]), rows[0])  # only whole pushes
                seen.append(Seen(b, applied, item.staleness, rows))
                grad = np.zeros((1, N), np.float32)
                grad[0, b] = -1.0  # SGD, lr 1: the row gains e_b
                pipeline.push(item, [grad])
                if lazy:
                    await asyncio.sleep(0)  # the push task starts: it finds no batch waiting
                if queued < batches:
                    source.put_nowait(batch(queued))
                    queued += 1
                    if queued == batches:
                        source.put_nowait(None)
            if gate is not None:
                await gate.until(lambda held, came: came == batches)
                gate.release(gate.held)
            await pipeline.drain()
    finally:
        feeding.cancel()
        if gate is not None:
            gate.release(gate.held)
        await pipeline.settle()
    assert not errors, errors
    assert [s.b for s in seen] == list(range(batches))
    return seen


@pytest.mark.parametrize("lazy", [False, True], ids=["riders", "slots"])
@pytest.mark.parametrize("window", [2, 3, 5])
async def test_a_lookup_misses_at_most_window_minus_one_earlier_pushes(window: int,
                                                                       lazy: bool) -> None:
    """The bound is exact: with every push held as long as the pipeline allows, some lookup
    misses ``window - 1`` earlier pushes and none misses more (a window one slot wider, or a
    slot freed when its push is sent rather than acknowledged, misses more), whether the
    waiting batches ride on the pushes or wait for a slot alone."""
    gate = PushGate()
    shards = RecordingShards([table()], gate=gate)
    seen = await run(shards, window, gate=gate, lazy=lazy)
    if not lazy:
        assert len(shards.rides) >= N - window - 1
    for s in seen:
        assert s.applied <= set(range(s.b)), (s.b, s.applied)  # never a later push
        assert s.missed <= s.staleness <= window - 1, (s.b, s.missed, s.staleness)
    assert max(s.missed for s in seen) == window - 1
    assert max(s.staleness for s in seen) == window - 1
    rows = await shards.lookup_sharded(
        (await EmbeddingPipeline(shards, window=1, tables={"f": "t"}).plan(batch(0))).groups[0].layout)
    assert np.array_equal(rows[0], np.ones(N, np.float32))  # every push applied once


async def test_sync_mode_sees_every_earlier_push() -> None:
    gate = PushGate()
    seen = await run(RecordingShards([table()], gate=gate), 1, gate=gate)
    assert all(s.applied == set(range(s.b)) and s.staleness == 0 for s in seen)


async def test_riders_get_their_rows_from_the_push_they_rode_on() -> None:
    """A batch that waited for a slot is looked up in the push that freed it: the rows it
    computes on are those that push brought back, and they include that push."""
    for window in (1, 3):
        gate = PushGate()
        shards = RecordingShards([table()], gate=gate)
        seen = await run(shards, window, gate=gate)
        rode = {}
        for s in seen:
            carriers = [p for p, rows in shards.rides if rows is s.rows]
            if carriers:
                rode[s.b] = carriers[0]
        assert shards.lookups + len(shards.rides) == N  # one message per batch
        assert len(rode) == len(shards.rides) >= N - window - 1
        for b, carrier in rode.items():
            assert carrier == b - window, (b, carrier)  # the oldest push in flight freed it
            assert carrier in next(s.applied for s in seen if s.b == b)


async def test_without_a_gate_pushes_apply_at_once_and_async_mode_is_unbounded() -> None:
    seen = await run(RecordingShards([table()]), None)
    assert all(s.applied <= set(range(s.b)) for s in seen)
    seen = await run(RecordingShards([table()]), 4)
    assert max(s.staleness for s in seen) <= 3


async def test_a_failed_push_raises_its_error_and_fails_the_batch_riding_on_it() -> None:
    shards = InProcessShards([table()])  # one of two workers: riders (no read-ahead)
    pipeline = EmbeddingPipeline(shards, window=1, tables={"f": "t"}, workers=2)
    pipeline.begin()
    prepared: asyncio.Queue[Prepared | BaseException | None] = asyncio.Queue()
    feeding = asyncio.create_task(pipeline.feed([batch(0), batch(1)], prepared.put,
                                                prepared.put_nowait))
    try:
        async with asyncio.timeout(10):  # raised, never a hang
            item = await prepared.get()
            assert isinstance(item, Prepared) and item.batch.batch_id == 0
            pipeline.push(item, [np.zeros((1, N + 1), np.float32)])  # the wrong dim
            with pytest.raises(InvalidArgument, match="grads must be"):
                await pipeline.drain()
            rider = await prepared.get()  # batch 1 waited for the slot, on that push
            assert isinstance(rider, InvalidArgument)
    finally:
        feeding.cancel()
        await pipeline.settle()
    rows = await shards.lookup_sharded(
        (await pipeline.plan(batch(0))).groups[0].layout)
    assert not rows.any()  # the bad push changed nothing


async def test_a_batch_planned_by_the_caller_goes_first_planned_once_and_counts_a_step() -> None:
    """``feed(planned=...)``: the caller's planned batch is handed over first with the first
    step's tag, the source's batches after it with the next ones, each planned once (the
    planned batch not again), and ``steps`` counts it."""
    shards = InProcessShards([table()])
    pipeline = EmbeddingPipeline(shards, window=2, tables={"f": "t"})
    first = batch(10)
    planned = first, await pipeline.plan(first)  # the first plan decides the routes
    planning: list[int] = []
    plan = pipeline.plan

    async def counted(b: Batch):  # type: ignore[no-untyped-def]
        planning.append(b.batch_id)
        return await plan(b)

    pipeline.plan = counted  # type: ignore[method-assign]
    pipeline.begin()
    prepared: asyncio.Queue[Prepared | None] = asyncio.Queue()
    errors: list[BaseException] = []
    feeding = asyncio.create_task(pipeline.feed(
        [batch(11), batch(12), batch(13)], prepared.put, errors.append, steps=3,
        planned=planned))
    got = []
    async with asyncio.timeout(10):
        while (item := await prepared.get()) is not None:
            got.append((item.batch.batch_id, item.plan.groups[0].layout.tag))
            pipeline.push(item, [np.zeros((1, N), np.float32)])
        await feeding
        await pipeline.drain()
    assert errors == []
    assert got == [(10, (0, 0, 1)), (11, (0, 1, 1)), (12, (0, 2, 1))]
    assert planning == [11, 12]


def test_bad_windows_are_clear_errors() -> None:
    shards = InProcessShards([table()])
    for window in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match="window"):
            EmbeddingPipeline(shards, window=window)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="prefetch"):
        EmbeddingPipeline(shards, window=None, prefetch=0)
    with pytest.raises(ConfigError, match="tables"):
        EmbeddingPipeline(shards, window=1, tables={})


async def test_unknown_tables_and_missing_features_are_clear_errors() -> None:
    pipeline = EmbeddingPipeline(InProcessShards([table()]), window=1, tables={"f": "nope"})
    with pytest.raises(ConfigError, match="do not exist"):
        pipeline.check_tables()
    pipeline = EmbeddingPipeline(InProcessShards([table()]), window=1, tables={"g": "t"})
    with pytest.raises(InvalidArgument, match="lacks sparse features"):
        await pipeline.plan(batch(0))


def two_feature_batch(b: int) -> Batch:
    """Four samples: feature ``f`` holds ROW_ID and three ids no other batch has (4 distinct
    ids: a cold table), feature ``g`` holds ROW_ID four times (1 distinct id: a hot table)."""
    fresh = [1000 + 3 * b + k for k in range(3)]
    return Batch(batch_id=b, labels=np.zeros(4, np.float32), dense=np.zeros((4, 1), np.float32),
                 sparse={"f": Jagged(np.array([ROW_ID, *fresh], np.uint64), np.ones(4, np.int32)),
                         "g": Jagged(np.full(4, ROW_ID, np.uint64), np.ones(4, np.int32))})


async def missed_per_table(pipeline: EmbeddingPipeline, gate: PushGate, *, pushes: int,
                           direct: bool = False) -> dict[str, list[int]]:
    """Train N two-feature batches (:func:`two_feature_batch`), each step's gradient adding
    e_b to ROW_ID's row in both tables (SGD, lr 1), holding pushes at ``gate`` as long as the
    pipeline allows; per table, how many earlier pushes each batch's rows missed. ``direct``:
    read and apply the direct hot groups as the Trainer's compute thread does. Ends once the
    gate has seen ``pushes`` pushes."""
    pipeline.begin()
    prepared: asyncio.Queue[Prepared | None] = asyncio.Queue()
    errors: list[BaseException] = []
    feeding = asyncio.create_task(pipeline.feed([two_feature_batch(b) for b in range(N)],
                                                prepared.put, errors.append))
    missed: dict[str, list[int]] = {"t": [], "u": []}
    try:
        async with asyncio.timeout(30):
            while (item := await next_item(prepared, gate)) is not None:
                b = item.batch.batch_id
                if direct:
                    item.read_hot()
                grads = []
                for group, rows in zip(item.plan.groups, item.rows, strict=True):
                    (name,) = group.layout.tables
                    at = group.layout.ids == ROW_ID
                    applied = set(np.flatnonzero(rows[at][0] == 1).tolist())
                    assert np.isin(rows[at][0], (0.0, 1.0)).all()  # each push applied once
                    assert applied <= set(range(b))
                    missed[name].append(b - len(applied))
                    grad = np.zeros((group.layout.ids.size, N), np.float32)
                    grad[at, b] = -1.0
                    grads.append(grad)
                if direct:
                    item.apply_hot(grads)
                pipeline.push(item, grads)
            await gate.until(lambda held, came: came >= pushes)
            gate.release(gate.held)
            await pipeline.drain()
    finally:
        feeding.cancel()
        gate.release(gate.held)
        await pipeline.settle()
    assert not errors, errors
    return missed


@pytest.mark.parametrize("hot_window", [1, 2])
async def test_hot_tables_have_a_window_of_their_own(hot_window: int) -> None:
    """With hot_ratio 0.3, the table of 1 distinct id per 4 samples is hot: its row misses at
    most hot_window - 1 earlier pushes (none when synchronous), while the cold table's row
    still misses up to window - 1 (a hot lookup that starts before the push hot_window
    batches earlier is acknowledged fails this)."""
    window = 4
    gate = PushGate()
    shards = InProcessShards([table(name="t"), table(name="u")], gate=gate)
    pipeline = EmbeddingPipeline(shards, window=window, tables={"f": "t", "g": "u"},
                                 hot_ratio=0.3, hot_window=hot_window)
    missed = await missed_per_table(pipeline, gate, pushes=2 * N)
    assert pipeline.hot_tables == ["u"]
    assert len(missed["u"]) == N and max(missed["u"]) == hot_window - 1
    assert max(missed["t"]) == window - 1  # cold: as stale as the window allows


class DirectGatedShards(InProcessShards):
    """In-process shards whose pushes through the event loop wait at a gate, while the
    compute thread's direct calls (``lookup_now``/``push_now``) serve at once."""

    @property
    def direct(self) -> bool:
        return True

    async def lookup_sharded(self, layout):  # type: ignore[no-untyped-def]
        assert "u" not in layout.tables, "a direct hot table was looked up on the event loop"
        return await super().lookup_sharded(layout)


async def test_direct_hot_tables_see_every_earlier_push_with_no_round_trip() -> None:
    """Rows in this process: the compute side reads the hot table's rows just before each
    step (read_hot) and applies its gradients just after (apply_hot), so every step sees
    every earlier step's push to it, exactly once, and never through the event loop; the
    cold table's pushes wait at the gate and stay as stale as the window allows (a hot read
    at lookup time fails the first, a hot push also sent by push() the exact values)."""
    window = 4
    gate = PushGate()
    shards = DirectGatedShards([table(name="t"), table(name="u")], gate=gate)
    pipeline = EmbeddingPipeline(shards, window=window, tables={"f": "t", "g": "u"},
                                 hot_ratio=0.3)
    # only the cold table's pushes reach the gate
    missed = await missed_per_table(pipeline, gate, pushes=N, direct=True)
    assert pipeline.hot_tables == ["u"]
    assert missed["u"] == [0] * N
    assert max(missed["t"]) == window - 1


@pytest.mark.parametrize("direct", [True, False], ids=["compute_thread", "hot_chain"])
async def test_head_ids_of_a_windowed_table_are_synchronous(direct: bool) -> None:
    """Table ``t`` holds ROW_ID in every batch and three ids no other batch has: with
    head_rate 1, ROW_ID is a head id from the second batch on (seen twice). Where the rows
    live in this process it is read just before each step and updated just after (the compute
    thread), else it rides the hot chain (window 1); the fresh ids keep the window (their
    pushes still wait at the gate). ROW_ID's row then misses at most the first batch's push
    (sent through the window before it was head), never window - 1, and in the end holds every
    push exactly once (a head gradient also sent with the rest applies twice, one never sent
    is missing)."""
    window = 4
    gate = PushGate()
    shards = (DirectGatedShards if direct else InProcessShards)(
        [table(name="t"), table(name="u")], gate=gate)
    pipeline = EmbeddingPipeline(shards, window=window, tables={"f": "t", "g": "u"},
                                 hot_ratio=0.3, head_rate=1.0)
    # through the gate: the rest's push, and on the hot chain both tables' head pushes
    missed = await missed_per_table(pipeline, gate, pushes=N if direct else 3 * N,
                                    direct=direct)
    assert pipeline.heads is not None and pipeline.heads.head_count() == 1
    assert missed["u"] == [0] * N
    assert max(missed["t"]) <= 1 < window - 1
    row, _ = ShardedIds.of_tables({"t": np.array([ROW_ID])}, shards.num_shards)
    final = shards.lookup_now(row)
    assert np.array_equal(final[0], np.ones(N, np.float32))


async def test_async_mode_has_no_head_ids_and_no_hot_chain() -> None:
    """``window=None`` (async mode) bounds nothing: a head_rate given with it makes no head
    ids, so no id is looked up synchronously (a ``window != 1`` test took None for a window)."""
    pipeline = EmbeddingPipeline(InProcessShards([table()]), window=None, tables={"f": "t"},
                                 head_rate=1.0, hot_ratio=1.0)
    await pipeline.plan(batch(0))
    assert pipeline.heads is None and pipeline.hot_tables == []
    bounded = EmbeddingPipeline(InProcessShards([table()]), window=4, tables={"f": "t"},
                                head_rate=1.0)
    await bounded.plan(batch(0))
    assert bounded.heads is not None  # the same settings under a window do make head ids


def test_hot_settings_are_checked() -> None:
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="hot_ratio"):
            EmbeddingPipeline(InProcessShards([table()]), window=2, hot_ratio=bad)
    for bad_window in (0, True, 1.5):
        with pytest.raises(ConfigError, match="hot_window"):
            EmbeddingPipeline(InProcessShards([table()]), window=2,
                              hot_window=bad_window)  # type: ignore[arg-type]
