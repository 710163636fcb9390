"""A served prediction for version v equals the trainer's own prediction at v's step, for
every model kind: train with real PS shards, write a job checkpoint, export it, serve it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from serve_training import (
    SPEC,
    TABLES,
    batch,
    model_config,
    ps_shards,
    read_shards,
    records,
    server,
    trainer_probabilities,
)

from services.ps.inprocess import InProcessShards
from services.serve.__main__ import export_from_flags
from services.serve.config import ExportConfig
from services.serve.sources import export_trainer
from services.worker.job_checkpoints import JobCheckpointer, dense_part
from services.worker.models import MODELS
from services.worker.trainer import Trainer


@pytest.mark.parametrize("kind", sorted(MODELS))
async def test_served_equals_trained_from_a_job_checkpoint(tmp_path: Path, kind: str) -> None:
    rng = np.random.default_rng(1)
    root, models = tmp_path / "ckpt", tmp_path / "models"
    pooling = "mean" if kind == "deepfm" else "sum"
    (tmp_path / "spec.json").write_text(json.dumps(SPEC.to_dict()))
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(dataclasses.asdict(model_config(kind))))
    async with ps_shards(root) as shards:
        trainer = Trainer(model=model_config(kind), ps_addresses=[s.address for s in shards],
                          mode="sync", lr=1e-2, seed=0, pooling=pooling)
        async with trainer:
            await trainer.fit([batch(i, records(rng, 32), rng) for i in range(6)])
            checkpointer = JobCheckpointer(root, admin_urls=[s.admin_url for s in shards])
            await checkpointer.checkpoint(trainer.step, "job-1",
                                          parts={"dense": dense_part(trainer.dense_state())})
            summary = export_from_flags(ExportConfig(
                job_checkpoint="latest", checkpoint_dir=str(root), out=str(models),
                features=str(tmp_path / "spec.json"), model_config=str(tmp_path / "model.yaml"),
                pooling=pooling), read_shards)
            assert summary["step"] == 6 and summary["tables"]["C1"]["rows"] > 0
            probe = records(rng, 40)  # unseen ids among them: their initial rows
            expected = await trainer_probabilities(trainer, probe)
        async with server(models) as service, httpx.AsyncClient(base_url=service.url) as http:
            answer = (await http.post("/v1/predict", json={"records": probe})).json()
            assert answer["version"] == summary["version_id"] and answer["step"] == 6
            np.testing.assert_allclose(answer["probabilities"], expected, rtol=0, atol=1e-6)
            features = SPEC.records(probe)  # the same records as pre-hashed ids
            ids = {f: [features.sparse[f].values[o:o + n].tolist() for o, n in zip(
                features.sparse[f].offsets()[:-1], features.sparse[f].lengths, strict=True)]
                for f in SPEC.sparse}
            by_ids = (await http.post("/v1/predict", json={
                "ids": ids, "dense": features.dense.tolist()})).json()
            np.testing.assert_allclose(by_ids["probabilities"], expected, rtol=0, atol=1e-6)
    assert len(set(np.round(expected, 5))) > 5  # the records get different answers


async def test_export_of_a_live_trainer_serves_its_predictions(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    shards = InProcessShards(list(TABLES), num_shards=2)
    async with Trainer(model=model_config("dlrm"), rows_client=shards, mode="sync",
                       lr=1e-2) as trainer:
        await trainer.fit([batch(i, records(rng, 32), rng) for i in range(4)])
        snapshots = {t.name: [s.tables[t.name].snapshot() for s in shards.shards]
                     for t in TABLES}
        manifest = export_trainer(tmp_path, trainer, snapshots, model=model_config("dlrm"),
                                  spec=SPEC, row_dtype="float16")
        probe = records(rng, 30)
        expected = await trainer_probabilities(trainer, probe)
    assert manifest["step"] == 4 and manifest["row_dtype"] == "float16"
    async with server(tmp_path) as service, httpx.AsyncClient(base_url=service.url) as http:
        answer = (await http.post("/v1/predict", json={"records": probe})).json()
    np.testing.assert_allclose(answer["probabilities"], expected, atol=2e-3)
