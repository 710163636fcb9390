"""The worker's replica of its head rows against real PS shards over gRPC: its updates go on
to the PS without waiting for each other's acknowledgements, in step order on each shard's
push stream, so the PS's copy of every head row is the replica's bit for bit (Adagrad's
result depends on the order in which a row's updates are applied)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from clients.ps_client import PSClient
from clients.ps_process import PSClientProcess
from services.common.config import from_dict
from services.common.sharding import ShardedIds
from services.loader.planted import SyntheticDataset
from services.ps.config import PSConfig
from services.ps.replica import HeadReplica
from services.ps.service import PSService
from services.ps.tables import TableConfig
from services.worker.config import ps_table_configs
from services.worker.models import ModelConfig
from services.worker.trainer import Trainer
from tests.unit.worker.test_replica import DATA, assert_ps_follows


async def start_shards() -> list[PSService]:
    tables = [from_dict(TableConfig, t, where="table")
              for t in ps_table_configs({f: 8 for f in DATA.sparse_names})]
    services = [PSService(PSConfig(shard_id=k, num_shards=2, grpc_port=0, admin_port=0,
                                   tables=tables)) for k in range(2)]
    for service in services:
        await service.start()
    return services


@pytest.mark.parametrize("client", ["PSClient", "PSClientProcess"])
async def test_the_ps_copy_of_the_head_rows_is_the_replicas_over_grpc(client: str) -> None:
    shards = await start_shards()
    addresses = [s.address for s in shards]
    replica = HeadReplica()
    rows = PSClient(addresses) if client == "PSClient" else PSClientProcess(addresses)
    try:
        async with rows:
            batches = list(SyntheticDataset(DATA).batches(128, 128 * 24))
            async with Trainer(model=ModelConfig(name="dlrm"), rows_client=rows, lr=3e-3,
                               seed=7, mode="hybrid", staleness=8, head_replica=replica) as t:
                summary = await t.fit(batches)
            assert t.pipeline.policy is not None and t.pipeline.policy.seeding is not None
            assert t.pipeline.head_count() > 0
            assert summary.replicated_rows == replica.num_rows > 0
        assert_ps_follows(replica, [s.shard for s in shards])
    finally:
        for service in shards:
            await service.close()


async def test_pushes_sent_without_waiting_are_applied_in_their_order() -> None:
    """The property the replica relies on: many Adagrad pushes of the same rows in flight at
    once on a client's stream are applied in the order they were sent (the same rows as
    the pushes one after another; a shard serving a stream's messages concurrently fails)."""
    table = DATA.sparse_names[0]
    layout, _ = ShardedIds.of_tables({table: np.arange(64, dtype=np.uint64)}, 2)
    grads = [np.random.default_rng(k).normal(size=(64, 8)).astype(np.float32) * (k + 1)
             for k in range(24)]
    got = []
    for pipelined in (True, False):
        shards = await start_shards()
        try:
            async with PSClient([s.address for s in shards]) as ps:
                if pipelined:
                    await asyncio.gather(*(ps.push_sharded(layout, g) for g in grads))
                else:
                    for g in grads:
                        await ps.push_sharded(layout, g)
                got.append(await ps.lookup_sharded(layout))
        finally:
            for service in shards:
                await service.close()
    np.testing.assert_array_equal(got[0], got[1])
