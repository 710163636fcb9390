"""Restores fence pushes over the wire (a real PS service on a real port): the REST restore
answers the shard's new epoch, a retry of a push from before it (a partitioned worker's) is
refused with FAILED_PRECONDITION naming both epochs (and one that carries no epoch, an old
client's, too), the PSClient surfaces that instead of
retrying, and a client that connects (or re-syncs) afterwards learns the new epoch."""

from __future__ import annotations

import numpy as np
import pytest

from clients.admin_client import AdminClient
from clients.ps_client import PSClient
from services.common import messages as msg
from services.common.codecs import raw_array
from services.common.errors import InvalidArgument, StaleEpoch
from tests.integration.ps.conftest import shard_stream, start_cluster

IDS = np.arange(16, dtype=np.uint64)
GRADS = np.ones((IDS.size, 4), dtype=np.float32)


@pytest.fixture
async def shard(tmp_path):
    services = await start_cluster(1, tmp_path)
    yield services[0]
    await services[0].close()


def push_request(seq: int, epoch: int | None) -> msg.PushRequest:
    """A push as a partitioned worker sent it (its retry is this very message again)."""
    return msg.PushRequest(client=99, seq=seq, epoch=epoch, tables=["item"], counts=[IDS.size],
                           ids=raw_array(IDS), grads=[raw_array(GRADS)])


async def test_a_retry_from_before_a_restore_is_refused(shard):
    async with shard_stream(shard.address, "Push") as stream:
        async with AdminClient(shard.admin_url) as admin, PSClient([shard.address]) as ps:
            assert ps.epochs == [1]
            await ps.push("item", IDS, GRADS)
            await admin.checkpoint("c1")
            at_checkpoint = await ps.lookup("item", IDS)
            await stream.request(push_request(1, 1), msg.PushReply)  # applied, ack lost
            answer = await admin.restore("c1")
            assert answer.epoch == 2 and answer.rows["item"] == IDS.size
            with pytest.raises(StaleEpoch, match="epoch 1 .* epoch 2"):
                await stream.request(push_request(1, 1), msg.PushReply)  # the retry
            with pytest.raises(StaleEpoch, match="carries no epoch .* epoch 2"):
                await stream.request(push_request(2, None), msg.PushReply)  # an old client's
            with pytest.raises(StaleEpoch, match="epoch 1 .* epoch 2"):  # surfaced, not retried
                await ps.push("item", IDS, GRADS)
            np.testing.assert_array_equal(await ps.lookup("item", IDS), at_checkpoint)
            assert [s.epoch for s in await ps.stats()] == [2]
            assert (await admin.table("item")).epoch == 2
            assert await ps.resync() == [2]
            assert (await ps.push("item", IDS, GRADS)).applied == IDS.size
        async with PSClient([shard.address]) as fresh:  # a job restarting learns it
            assert fresh.epochs == [2]


async def test_a_bad_epoch_is_refused_naming_the_field_and_no_epoch_is_an_old_client(shard):
    async with shard_stream(shard.address, "Push") as stream, \
            PSClient([shard.address]) as ps:
        before = await ps.lookup("item", IDS)
        for bad in (-1, "2", 2**63):
            with pytest.raises(InvalidArgument, match="PushRequest.epoch"):
                await stream.request(push_request(1, bad), msg.PushReply)  # type: ignore[arg-type]
        np.testing.assert_array_equal(await ps.lookup("item", IDS), before)
        ack = await stream.request(push_request(1, None), msg.PushReply)  # epoch 0: none
        assert ack.applied == IDS.size


async def test_a_restart_from_the_same_checkpoint_gets_a_newer_epoch(tmp_path):
    """The epoch file in the checkpoint directory outlives the process: workers of the first
    restart (epoch 2) cannot push into the second (epoch 3), though both restored c1."""
    first = (await start_cluster(1, tmp_path))[0]
    try:
        await first.shard.checkpoint("c1")
    finally:
        await first.close()
    epochs = []
    for _ in range(2):
        service = (await start_cluster(1, tmp_path, restore="c1"))[0]
        try:
            async with PSClient([service.address]) as ps:
                epochs.extend(ps.epochs)
        finally:
            await service.close()
    assert epochs == [2, 3]
