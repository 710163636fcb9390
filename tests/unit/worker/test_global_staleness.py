"""Staleness over every worker's pushes: the PS's count, and the globally synchronous mode.

W pipelines share the PS's shards in this process. The table is SGD with lr = 1 and zero
initial rows; every batch is one sample of the same id, and worker ``w``'s batch of step ``t``
pushes ``-e_{w·N + t}``: a looked-up row is the indicator of the pushes (of every worker)
applied before its lookup. The workers compute in lockstep (a barrier between reading the rows
and pushing, as the dense all-reduce makes them), and a :class:`PushGate` holds every push
until no worker can go on without one, so every lookup is as stale as the mode allows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from services.common.batch import Batch, Jagged
from services.common.errors import ConfigError
from services.common.messages import TableStats
from services.ps.inprocess import InProcessShards, PushGate
from services.worker.embedding.pipeline import EmbeddingPipeline, Prepared

W = 2  # workers
N = 8  # steps per worker
ROW_ID = 7
IDLE_ROUNDS = 100  # event-loop rounds without progress after which a held push is released


def table() -> dict[str, object]:
    return {"name": "t", "dim": W * N, "initializer": "zeros",
            "optimizer": {"kind": "sgd", "lr": 1.0}}


def batch(b: int) -> Batch:
    return Batch(batch_id=b, labels=np.zeros(1, np.float32), dense=np.zeros((1, 1), np.float32),
                 sparse={"f": Jagged(np.array([ROW_ID], np.uint64), np.array([1], np.int32))})


async def release_when_stuck(gate: PushGate, progress: list[int]) -> None:
    """Release the oldest held push whenever nothing happened for ``IDLE_ROUNDS`` rounds."""
    while True:
        before = progress[0]
        for _ in range(IDLE_ROUNDS):
            await asyncio.sleep(0)
        if progress[0] == before and gate.held:
            gate.release(1)


async def train(worker: int, pipeline: EmbeddingPipeline, lockstep: asyncio.Barrier,
                progress: list[int]) -> list[tuple[int, set[int], int]]:
    """Worker ``worker``'s N steps: (step, pushes its rows include, its own staleness)."""
    prepared: asyncio.Queue[Prepared | None] = asyncio.Queue()
    errors: list[BaseException] = []
    pipeline.begin()
    feeding = asyncio.create_task(pipeline.feed([batch(t) for t in range(N)], prepared.put,
                                                errors.append))
    seen = []
    try:
        while (item := await prepared.get()) is not None:
            t = item.batch.batch_id
            row = item.rows[0][0]
            assert np.array_equal(np.round(row), row)  # only whole pushes
            seen.append((t, set(np.flatnonzero(row == 1).tolist()), item.staleness))
            progress[0] += 1
            await lockstep.wait()  # every worker read its rows of step t (the all-reduce)
            grad = np.zeros((1, W * N), np.float32)
            grad[0, worker * N + t] = -1.0
            pipeline.push(item, [grad])
        await pipeline.drain()
    finally:
        feeding.cancel()
        await pipeline.settle()
    assert not errors, errors
    return seen


async def run(window: int, barrier: Callable[[asyncio.Barrier], Callable[[], Awaitable[Any]]]
              | None = None, *, hot: bool = False, **options: Any
              ) -> tuple[TableStats, list[list[tuple[int, set[int], int]]]]:
    """W workers' steps; ``barrier`` after each acknowledged push (``hot``: the hot chain's
    pushes only); ``options`` for every pipeline."""
    gate = PushGate()
    shards = InProcessShards([table()], gate=gate)
    lockstep, everyone = asyncio.Barrier(W), asyncio.Barrier(W)
    wait = {("hot_barrier" if hot else "barrier"): barrier(everyone) if barrier else None}
    pipelines = [EmbeddingPipeline(shards, window=window, tables={"f": "t"}, worker=w, workers=W,
                                   **wait, **options) for w in range(W)]
    progress = [0]
    releaser = asyncio.create_task(release_when_stuck(gate, progress))
    try:
        async with asyncio.timeout(30):  # a deadlock fails, never hangs
            seen = await asyncio.gather(*(train(w, p, lockstep, progress)
                                          for w, p in enumerate(pipelines)))
    finally:
        releaser.cancel()
        gate.release(gate.held)
    return shards.shards[0].stats("t").tables["t"], seen


