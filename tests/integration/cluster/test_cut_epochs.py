"""A job's cut is fenced by epochs (two real PS shards over gRPC and REST, two ranks of a
ConsistentCut): each shard's checkpoint call carries the epoch the ranks pushed in, so a
shard restored under the running job refuses its part instead of writing the restored rows
beside the other shard's part that holds the pushes the restore rolled back. A refused cut is
no checkpoint (nothing of it is listed complete) and the ranks go on; once they re-sync, the
next cut is taken."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from clients.admin_client import AdminClient
from clients.ps_client import PSClient
from services.common.checkpoints import latest_complete, list_job_checkpoints
from services.ps.config import PSConfig
from services.ps.service import PSService
from services.ps.tables import TableConfig
from services.worker.job_checkpoints import CUT_REFUSED, ConsistentCut, JobCheckpointer

IDS = np.arange(64, dtype=np.uint64)
GRADS = np.ones((IDS.size, 4), dtype=np.float32)


@pytest.fixture
async def shards(tmp_path):
    started = [PSService(PSConfig(shard_id=k, num_shards=2, grpc_port=0, admin_port=0,
                                  checkpoint_dir=str(tmp_path),
                                  tables=[TableConfig(name="t", dim=4)]))
               for k in range(2)]
    for s in started:
        await s.start()
    yield started
    for s in started:
        await s.close()


async def _drained() -> None:
    pass


def _ranks(root, client: PSClient, checkpointer: JobCheckpointer) -> list[ConsistentCut]:
    return [ConsistentCut(root, rank=r, world=2, run="r", timeout_s=30,
                          checkpointer=checkpointer if r == 0 else None,
                          epochs=lambda: client.epochs) for r in range(2)]


async def _cut(ranks: list[ConsistentCut], step: int) -> list[dict | None]:
    return list(await asyncio.gather(*(r.cut(step, drain=_drained, dense=b"d")
                                       for r in ranks)))


async def test_a_cut_reaching_a_shard_restored_under_the_job_is_refused(tmp_path, shards):
    root = tmp_path
    async with PSClient([s.address for s in shards]) as client:
        ranks = _ranks(root, client, JobCheckpointer(
            root, admin_urls=[s.admin_url for s in shards]))
        await client.push("t", IDS, GRADS)
        first, _ = await _cut(ranks, 1)
        await client.push("t", IDS, GRADS)  # the ranks push on in epoch 1 ...
        async with AdminClient(shards[1].admin_url) as admin:  # ... shard 1 rolls back
            assert (await admin.restore(first["checkpoint_id"])).epoch == 2

        assert await _cut(ranks, 2) == [None, None]  # refused on every rank, which go on
        refused = root / "cut-r-0000000002"
        assert "checkpoint of epoch 1 refused by shard 1, now in epoch 2" in json.loads(
            (refused / CUT_REFUSED).read_text())["error"]
        assert [m["step"] for m in list_job_checkpoints(root)] == [1]
        assert latest_complete(root)["checkpoint_id"] == first["checkpoint_id"]
        assert not (refused / "shard-1-of-2").exists()  # the restored rows: never written
        async with AdminClient(shards[0].admin_url) as admin:  # shard 0's part: no cut
            listed = {c.checkpoint_id: c for c in await admin.checkpoints()}
        assert listed[refused.name].shards == [0] and not listed[refused.name].complete

        assert await client.resync() == [1, 2]  # the ranks re-sync: the next cut is taken
        third, _ = await _cut(ranks, 3)
        assert third is not None and latest_complete(root)["step"] == 3


async def test_ranks_that_pushed_in_different_epochs_make_no_cut(tmp_path) -> None:
    """Checked before any shard is asked: the checkpointer's shard cannot be reached."""
    epochs = [[1, 2], [1, 1]]
    ranks = [ConsistentCut(tmp_path, rank=r, world=2, run="r", timeout_s=30,
                           checkpointer=JobCheckpointer(tmp_path, admin_urls=[
                               "http://127.0.0.1:9", "http://127.0.0.1:9"]) if r == 0 else None,
                           epochs=lambda r=r: epochs[r]) for r in range(2)]
    assert await _cut(ranks, 4) == [None, None]
    error = json.loads((tmp_path / "cut-r-0000000004" / CUT_REFUSED).read_text())["error"]
    assert "PS shard 1 in different epochs (rank 0 in 2, rank 1 in 1)" in error
    assert list_job_checkpoints(tmp_path) == []


async def test_the_rest_checkpoint_with_a_stale_epoch_is_a_412_naming_both(tmp_path, shards):
    shard = shards[0]
    async with AdminClient(shard.admin_url) as admin:
        await admin.checkpoint("c1", epoch=1)
        await admin.restore("c1")
    async with httpx.AsyncClient(base_url=shard.admin_url) as http:
        answer = await http.post("/v1/checkpoints", json={"id": "late", "epoch": 1})
        assert answer.status_code == 412
        assert answer.json()["error"] == "StaleEpoch"
        assert "checkpoint of epoch 1 refused by shard 0, now in epoch 2" in \
            answer.json()["message"] and "nothing written" in answer.json()["message"]
        for bad in (0, "2", True, 1.0):
            answer = await http.post("/v1/checkpoints", json={"id": "bad", "epoch": bad})
            assert answer.status_code == 400 and "epoch" in answer.json()["message"]
        assert (await http.post("/v1/checkpoints", json={"id": "now", "epoch": 2})
                ).status_code == 201
    assert not (tmp_path / "late").exists() and not (tmp_path / "bad").exists()
