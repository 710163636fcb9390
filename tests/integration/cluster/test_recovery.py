"""Fault tolerance with real processes: a PS shard killed with SIGKILL is restarted by the
supervisor from the newest *complete* job checkpoint, the client pauses and retries instead of
failing, and no update acknowledged before that checkpoint is lost."""

from __future__ import annotations

import os
import signal
import uuid

import numpy as np
import pytest

from clients.ps_client import PSClient
from services.common.checkpoints import latest_complete, list_job_checkpoints, read_part
from services.common.errors import FailedPrecondition, StaleEpoch
from services.common.registry import discover_shards, open_registry
from services.common.sharding import shard_of
from services.local.processes import LocalPS
from services.ps.config import PSConfig
from services.ps.service import PSService
from services.worker.job_checkpoints import JobCheckpointer, load_dense_part
from tests.conftest import eventually

TABLES = [{"name": "emb", "dim": 4, "optimizer": {"kind": "sgd", "lr": 0.5}}]
IDS = np.arange(1, 401, dtype=np.uint64)


def grads(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(IDS.size, 4)).astype(np.float32)


async def test_killed_shard_restarts_from_latest_complete_checkpoint(tmp_path, redis_url):
    ckpt = tmp_path / "ckpt"
    registry_url = f"{redis_url}?job={uuid.uuid4().hex[:8]}"
    with LocalPS(2, TABLES, checkpoint_dir=str(ckpt), registry=registry_url,
                 supervise=True) as cluster:
        registry = open_registry(registry_url)
        checkpointer = JobCheckpointer(ckpt, registry=registry)
        async with PSClient.from_registry(registry_url, retry_s=120.0) as ps:
            assert ps.addresses == cluster.addresses
            await ps.push("emb", IDS, grads(1))                      # acknowledged
            first = await checkpointer.checkpoint(10, parts={"dense": b"dense@10"})
            at_checkpoint = await ps.lookup("emb", IDS)

            await ps.push("emb", IDS, grads(2))                      # after the checkpoint

            def failing_part() -> bytes:
                raise OSError("disk full")

            broken = JobCheckpointer(ckpt, registry=registry, parts={"offsets": failing_part})
            with pytest.raises(OSError):
                await broken.checkpoint(20)  # PS parts written, job part not: incomplete
            assert [m["checkpoint_id"] for m in list_job_checkpoints(ckpt)] == \
                [first["checkpoint_id"]]
            before_kill = await ps.lookup("emb", IDS)

            os.kill(cluster.procs[1].pid, signal.SIGKILL)
            after = await ps.lookup("emb", IDS)       # pauses while shard 1 is down

            restarts = cluster.supervisor.restarts
            await eventually(lambda: len(restarts) == 1)   # recorded once its admin is ready
            assert restarts[0].index == 1 and restarts[0].exit_code == -signal.SIGKILL
            mine = shard_of(IDS, 2) == 1
            np.testing.assert_array_equal(after[mine], at_checkpoint[mine])
            np.testing.assert_array_equal(after[~mine], before_kill[~mine])  # shard 0 untouched

            with pytest.raises(StaleEpoch):    # the restored shard 1 is in a new epoch
                await ps.push("emb", IDS, grads(3))
            assert (await ps.resync())[1] > 1
            ack = await ps.push("emb", IDS, grads(3))                # re-synced, it goes on
            assert ack.applied == IDS.size
            assert not np.array_equal(await ps.lookup("emb", IDS), after)
        shards = await discover_shards(registry, timeout_s=10)       # re-registered
        assert [m.address for m in shards] == cluster.addresses
        state = await registry.state()
        assert state["checkpoint"]["checkpoint_id"] == first["checkpoint_id"]
        assert state["step"] == 10
        await registry.close()
    assert read_part(ckpt, latest_complete(ckpt), "dense") == b"dense@10"


async def test_checkpointer_refuses_a_missing_shard_part(tmp_path):
    ckpt = tmp_path / "ckpt"
    shards = []
    for k in range(2):
        shards.append(PSService(PSConfig(shard_id=k, num_shards=2, grpc_port=0, admin_port=0,
                                         checkpoint_dir=str(ckpt))))
        await shards[-1].start()
    try:
        urls = [s.admin_url for s in shards]
        with pytest.raises(FailedPrecondition, match="incomplete"):
            await JobCheckpointer(ckpt, admin_urls=urls[:1]).checkpoint(5, checkpoint_id="half")
        assert latest_complete(ckpt) is None
        full = JobCheckpointer(ckpt, admin_urls=urls)
        manifest = await full.checkpoint(6, parts={"dense": _dense_bytes()})
        assert latest_complete(ckpt)["checkpoint_id"] == manifest["checkpoint_id"]
        state = load_dense_part(read_part(ckpt, manifest, "dense"))
        assert state["step"] == 6 and "weight" in state["model"]
    finally:
        for s in shards:
            await s.close()


def _dense_bytes() -> bytes:
    import torch

    from services.worker.job_checkpoints import dense_part

    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return dense_part({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                       "step": 6})


async def test_restore_job_without_a_checkpoint_dir_is_refused() -> None:
    from services.common.errors import ConfigError

    service = PSService(PSConfig(grpc_port=0, admin_port=0, restore="job"))
    with pytest.raises(ConfigError, match="--checkpoint-dir"):
        await service.start()
    await service.close()
