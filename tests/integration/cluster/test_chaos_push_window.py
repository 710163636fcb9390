"""The chaos worker's pushes in flight (``bench.chaos_worker.PushWindow``) against real parts:
a PS shard on a real port reached through a TCP proxy that holds (a partition), and a loader
that is gone. A worker cut off from its job by the partition ends on the fence of its held
push (StaleEpoch), not on whichever failure came first (its ack to the killed loader)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.chaos_faults import PUSH_BYTES
from bench.chaos_job import TcpProxy
from bench.chaos_worker import PushWindow
from clients.admin_client import AdminClient
from clients.loader_client import LoaderClient
from clients.ps_client import PSClient
from services.common.errors import StaleEpoch, Unavailable
from services.loader.config import LoaderConfig
from services.loader.service import LoaderService
from tests.conftest import eventually
from tests.integration.ps.conftest import start_cluster

IDS = np.arange(16, dtype=np.uint64)
GRADS = np.ones((IDS.size, 4), dtype=np.float32)


async def _gone_loader() -> str:
    """The address of a loader that was started and stopped (as a job restart kills it)."""
    loader = LoaderService(LoaderConfig(source="synthetic:100", grpc_port=0, admin_port=0))
    await loader.start()
    address = loader.address
    await loader.close()
    return address


async def test_a_partitioned_worker_whose_ack_fails_first_ends_on_its_refused_push(tmp_path):
    (shard,) = await start_cluster(1, tmp_path)
    proxy = TcpProxy(shard.address)
    try:
        async with AdminClient(shard.admin_url) as admin, \
                PSClient([shard.address]) as direct, \
                PSClient([proxy.address], retry_s=30) as partitioned, \
                LoaderClient(await _gone_loader()) as loader:
            await direct.push("item", IDS, GRADS)
            await admin.checkpoint("c1")
            at_cut = await direct.lookup("item", IDS, read_only=True)
            window = PushWindow(2)
            proxy.hold()
            window.add(partitioned.push("item", IDS, GRADS))
            await eventually(lambda: proxy.held_bytes > PUSH_BYTES)  # the push is held
            window.add(loader.ack(1))  # a pushed batch's ack: its loader is gone
            with pytest.raises(Unavailable) as first:
                await window.room()  # the ack failed first
            await admin.restore("c1")  # the job went on without it
            assert await direct.resync() == [2]
            proxy.heal()
            ended = await window.settle(first.value)
            assert isinstance(ended, StaleEpoch), ended  # the held push reached, refused
            np.testing.assert_array_equal(await direct.lookup("item", IDS, read_only=True),
                                          at_cut)
    finally:
        proxy.close()
        await shard.close()
