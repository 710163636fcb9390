"""One head-id set for the job: the workers' counts elect the head ids together, so an id is
head for every worker or for none.

Two workers share the PS's shards in this process. Id ``SHARED`` is in every batch of both
workers; id ``LOPSIDED`` is in every batch of worker 0 only. With head rate 1 (an id seen
about once per batch per worker is head), per-worker decisions make ``LOPSIDED`` head for
worker 0 and tail for worker 1: one worker looks it up synchronously while the other pushes
it S steps stale. The vote sums the counts over the workers: ``LOPSIDED`` reaches half the
job's threshold and is head for neither; ``SHARED`` is head for both.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.common.batch import Batch, Jagged
from services.ps.inprocess import InProcessShards
from services.worker.embedding.head_vote import Ballot
from services.worker.embedding.heads import HeadIds
from services.worker.embedding.pipeline import EmbeddingPipeline, Prepared
from tests.unit.worker.loop_collectives import LoopCollectives

W, N = 2, 12
SHARED, LOPSIDED = 7, 8


def batch(w: int, t: int) -> Batch:
    ids = [SHARED, LOPSIDED, 1000 + 100 * w + t] if w == 0 else [SHARED, 1000 + 100 * w + t]
    return Batch(batch_id=t, labels=np.zeros(1, np.float32), dense=np.zeros((1, 1), np.float32),
                 sparse={"f": Jagged(np.array(ids, np.uint64), np.array([len(ids)], np.int32))})


async def heads_seen(pipeline: EmbeddingPipeline, w: int) -> list[set[int]]:
    """Per step, the ids of the batch that were head ids (the split's head layout)."""
    prepared: asyncio.Queue[Prepared | None] = asyncio.Queue()
    errors: list[BaseException] = []
    pipeline.begin()
    feeding = asyncio.create_task(pipeline.feed([batch(w, t) for t in range(N)], prepared.put,
                                                errors.append))
    seen = []
    try:
        while (item := await prepared.get()) is not None:
            assert item.split is not None
            seen.append({int(i) for i in item.split.head.groups[0].layout.ids})
            pipeline.push(item, [np.zeros((item.plan.groups[0].layout.ids.size, 4), np.float32)])
        await pipeline.drain()
    finally:
        feeding.cancel()
        await pipeline.settle()
    assert not errors, errors
    return seen


@pytest.mark.parametrize("voting", [True, False], ids=["job_vote", "per_worker"])
async def test_an_id_is_head_for_every_worker_or_for_none(voting: bool) -> None:
    shards = InProcessShards([{"name": "t", "dim": 4, "initializer": "zeros",
                               "optimizer": {"kind": "sgd", "lr": 1.0}}])
    collective = LoopCollectives(W)
    pipelines = [EmbeddingPipeline(shards, window=4, tables={"f": "t"}, worker=w, workers=W,
                                   head_rate=1.0,
                                   head_vote=collective.head_vote(w) if voting else None)
                 for w in range(W)]
    async with asyncio.timeout(30):
        seen = await asyncio.gather(*(heads_seen(p, w) for w, p in enumerate(pipelines)))
    late = [steps[N // 2:] for steps in seen]  # once decided
    if voting:
        assert all(heads == {SHARED} for steps in late for heads in steps), late
        assert [p.head_count() for p in pipelines] == [1, 1]
    else:  # per worker: LOPSIDED head for worker 0 only
        assert all(LOPSIDED in heads for heads in late[0])
        assert all(LOPSIDED not in heads for heads in late[1])


async def test_the_vote_elects_by_the_counts_summed_over_the_workers() -> None:
    """Threshold 3 per worker, 3 workers: elected at a summed 9. Key 5 (4 + 4 + 1) is; key 6
    (8 + 0 + 0, head for its worker alone) is not; key 9 (2 + 2 + 2: no worker's candidate)
    cannot be; key 11 (3 + 3 + 3) is, though counted by workers that did not propose it."""
    counts = [{0: (np.array([5, 6, 9, 11], np.uint64), np.array([4, 8, 2, 3]))},
              {0: (np.array([5, 9, 11], np.uint64), np.array([4, 2, 3]))},
              {0: (np.array([5, 9, 11, 12], np.uint64), np.array([1, 2, 3, 1]))}]
    collective = LoopCollectives(3)
    elected = await asyncio.gather(*(collective.head_vote(w)(Ballot(c, 3.0))
                                     for w, c in enumerate(counts)))
    for got in elected:
        assert got[0].tolist() == [5, 11]


def test_voted_head_ids_are_neither_sticky_nor_deferred() -> None:
    with pytest.raises(Exception, match="neither sticky nor deferred"):
        HeadIds([0], 1.0, sticky=True, voting=True)
