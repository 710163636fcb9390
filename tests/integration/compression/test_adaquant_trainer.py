"""AdaQuant driven by the Trainer's loss: the same s on every rank (the mean loss over the
ranks, not each rank's own) on the dense all-reduce, and the PS push path through the
child-process client, with s starting at s0 and rising as the loss falls."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from services.loader.synthetic import SyntheticConfig, SyntheticDataset
from services.local.processes import LocalPS
from services.ps.inprocess import InProcessShards
from services.worker.config import ps_table_configs
from services.worker.distributed import run_local_ranks
from services.worker.models import ModelConfig
from services.worker.trainer import Trainer

DATA = SyntheticConfig(seed=11)
FEATURES = DATA.sparse_names
STEPS = 8


def _dense_rank(rank: int, world: int) -> dict[str, Any]:
    """Each rank trains on its own batches with the adaquant DDP hook (s0 = 16, window 1: a
    loss that differs by a few percent between ranks would give a different s)."""
    batches = list(SyntheticDataset(DATA).batches(32, 32 * STEPS * world))[rank::world]
    rows = InProcessShards(ps_table_configs({f: 8 for f in FEATURES}), num_shards=1)

    async def train() -> dict[str, Any]:
        async with Trainer(model=ModelConfig(name="dlrm"), rows_client=rows, mode="sync",
                           lr=0.05, dense_optimizer="sgd",
                           dense_codec="adaquant:s0=16,window=1") as t:
            summary = await t.fit(batches)
        return {"levels": list(t.adaquant_levels["dense"]), "losses": summary.recent_losses,
                "dense": summary.dense_bytes}

    return asyncio.run(train())


def test_dense_adaquant_uses_the_mean_loss_of_every_rank() -> None:
    r0, r1 = run_local_ranks(_dense_rank, 2, timeout_s=120)
    assert len(r0["levels"]) == STEPS and r0["levels"][0] == 16  # s0 at the first step
    assert r0["levels"] == r1["levels"]                             # one s for every rank
    assert r0["losses"] != r1["losses"]                             # from different losses
    own = [np.ceil(np.sqrt(r["losses"][0] / np.array(r["losses"])) * 16 - 1e-9).tolist()
           for r in (r0, r1)]
    assert own[0] != own[1]  # each rank's own loss would have given the ranks different s
    assert r0["dense"]["steps"] == STEPS and r0["dense"]["ratio"] > 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalPS]:
    with LocalPS(2, ps_table_configs({f: 8 for f in FEATURES})) as ps:
        yield ps


async def test_grads_adaquant_through_the_child_process_rises_from_s0(cluster: LocalPS) -> None:
    batches = list(SyntheticDataset(DATA).batches(128, 128 * 2 * STEPS))
    async with Trainer(model=ModelConfig(name="dlrm"), ps_addresses=cluster.addresses,
                       mode="sync", lr=1e-2, ps_process=True,
                       grads_codec="adaquant:s0=2,window=4") as t:
        summary = await t.fit(batches)
    levels = list(t.adaquant_levels["grads"])
    assert len(levels) == 2 * STEPS and levels[0] == 2
    assert levels[-1] > 2, levels                         # more levels as the loss fell
    assert np.mean(summary.recent_losses[-4:]) < np.mean(summary.recent_losses[:4])
    sent = summary.codec_bytes["grads_up"]["adaquant"]["sent"]
    assert sent["arrays"] == 2 * 2 * STEPS and sent["wire_bytes"] < sent["raw_bytes"] / 4
