"""``persimmon export`` then ``persimmon serve`` as processes: job checkpoints of real PS
shards become served models whose answers are the trainer's; an incremental export made
while the server runs is picked up by it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from serve_training import (
    SPEC,
    batch,
    eventually,
    model_config,
    ps_shards,
    records,
    trainer_probabilities,
)

from services.cli import main
from services.local.processes import start_service, stop_processes
from services.worker.job_checkpoints import JobCheckpointer, dense_part
from services.worker.trainer import Trainer

PERSIMMON = [sys.executable, "-m", "services.cli"]


def export_args(tmp_path: Path, checkpoint: str, *extra: str) -> list[str]:
    return ["export", "--job-checkpoint", checkpoint, "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--out", str(tmp_path / "models"), "--features", str(tmp_path / "spec.json"),
            "--model-config", str(tmp_path / "model.yaml"), *extra]


def export(tmp_path: Path, checkpoint: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """``persimmon export`` as a process."""
    return subprocess.run([*PERSIMMON, *export_args(tmp_path, checkpoint, *extra)],
                          capture_output=True, text=True, timeout=120)


def export_here(tmp_path: Path, capsys: pytest.CaptureFixture[str], checkpoint: str,
                *extra: str) -> tuple[int, str, str]:
    """``persimmon export`` in this process (the same command; one interpreter start less):
    its exit code, stdout and stderr."""
    capsys.readouterr()
    code = main(export_args(tmp_path, checkpoint, *extra))
    out, err = capsys.readouterr()
    return code, out, err


async def test_export_and_serve_commands(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(3)
    root = tmp_path / "ckpt"
    (tmp_path / "spec.json").write_text(json.dumps(SPEC.to_dict()))
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(dataclasses.asdict(
        model_config("wide_deep"))))
    probe = records(rng, 10)
    proc = None
    async with ps_shards(root) as shards:
        checkpointer = JobCheckpointer(root, admin_urls=[s.admin_url for s in shards])
        async with Trainer(model=model_config("wide_deep"), mode="sync", lr=1e-2,
                           ps_addresses=[s.address for s in shards]) as trainer:
            async def train_and_checkpoint(steps: int, name: str) -> np.ndarray:
                await trainer.fit([batch(i, records(rng, 32), rng) for i in range(steps)])
                await checkpointer.checkpoint(trainer.step, name, parts={
                    "dense": dense_part(trainer.dense_state())})
                return await trainer_probabilities(trainer, probe)

            first = await train_and_checkpoint(3, "job-a")
            done = export(tmp_path, "job-a", "--row-dtype", "float32")
            assert done.returncode == 0, done.stderr
            v1 = json.loads(done.stdout)
            assert v1["step"] == 3 and v1["base"] is None
            code, _, err = export_here(tmp_path, capsys, "job-x")
            assert code == 2 and "job-x" in err  # one clear line
            try:
                proc, _, admin_port = start_service(
                    [*PERSIMMON, "--log-level", "WARNING", "serve", "--model-dir",
                     str(tmp_path / "models"), "--watch-interval-s", "0.1"],
                    str(tmp_path / "serve.ready"), timeout=120)
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin_port}",
                                             timeout=30) as http:
                    async def answer() -> dict[str, Any]:
                        response = await http.post("/v1/predict", json={"records": probe})
                        assert response.status_code == 200, response.text
                        return response.json()

                    got = await answer()
                    assert got["version"] == v1["version_id"]
                    np.testing.assert_allclose(got["probabilities"], first, atol=1e-6)
                    second = await train_and_checkpoint(2, "job-b")
                    code, out, err = export_here(tmp_path, capsys, "job-b", "--base", "latest")
                    assert code == 0, err
                    v2 = json.loads(out)
                    assert v2["step"] == 5 and v2["base"] == v1["version_id"]
                    assert v2["bytes"] < v1["bytes"]  # only the rows the 2 steps changed

                    async def swapped() -> bool:
                        return (await answer())["version"] == v2["version_id"]

                    await eventually(swapped)
                    np.testing.assert_allclose((await answer())["probabilities"], second,
                                               atol=1e-6)
                    assert np.abs(second - first).max() > 1e-4
                    config = (await http.get("/v1/config")).json()
                    assert config["model_dir"] == str(tmp_path / "models")
            finally:
                if proc is not None:
                    stop_processes([proc])
    assert proc is not None and proc.returncode == 0
