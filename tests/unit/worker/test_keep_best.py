"""Keeping the best state of a fit (``services.worker.best``) on the PS's own shards in this
process: the state restored is exactly the one of the same run stopped at the best step,
embedding rows and their optimizer state included, and bad settings fail before a step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.common.batch import Batch
from services.common.errors import ConfigError, FailedPrecondition
from services.loader.planted import SyntheticConfig, SyntheticDataset
from services.ps.inprocess import InProcessShards
from services.worker.best import BestState
from services.worker.config import TrainerConfig, ps_table_configs
from services.worker.models import ModelConfig
from services.worker.trainer import Trainer

DATA = SyntheticDataset(SyntheticConfig(seed=3))
TRAIN = list(DATA.batches(128, 128 * 10)) * 3  # 3 epochs of 10 steps
TEST = list(DATA.batches(512, 1024, split="test"))
# validation labels flipped: its AUC is highest where the real one is lowest, so the best
# state is the first one evaluated (step 10 of 30): a planted peak before the end
FLIPPED = [Batch(batch_id=b.batch_id, labels=1 - b.labels, dense=b.dense, sparse=b.sparse)
           for b in DATA.batches(512, 1024, split="validation")]


def shards(snapshots: Path | None = None) -> InProcessShards:
    return InProcessShards(ps_table_configs({f: 8 for f in DATA.config.sparse_names}),
                           num_shards=2, shard_config={"checkpoint_dir": str(snapshots)}
                           if snapshots else None)


def trainer(rows: Any, **settings: Any) -> Trainer:
    return Trainer(model=ModelConfig(name="dlrm"), rows_client=rows, lr=3e-3, mode="sync",
                   seed=7, **settings)


def table_state(rows: InProcessShards, ids: dict[tuple[int, str], np.ndarray]
                ) -> dict[tuple[int, str], list[np.ndarray]]:
    """Each shard's table's rows and optimizer state of ``ids`` (theirs, in id order)."""
    out = {}
    for (k, name), wanted in ids.items():
        snap = rows.shards[k].table(name).snapshot()
        keep = np.isin(snap.ids, wanted)
        out[k, name] = [snap.ids[keep], snap.rows[keep],
                        *(snap.state[s][keep] for s in sorted(snap.state))]
    return out


async def test_the_best_state_is_restored_with_its_embedding_rows(tmp_path: Path) -> None:
    stopped = shards()  # the same run stopped at the best step (10): what keep_best must give
    async with trainer(stopped) as t:
        await t.fit(TRAIN, steps=10)
        want = {"test": await t.evaluate(TEST), "dense": t.dense_state()}
    ids = {(k, name): table.ids() for k, shard in enumerate(stopped.shards)
           for name, table in shard.tables.items()}
    last = shards()  # the whole run, validated but not kept: the state a dense-only restore
    async with trainer(last, eval_every=10, keep_best=False) as t:  # would leave on the PS
        full = await t.fit(TRAIN, eval_batches=TEST, validation_batches=FLIPPED)
    kept = shards(tmp_path)
    async with trainer(kept, eval_every=10) as t:
        summary = await t.fit(TRAIN, eval_batches=TEST, validation_batches=FLIPPED)
        dense = t.dense_state()
    assert [h["step"] for h in summary.validation] == [10, 20, 30]
    aucs = [h["auc"] for h in summary.validation]
    assert aucs == [h["auc"] for h in full.validation] and aucs[0] > max(aucs[1:])
    assert summary.best_step == 10 and summary.best_validation_auc == aucs[0]
    assert summary.restored_best and not full.restored_best and full.best_step == 10
    assert summary.steps == 30 and dense["step"] == 10
    # the held-out figures and every weight are those of the run stopped at step 10 ...
    assert summary.auc == pytest.approx(want["test"]["auc"], abs=1e-9)
    assert summary.logloss == pytest.approx(want["test"]["logloss"], abs=1e-9)
    assert abs(full.logloss - summary.logloss) > 1e-3  # (the last state scores otherwise)
    for key, value in want["dense"]["model"].items():
        torch.testing.assert_close(dense["model"][key], value, rtol=0, atol=1e-9)
    moments = [s["exp_avg_sq"] for s in dense["optimizer"]["state"].values()]
    assert moments and all(torch.equal(a, s["exp_avg_sq"]) for a, s in zip(
        moments, want["dense"]["optimizer"]["state"].values(), strict=True))
    # ... and so are the embedding rows with their Adagrad state, which moved after step 10
    expected, restored, moved = (table_state(r, ids) for r in (stopped, kept, last))
    for key, arrays in expected.items():
        assert len(arrays[0]) and all(np.array_equal(a, b) for a, b in zip(
            arrays, restored[key], strict=True)), key
    assert any(not np.array_equal(expected[key][1], moved[key][1]) for key in expected)


async def test_bad_settings_fail_before_the_first_step(tmp_path: Path) -> None:
    rows = shards(tmp_path)
    bad: list[tuple[dict[str, Any], Any, str]] = [
        ({"keep_best": True, "eval_every": 10}, None, "give validation data"),
        ({}, FLIPPED, "set eval_every"),
    ]
    for settings, validation, message in bad:
        async with trainer(rows, **settings) as t:
            with pytest.raises(ConfigError, match=message):
                await t.fit(TRAIN, eval_batches=TEST, validation_batches=validation)
            assert t.step == 0 and t.module is None
    assert all(table.num_rows == 0 for s in rows.shards for table in s.tables.values())
    remote = Trainer(model="dlrm", ps_addresses=["127.0.0.1:1"], eval_every=10)
    assert remote.rows_snapshots is None
    with pytest.raises(ConfigError, match="RowsSnapshots"):  # before connecting anywhere
        await remote.fit(TRAIN, validation_batches=FLIPPED)
    no_dir = shards()
    with pytest.raises(FailedPrecondition, match="checkpoint_dir"):
        await no_dir.snapshot_rows("best")


async def test_every_push_is_acknowledged_before_a_validation() -> None:
    """The state validated is the state snapshotted: no push of an earlier step in flight."""
    order: list[str] = []

    class Pipeline:
        async def drain(self) -> None:
            order.append("drain")

    class Rows:
        async def snapshot_rows(self, name: str) -> None:
            order.append("snapshot")

        async def restore_rows(self, name: str) -> None:
            order.append("restore")

    class Fake:
        config = TrainerConfig(eval_every=10)
        pipeline, rows_snapshots, step = Pipeline(), Rows(), 10

        async def evaluate(self, batches: Any) -> dict[str, float]:
            order.append("evaluate")
            return {"auc": 0.5, "logloss": 0.7, "samples": 1}

        def dense_state(self) -> dict[str, Any]:
            return {"step": self.step}

    best = BestState(Fake(), FLIPPED, keep=True)  # type: ignore[arg-type]
    await best.evaluate()
    assert order == ["drain", "evaluate", "snapshot"]
