"""Periodic parameter averaging through the Trainer stays in step on every rank, however far
a rank's event loop lags its compute thread.

The compute thread takes the steps and calls the sync strategy; the event loop counts the
steps whose results it has handled (``Trainer.step``). ``local_sgd`` averages after every
``every``-th step, so it must be told the step the compute thread took: told the loop's
count, a rank whose loop is busy (here each push holds it, as a loaded machine does) calls
the average at other steps than the others, and gloo aborts on a collective of another size
("Received data size doesn't match expected size", issue 46). Two gloo ranks, each with the
PS's shards in its process behind a rows client whose pushes on rank 1 hold the loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from services.common.sharding import ShardedIds
from services.loader.planted import SyntheticConfig, SyntheticDataset
from services.ps.inprocess import InProcessShards
from services.worker.config import TrainerConfig, ps_table_configs
from services.worker.distributed import run_local_ranks
from services.worker.embedding.rows import PushCounts
from services.worker.models import ModelConfig
from services.worker.sync.base import flatten
from services.worker.trainer import Trainer

DATA = SyntheticConfig(seed=5)
STEPS, EVERY, BATCH, HOLD_S = 12, 2, 32, 0.05
CONFIG = TrainerConfig(mode="hybrid", staleness=4, hot_ratio=0.0, head_rate=0.0,
                       sync="local_sgd", sync_period=EVERY)


class BusyLoopRows:
    """A rows client (:class:`~services.worker.embedding.rows.RowsClient`) whose pushes hold
    the event loop ``hold_s`` before they run: the loop handles no step result meanwhile,
    while the compute thread goes on with the batches it holds."""

    def __init__(self, rows: InProcessShards, hold_s: float) -> None:
        self.rows, self.hold_s = rows, hold_s

    @property
    def num_shards(self) -> int:
        return self.rows.num_shards

    @property
    def dims(self) -> dict[str, int]:
        return self.rows.dims

    @property
    def codec_stats(self) -> Any:
        return self.rows.codec_stats

    async def tables(self) -> list[Any]:
        return await self.rows.tables()

    async def lookup_sharded(self, layout: ShardedIds) -> np.ndarray:
        return await self.rows.lookup_sharded(layout)

    async def push_sharded(self, layout: ShardedIds, grads: np.ndarray) -> PushCounts:
        time.sleep(self.hold_s)  # (blocking on purpose: the loop is busy)
        return await self.rows.push_sharded(layout, grads)

    async def push_then_lookup(self, layout: ShardedIds, grads: np.ndarray,
                               then: ShardedIds) -> tuple[PushCounts, np.ndarray]:
        time.sleep(self.hold_s)
        return await self.rows.push_then_lookup(layout, grads, then)

    def wire_bytes(self) -> dict[str, int]:
        return self.rows.wire_bytes()

    async def close(self) -> None:
        await self.rows.close()


def train_rank(rank: int, world: int) -> dict[str, Any]:
    dataset = SyntheticDataset(DATA)
    batches = list(dataset.batches(BATCH, BATCH * world * STEPS))[rank::world]
    shards = InProcessShards(ps_table_configs({f: 8 for f in DATA.sparse_names}))
    rows = BusyLoopRows(shards, HOLD_S if rank == 1 else 0.0)

    async def fit() -> dict[str, Any]:
        async with Trainer(model=ModelConfig(name="dlrm"), rows_client=rows,
                           config=CONFIG) as trainer:
            summary = await trainer.fit(batches)
            assert trainer.module is not None
            return {"steps": summary.steps, "syncs": summary.sync["syncs"],
                    "params": flatten([p for p in trainer.module.parameters()
                                       if p.requires_grad]).numpy()}
    return asyncio.run(fit())


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_local_ranks(train_rank, 2, timeout_s=180)


def test_local_sgd_averages_at_the_same_steps_on_every_rank(
        ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["steps"] == STEPS and r["syncs"] == STEPS // EVERY, r
    np.testing.assert_array_equal(ranks[0]["params"], ranks[1]["params"])  # finish(): one model
