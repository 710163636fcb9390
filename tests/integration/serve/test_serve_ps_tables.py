"""A version that keeps a table on the live PS (``persimmon export --ps-tables``): served
answers read that table's rows there, read-only (training goes on and the answers follow it,
no row is created by serving), and copy the other tables; without ``--ps`` the version is
refused."""

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
    batch,
    model_config,
    ps_shards,
    read_shards,
    records,
    server,
    trainer_probabilities,
)

from clients.ps_client import PSClient
from services.common.errors import ConfigError, InvalidArgument
from services.serve.__main__ import export_from_flags
from services.serve.config import ExportConfig, ServeConfig
from services.worker.job_checkpoints import JobCheckpointer, dense_part
from services.worker.trainer import Trainer


async def test_a_table_on_the_live_ps_is_read_there_and_follows_training(
        tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    root, models = tmp_path / "ckpt", tmp_path / "models"
    (tmp_path / "spec.json").write_text(json.dumps(SPEC.to_dict()))
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(dataclasses.asdict(model_config("dlrm"))))

    def export(**settings: str) -> dict:
        return export_from_flags(ExportConfig(
            job_checkpoint="latest", checkpoint_dir=str(root), out=str(models),
            features=str(tmp_path / "spec.json"), model_config=str(tmp_path / "model.yaml"),
            **settings), read_shards)

    async with ps_shards(root) as shards:
        addresses = [s.address for s in shards]
        async with Trainer(model=model_config("dlrm"), ps_addresses=addresses, mode="sync",
                           lr=1e-2, seed=0) as trainer:
            await trainer.fit([batch(i, records(rng, 32), rng) for i in range(4)])
            await JobCheckpointer(root, admin_urls=[s.admin_url for s in shards]).checkpoint(
                trainer.step, "job-1", parts={"dense": dense_part(trainer.dense_state())})
            summary = export(ps_tables="C1")
            assert summary["tables"]["C1"]["rows"] == 0 and summary["tables"]["C2"]["rows"] > 0
            probe = [{**r, "C1": f"new{i}" if i % 2 else r["C1"]}  # half never trained
                     for i, r in enumerate(records(rng, 40))]
            c1_rows = sum(s.shard.table("C1").num_rows for s in shards)

            async with server(models) as service:  # no --ps: refused, nothing served
                assert service.versions.active is None
                assert "--ps" in service.versions.refused[summary["version_id"]]

            async with server(models, ps=",".join(addresses)) as service, \
                    httpx.AsyncClient(base_url=service.url) as http:
                async def answer() -> np.ndarray:
                    reply = await http.post("/v1/predict", json={"records": probe})
                    assert reply.status_code == 200, reply.text
                    return np.array(reply.json()["probabilities"])

                served = await answer()
                assert sum(s.shard.table("C1").num_rows for s in shards) == c1_rows  # read-only
                at_export = await trainer_probabilities(trainer, probe)
                np.testing.assert_allclose(served, at_export, atol=1e-6)
                # training moves C1 on the PS only: the answers follow it
                async with PSClient(addresses) as ps:
                    ids = SPEC.records(probe).sparse["C1"].values
                    for _ in range(10):
                        await ps.push("C1", ids, np.ones((ids.size, 8), np.float32))
                now = await trainer_probabilities(trainer, probe)
                assert np.abs(now - at_export).max() > 1e-3
                np.testing.assert_allclose(await answer(), now, atol=1e-6)

            with pytest.raises(InvalidArgument, match="reads tables \\['C1'\\] from the PS"):
                export(ps_tables="", base="latest")  # a base must keep the same PS tables
            with pytest.raises(InvalidArgument, match="PS tables \\['nope'\\]"):
                export(ps_tables="nope")


@pytest.mark.parametrize("ps", ["", "host", "host:port", "a:1,", ":9000", "h:70000"])
def test_bad_ps_addresses_are_a_config_error(ps: str) -> None:
    with pytest.raises(ConfigError, match="host:port"):
        ServeConfig(model_dir="m", ps=ps)
