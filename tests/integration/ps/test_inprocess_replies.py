"""The PS's shards embedded in a worker process (InProcessShards) answer ``tables()`` and
``stats()`` with the records a PS client gets over gRPC from shards in the same state
(issue 47: typed results, one shape)."""

from __future__ import annotations

import msgspec
import numpy as np

from clients.ps_client import PSClient
from services.common.messages import StatsReply, TableInfo
from services.common.sharding import place_ids
from services.ps.inprocess import InProcessShards
from tests.integration.ps.conftest import start_cluster

IDS = np.arange(1, 60, dtype=np.uint64)


def _plain(reply: StatsReply) -> StatsReply:
    return msgspec.structs.replace(reply, v=None, rid=None)  # the frame's envelope


async def test_embedded_shards_answer_tables_and_stats_as_the_ps_client_does() -> None:
    services = await start_cluster(2)
    # the tables as the processes hold them (they gave each a max_rows)
    embedded = InProcessShards([t.config for t in services[0].shard.tables.values()],
                               num_shards=2)
    try:
        async with PSClient([s.address for s in services]) as ps:
            await ps.lookup("user", IDS)
            await ps.push("user", IDS[:5], np.ones((5, 8), np.float32))
            layout, _ = place_ids([IDS], [0], ["user"], 2)
            await embedded.lookup_sharded(layout)
            pushed, _ = place_ids([IDS[:5]], [0], ["user"], 2)
            await embedded.push_sharded(pushed, np.ones((5, 8), np.float32))

            tables = await embedded.tables()
            assert all(type(t) is TableInfo for t in tables)
            assert tables == await ps.tables()
            assert embedded.dims == {"user": 8, "item": 4}
            stats = await embedded.stats()
            assert all(type(s) is StatsReply for s in stats)
            assert stats == [_plain(s) for s in await ps.stats()]
            assert sum(s.tables["user"].ids_pushed for s in stats) == 5
            assert [_plain(s) for s in await ps.stats("item")] == await embedded.stats("item")
    finally:
        for service in services:
            await service.close()
