"""Online: a job training from Kafka (librdkafka's mock cluster, a real loader, real PS
shards) exports model versions on its cadence, and a running server (port 0) answers with
the newest, as the trainer itself predicts at that step."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_training import eventually, model_config, ps_shards, server, trainer_predict

from clients.loader_client import LoaderClient
from services.common.batch import Batch
from services.loader.config import LoaderConfig
from services.loader.service import LoaderService
from services.loader.sources.kafka import produce_file
from services.ps.checkpoint import read_checkpoint
from services.serve.online import OnlineExport, loader_feature_spec
from services.worker.trainer import Trainer
from tests.integration.loader.conftest import kafka  # noqa: F401 - the mock Kafka cluster

pytestmark = pytest.mark.service

STEPS, EVERY, BATCH = 6, 3, 32


def criteo_lines(rng: np.random.Generator, n: int) -> list[str]:
    """Criteo-layout lines with 2 dense and 2 sparse features (label first)."""
    return [f"{int(rng.random() < 0.3)}\t{rng.integers(0, 50)}\t{rng.integers(0, 9)}"
            f"\tu{rng.integers(0, 40)}\tc{rng.integers(0, 15)}" for _ in range(n)]


async def test_a_job_training_from_kafka_exports_and_the_server_follows(
        kafka, tmp_path: Path) -> None:  # noqa: F811 - the fixture imported above
    rng = np.random.default_rng(11)
    topic = kafka.create_topic()
    (tmp_path / "rows.txt").write_text("\n".join(criteo_lines(rng, STEPS * BATCH * 2)) + "\n")
    await produce_file(kafka.bootstrap, topic, str(tmp_path / "rows.txt"))
    probe = criteo_lines(rng, 8)
    models, root = tmp_path / "models", tmp_path / "ckpt"
    loader = LoaderService(LoaderConfig(
        source=f"kafka://{kafka.bootstrap}/{topic}?group=online&dense=2&sparse=2",
        grpc_port=0, admin_port=0, batch_size=BATCH))
    await loader.start()
    try:
        spec = await asyncio.to_thread(loader_feature_spec, loader.admin_url)
        async with ps_shards(root) as shards, server(models) as service, \
                Trainer(model=model_config("deepfm"), mode="sync", lr=1e-2,
                        ps_addresses=[s.address for s in shards]) as trainer, \
                LoaderClient(loader.address, credits=4) as client, \
                httpx.AsyncClient(base_url=service.url, timeout=30) as http:
            exporter = OnlineExport(
                model_dir=str(models), checkpoint_dir=str(root),
                ps_admin_urls=[s.admin_url for s in shards], spec=spec,
                model=model_config("deepfm"), every_steps=EVERY, full_every=2,
                read_shards=functools.partial(read_checkpoint, shard_id=0, num_shards=1),
            ).attach(trainer)
            await trainer.fit(client, steps=STEPS)
            assert trainer.step == STEPS and exporter.errors == 0
            v1, v2 = exporter.exported
            assert (v1["step"], v2["step"]) == (EVERY, STEPS)
            assert v1["base"] is None and v2["base"] == v1["version_id"]  # incremental
            assert not [p for p in root.iterdir() if p.name.startswith("export-")]

            async def answer() -> dict:
                response = await http.post("/v1/predict", json={"lines": probe})
                assert response.status_code == 200, response.text
                return response.json()

            async def newest() -> bool:
                return (await answer())["version"] == v2["version_id"]

            await eventually(newest)
            f = spec.lines(probe)
            mine = await trainer_predict(trainer, Batch(
                batch_id=0, labels=np.zeros(f.size, np.float32), dense=f.dense,
                sparse=f.sparse))
            np.testing.assert_allclose((await answer())["probabilities"], mine, atol=1e-6)
            rolled = await http.post(f"/v1/versions/{v1['version_id']}/activate")
            assert rolled.status_code == 200
            older = (await answer())["probabilities"]
            assert np.abs(np.array(older) - mine).max() > 1e-4  # the versions differ
    finally:
        await loader.close()