def missed(t: int, applied: set[int]) -> tuple[int, list[int]]:
    """(earlier pushes of every worker not in ``applied``, per worker)."""
    per = [sum(1 for s in range(t) if v * N + s not in applied) for v in range(W)]
    return sum(per), per


def ps_matches_rows(stats: TableStats, seen: list[list[tuple[int, set[int], int]]]
                    ) -> list[int]:
    """Check the PS's counts against what the rows show; return every lookup's global miss
    (the most pushes of any one worker it missed)."""
    globals_, owns, totals = [], [], []
    for w, steps in enumerate(seen):
        for t, applied, staleness in steps:
            assert all(p % N < t for p in applied), (w, t, applied)  # no later step's push
            total, per = missed(t, applied)
            assert per[w] == staleness  # the pipeline's own figure is the truth too
            globals_.append(max(per))
            owns.append(per[w])
            totals.append(total)
    assert stats.tagged_lookups == W * N
    for name, counts in (("global", globals_), ("own", owns), ("total", totals)):
        assert getattr(stats, f"{name}_staleness_max") == max(counts), name
        mean = getattr(stats, f"{name}_staleness_mean")
        assert mean == pytest.approx(sum(counts) / len(counts)), name
    return globals_


def gloo_like(everyone: asyncio.Barrier) -> Callable[[], Awaitable[Any]]:
    return everyone.wait


async def test_globally_synchronous_lookups_see_every_earlier_push_of_every_worker() -> None:
    """With one slot and a barrier after each acknowledged push, the lookup of step t sees the
    push of every step before t of every worker, and the PS counts no miss (freeing the
    barrier at send rather than at ack, or a batch riding on its worker's push, misses the
    other workers' pushes)."""
    stats, seen = await run(1, gloo_like)
    assert max(ps_matches_rows(stats, seen)) == 0
    for steps in seen:
        for t, applied, _ in steps:
            assert applied == {v * N + s for v in range(W) for s in range(t)}


@pytest.mark.parametrize("window", [1, 3])
async def test_the_ps_counts_the_pushes_of_every_worker_a_lookup_missed(window: int) -> None:
    """Without the barrier, a worker's window bounds only its own pushes: with one slot
    (``sync``) a lookup still misses the other workers' latest pushes. The PS's global and
    own counts equal what the rows show (an off-by-one in the count, or tags that drift from
    the steps, fails this)."""
    stats, seen = await run(window)
    globals_ = ps_matches_rows(stats, seen)
    assert stats.own_staleness_max == window - 1
    assert max(globals_) > stats.own_staleness_max  # the other workers' pushes missed too


@pytest.mark.parametrize("global_hot", [True, False])
async def test_global_hot_head_ids_see_every_workers_push_of_the_step_before(global_hot: bool
                                                                             ) -> None:
    """Hybrid, window 4, ROW_ID a head id from step 1 on (seen in every batch): it rides the
    hot chain. With a barrier after each of its acknowledged pushes, the lookup of step t >= 2
    includes every worker's push of steps 1 .. t - 1 (step 0's went through the window, before
    ROW_ID was head); without it, a worker's head rows miss the other worker's latest pushes
    (a chain that rides the next lookup on its push, or frees the barrier at send, fails the
    first case)."""
    _, seen = await run(4, gloo_like if global_hot else None, hot=True, head_rate=1.0)
    late = [(t, {v * N + s for v in range(W) for s in range(1, t)} - applied)
            for steps in seen for t, applied, _ in steps if t >= 2]
    if global_hot:
        assert all(not missing for _, missing in late), late
    else:
        assert any(missing for _, missing in late)


def test_bad_worker_ranks_and_a_barrier_without_a_window_are_clear_errors() -> None:
    shards = InProcessShards([table()])
    for worker, workers in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ConfigError, match="worker must be in"):
            EmbeddingPipeline(shards, window=1, worker=worker, workers=workers)
    with pytest.raises(ConfigError, match="barrier needs a window"):
        EmbeddingPipeline(shards, window=None, barrier=asyncio.Barrier(1).wait)
