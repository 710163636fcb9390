"""Job checkpoints while training (real PS shards, a real Trainer, real REST, a real SIGTERM):
periodic every N steps, one requested over REST, a final one at SIGTERM; then a whole-job
resume from the newest complete checkpoint."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import numpy as np
import pytest
import torch

from services.common.checkpoints import list_job_checkpoints
from services.loader.planted import SyntheticConfig, SyntheticDataset
from services.ps.config import PSConfig
from services.ps.service import PSService
from services.ps.tables import TableConfig
from services.worker.job_checkpoints import JobCheckpointer, resume_state
from services.worker.job_control import JobControl, fit_with_checkpoints
from services.worker.trainer import Trainer
from tests.conftest import eventually, free_port

FEATURES = SyntheticConfig().sparse_names


async def test_periodic_rest_and_sigterm_checkpoints_then_resume(tmp_path) -> None:
    root = tmp_path / "ckpt"
    shards = [PSService(PSConfig(shard_id=k, num_shards=2, grpc_port=0, admin_port=0,
                                 checkpoint_dir=str(root),
                                 tables=[TableConfig(name=f, dim=4) for f in FEATURES]))
              for k in range(2)]
    for s in shards:
        await s.start()
    batches = list(SyntheticDataset(SyntheticConfig()).batches(64, 64 * 40, "train"))
    admin_port = free_port()
    try:
        trainer = Trainer(model="dlrm", ps_addresses=[s.address for s in shards],
                          mode="sync", seed=3)
        checkpointer = JobCheckpointer(root, admin_urls=[s.admin_url for s in shards],
                                       every_steps=5)
        control = JobControl(checkpointer, trainer)

        async def operator() -> None:
            while control.step < 7:
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin_port}",
                                         timeout=60) as http:
                created = await http.post("/v1/job/checkpoints")
                assert created.status_code == 201, created.text
                listed = (await http.get("/v1/job/checkpoints")).json()
            assert created.json()["checkpoint_id"] in [m["checkpoint_id"] for m in listed]
            while control.step < 12:
                await asyncio.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)   # handled: stop at the next step

        async with trainer:
            task = asyncio.create_task(operator())
            summary, final = await fit_with_checkpoints(
                trainer, batches, control, admin_port=admin_port, host="127.0.0.1")
            await task
            expected = {k: v.clone() for k, v in trainer.module.state_dict().items()}

        assert summary is None                       # stopped, not finished
        assert 12 <= final["step"] < len(batches)
        steps = [m["step"] for m in list_job_checkpoints(root)]
        assert steps[0] == 5 and steps[-1] == final["step"] and len(steps) >= 3
        assert steps == sorted(set(steps))
        assert all(b - a <= 5 for a, b in zip(steps, steps[1:], strict=False))  # periodic

        state = resume_state(root)
        assert state["step"] == final["step"]
        resumed = Trainer(model="dlrm", ps_addresses=[s.address for s in shards], mode="sync",
                          seed=99)                   # another init: the state must replace it
        async with resumed:
            await resumed.build(batches[0])
            resumed.load_dense_state(state)
            assert resumed.step == final["step"]
            for name, value in resumed.module.state_dict().items():
                torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
            await resumed.fit(batches[resumed.step:resumed.step + 2])
            assert resumed.step == final["step"] + 2
    finally:
        for s in shards:
            await s.close()


async def _shards(root, n: int = 2) -> list[PSService]:
    shards = [PSService(PSConfig(shard_id=k, num_shards=n, grpc_port=0, admin_port=0,
                                 checkpoint_dir=str(root),
                                 tables=[TableConfig(name=f, dim=4) for f in FEATURES]))
              for k in range(n)]
    for s in shards:
        await s.start()
    return shards


async def test_a_job_checkpoint_is_a_cut_no_later_push_in_its_rows(tmp_path) -> None:
    """Sync mode is bit-reproducible, so the PS part of the checkpoint at step 10 must hold
    exactly the rows of a second run of the first 10 steps: no push of a later step (parts
    written in the background while training goes on), none of its own steps missing (pushes
    still in flight when the parts were written). Rows that later batches' lookups created
    (looked up ahead of the cut) may be there too, at their initial values."""
    from services.ps.checkpoint import read_checkpoint

    root = tmp_path / "ckpt"
    batches = list(SyntheticDataset(SyntheticConfig()).batches(64, 64 * 20, "train"))
    first = await _shards(root)
    try:
        trainer = Trainer(model="dlrm", ps_addresses=[s.address for s in first], mode="sync",
                          seed=3)
        control = JobControl(JobCheckpointer(root, admin_urls=[s.admin_url for s in first],
                                             every_steps=5), trainer)
        async with trainer:
            await fit_with_checkpoints(trainer, batches, control)
    finally:
        for s in first:
            await s.close()
    cut = next(m for m in list_job_checkpoints(root) if m["step"] == 10)
    again = await _shards(tmp_path / "again")
    try:
        async with Trainer(model="dlrm", ps_addresses=[s.address for s in again], mode="sync",
                           seed=3) as replay:
            await replay.fit(batches[:10])
            for k in range(2):
                saved = read_checkpoint(root, cut["checkpoint_id"], shard_id=k, num_shards=2)
                for name, (snap,) in saved.items():
                    table = again[k].shard.table(name)
                    rows, present = table.peek(snap.ids)
                    assert table.num_rows == present.sum(), name  # none missing in the cut
                    assert np.array_equal(rows[present], snap.rows[present]), name
                    # rows the lookups of the batches after the cut created: initial values
                    extra = snap.ids[~present]
                    assert extra.size <= 8, name
                    assert np.array_equal(snap.rows[~present], table.initial_rows(extra)), name
    finally:
        for s in again:
            await s.close()


async def test_a_cut_naming_an_epoch_a_shard_left_is_refused(tmp_path) -> None:
    """A job's checkpoint names the epochs its pushes were in: a shard restored since (its
    rows rolled back) refuses to write its part, so no cut mixes rolled-back rows with the
    dense state of a later step; the cut is never complete."""
    from clients.admin_client import AdminClient
    from services.common.errors import StaleEpoch

    root = tmp_path / "ckpt"
    (shard,) = await _shards(root, 1)
    try:
        before = JobCheckpointer(root, admin_urls=[shard.admin_url], epochs=[1])
        first = await before.checkpoint(5, parts={"dense": b"x"})
        async with AdminClient(shard.admin_url) as admin:
            await admin.restore(first["checkpoint_id"])  # the shard moves to epoch 2
        with pytest.raises(StaleEpoch, match="checkpoint of epoch 1 refused"):
            await before.checkpoint(6, "late-cut", parts={"dense": b"y"})
        assert [m["step"] for m in list_job_checkpoints(root)] == [5]
        assert not list(root.glob("late-cut/shard-*"))
        after = JobCheckpointer(root, admin_urls=[shard.admin_url], epochs=[2])
        assert (await after.checkpoint(7, parts={"dense": b"z"}))["step"] == 7
    finally:
        await shard.close()


async def test_nothing_to_resume(tmp_path) -> None:
    assert resume_state(tmp_path) is None


async def test_loader_offsets_part_reads_the_loaders_committed_offsets(tmp_path) -> None:
    from services.common.errors import NotFound
    from services.loader.config import LoaderConfig
    from services.loader.service import LoaderService
    from services.worker.job_checkpoints import loader_offsets_part

    loader = LoaderService(LoaderConfig(source="synthetic:1000", grpc_port=0, admin_port=0))
    await loader.start()
    try:
        async with httpx.AsyncClient(base_url=loader.admin_url) as http:
            async def read_everything() -> bool:  # then nothing moves: no worker acks
                offsets = (await http.get("/v1/offsets")).json()
                return bool(offsets) and all(o["read"] == 1000 for o in offsets.values())

            await eventually(read_everything)
            data = await loader_offsets_part(loader.admin_url)()
            assert json.loads(data) == (await http.get("/v1/offsets")).json()
        with pytest.raises(NotFound):
            await loader_offsets_part(loader.admin_url + "/nowhere")()
    finally:
        await loader.close()
