"""The bound across workers (SSP): with a step gate no lookup misses more than S pushes of any
worker, however uneven the workers' speeds, and every worker stops where the first runs out.

W pipelines share the PS's shards in this process, with no lockstep between them (as with
local SGD or ShadowSync, which all-reduce nothing per step). The table is SGD with lr = 1 and
zero rows; every batch is one sample of the same id, and worker ``w``'s batch of step ``t``
pushes ``-e_{w·N + t}``: a looked-up row is the indicator of the pushes (of every worker)
applied before its lookup. Worker 0 is slow: it yields the event loop ``SLOW`` times a step.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.common.batch import Batch, Jagged
from services.ps.inprocess import InProcessShards
from services.worker.embedding.pipeline import EmbeddingPipeline, Prepared
from tests.unit.worker.loop_collectives import LoopCollectives

W, N, S = 4, 16, 2  # workers, steps, window
ROW_ID = 7
SLOW = 200  # event-loop rounds worker 0 spends per step


def batch(t: int) -> Batch:
    return Batch(batch_id=t, labels=np.zeros(1, np.float32), dense=np.zeros((1, 1), np.float32),
                 sparse={"f": Jagged(np.array([ROW_ID], np.uint64), np.array([1], np.int32))})


async def train(w: int, pipeline: EmbeddingPipeline, batches: int) -> list[tuple[int, set[int]]]:
    prepared: asyncio.Queue[Prepared | None] = asyncio.Queue()
    errors: list[BaseException] = []
    pipeline.begin()
    feeding = asyncio.create_task(pipeline.feed([batch(t) for t in range(batches)],
                                                prepared.put, errors.append))
    seen = []
    try:
        while (item := await prepared.get()) is not None:
            t = item.batch.batch_id
            row = item.rows[0][0]
            seen.append((t, set(np.flatnonzero(row == 1).tolist())))
            for _ in range(SLOW if w == 0 else 1):
                await asyncio.sleep(0)
            grad = np.zeros((1, W * N), np.float32)
            grad[0, w * N + t] = -1.0
            pipeline.push(item, [grad])
        await pipeline.drain()
    finally:
        feeding.cancel()
        await pipeline.settle()
    assert not errors, errors
    return seen


async def run(gated: bool, batches: list[int]) -> list[list[tuple[int, set[int]]]]:
    """The workers' (step, pushes applied) per lookup; the PS's own count of the worst miss
    is checked against them."""
    shards = InProcessShards([{"name": "t", "dim": W * N, "initializer": "zeros",
                               "optimizer": {"kind": "sgd", "lr": 1.0}}])
    collectives = LoopCollectives(W)
    pipelines = [EmbeddingPipeline(shards, window=S, tables={"f": "t"}, worker=w, workers=W,
                                   step_gate=collectives.step_gate(w) if gated else None)
                 for w in range(W)]
    async with asyncio.timeout(30):  # a deadlock fails, never hangs
        seen = list(await asyncio.gather(*(train(w, p, n) for w, (p, n)
                                           in enumerate(zip(pipelines, batches, strict=True)))))
    assert shards.shards[0].stats("t").tables["t"].global_staleness_max == worst_miss(seen)
    return seen


def worst_miss(seen: list[list[tuple[int, set[int]]]]) -> int:
    """The most pushes of one worker that one lookup missed (earlier steps not applied)."""
    return max(sum(1 for s in range(t) if v * N + s not in applied)
               for steps in seen for t, applied in steps for v in range(W))


@pytest.mark.parametrize("gated", [True, False], ids=["step_gate", "own_window_only"])
async def test_no_lookup_misses_more_than_s_pushes_of_any_worker(gated: bool) -> None:
    """Without the gate the fast workers run ahead of the slow one and their lookups miss
    ever more of its pushes (the bound is per worker only); with it, at most S."""
    seen = await run(gated, [N] * W)
    assert [len(steps) for steps in seen] == [N] * W
    if gated:
        assert worst_miss(seen) <= S
    else:
        assert worst_miss(seen) > 2 * S


async def test_every_worker_stops_at_the_step_where_the_first_runs_out() -> None:
    seen = await run(True, [N, N, N, N - 5])
    assert [len(steps) for steps in seen] == [N - 5] * W
    assert worst_miss(seen) <= S
