"""``persimmon export`` then ``persimmon serve`` as processes: a job checkpoint of real PS
shards becomes a served model whose answers are the trainer's."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import yaml
from serve_training import (
    SPEC,
    batch,
    model_config,
    ps_shards,
    records,
    trainer_probabilities,
)

from services.local.processes import start_service, stop_processes
from services.worker.checkpoints import JobCheckpointer, dense_part
from services.worker.trainer import Trainer

PERSIMMON = [sys.executable, "-m", "services.cli"]


async def test_export_and_serve_commands(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    root, models = tmp_path / "ckpt", tmp_path / "models"
    (tmp_path / "spec.json").write_text(json.dumps(SPEC.to_dict()))
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(dataclasses.asdict(
        model_config("wide_deep"))))
    async with ps_shards(root) as shards:
        async with Trainer(model=model_config("wide_deep"), mode="sync", lr=1e-2,
                           ps_addresses=[s.address for s in shards]) as trainer:
            await trainer.fit([batch(i, records(rng, 32), rng) for i in range(3)])
            await JobCheckpointer(root, admin_urls=[s.admin_url for s in shards]).checkpoint(
                trainer.step, "job-a", parts={"dense": dense_part(trainer.dense_state())})
            probe = records(rng, 10)
            expected = await trainer_probabilities(trainer, probe)
    export = subprocess.run(
        [*PERSIMMON, "export", "--job-checkpoint", "job-a", "--checkpoint-dir", str(root),
         "--out", str(models), "--features", str(tmp_path / "spec.json"),
         "--model-config", str(tmp_path / "model.yaml"), "--row-dtype", "float32"],
        capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    summary = json.loads(export.stdout)
    assert summary["step"] == 3 and (models / summary["version_id"] / "manifest.json").exists()
    missing = subprocess.run(
        [*PERSIMMON, "export", "--job-checkpoint", "job-x", "--checkpoint-dir", str(root),
         "--out", str(models), "--features", str(tmp_path / "spec.json")],
        capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "job-x" in missing.stderr  # one clear line, no trace
    proc, _, admin_port = start_service(
        [*PERSIMMON, "--log-level", "WARNING", "serve", "--model-dir", str(models)],
        str(tmp_path / "serve.ready"), timeout=120)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin_port}") as http:
            answer = (await http.post("/v1/predict", json={"records": probe})).json()
            config = (await http.get("/v1/config")).json()
    finally:
        stop_processes([proc])
    assert proc.returncode == 0
    assert answer["version"] == summary["version_id"]
    np.testing.assert_allclose(answer["probabilities"], expected, atol=1e-6)
    assert config["model_dir"] == str(models)
