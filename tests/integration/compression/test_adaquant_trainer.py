"""AdaQuant driven by the Trainer's loss on the dense all-reduce: the same s on every rank (the
mean loss over the ranks, not each rank's own). The PS push path's is in
test_trainer_compression.py."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from services.loader.planted import SyntheticConfig, SyntheticDataset
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
