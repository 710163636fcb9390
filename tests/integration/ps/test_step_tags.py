"""Step tags over real gRPC: the shards count the pushes of every worker a lookup missed, and
report them in Stats; a malformed tag is refused and changes nothing."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from clients.ps_client import PSClient
from services.common.codecs import raw_array
from services.common.errors import InvalidArgument
from services.common.messages import PushReply
from services.common.sharding import ShardedIds, shard_of
from tests.integration.ps.conftest import digest, shard_stream

IDS = np.arange(40, dtype=np.uint64)  # ids of both shards


def tagged(worker: int, step: int, workers: int = 2) -> ShardedIds:
    layout, _ = ShardedIds.of_tables({"user": IDS}, 2)
    return replace(layout, tag=(worker, step, workers))


async def test_each_shard_counts_the_earlier_pushes_of_every_worker_a_lookup_missed(cluster):
    grads = np.zeros((IDS.size, 8), np.float32)
    async with PSClient([s.address for s in cluster]) as ps:
        for worker, step in ((0, 0), (1, 0), (0, 1)):
            await ps.push_sharded(tagged(worker, step), grads)
        await ps.lookup_sharded(tagged(1, 2))  # misses worker 1's push of step 1
        await ps.lookup_sharded(ShardedIds.of_tables({"user": IDS}, 2)[0])  # untagged
        await ps.push_then_lookup(tagged(1, 1), grads, tagged(0, 2))  # sees every push
        stats = await ps.stats("user")
    for shard in stats:
        s = shard.tables["user"]
        assert s.tagged_lookups == 2
        assert (s.global_staleness_max, s.own_staleness_max) == (1, 1)
        assert s.global_staleness_mean == pytest.approx(0.5)
        assert (s.total_staleness_max, s.total_staleness_mean) == (1, pytest.approx(0.5))


@pytest.mark.parametrize("tag", [[0, 1], [2, 0, 2], [0, -1, 2], [0, 1, 2, 3]])
async def test_a_malformed_tag_is_refused_and_changes_nothing(cluster, tag):
    mine = IDS[shard_of(IDS, 2) == 0]
    async with PSClient([s.address for s in cluster]) as ps:
        await ps.lookup("user", mine)
    state = digest(cluster)
    body = {"client": 7, "seq": 1, "tables": ["user"], "counts": [mine.size],
            "ids": raw_array(mine), "grads": [raw_array(np.ones((mine.size, 8), np.float32))],
            "tag": tag}

    class Raw:
        def to_wire(self):
            return body

    async with shard_stream(cluster[0].address, "Push") as stream:
        with pytest.raises(InvalidArgument, match="tag"):
            await stream.request(Raw(), PushReply)
    assert digest(cluster) == state
