"""PSClientProcess: a PSClient in a child process against real PS shards over gRPC."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from clients.ps_client import PSClient
from clients.ps_process import PSClientProcess
from services.common.errors import InvalidArgument, Unavailable
from services.common.sharding import ShardedIds
from services.local.processes import LocalPS
from tests.integration.ps.conftest import digest


def addresses(cluster):
    return [f"127.0.0.1:{s.grpc_port}" for s in cluster]


async def test_step_calls_give_what_the_in_process_client_gives(cluster):
    """The same pushes and lookups through the child and through a PSClient leave the same
    rows; byte counters and the child's CPU come back with the answers."""
    pushed, _ = ShardedIds.of_tables({"user": np.arange(100, 140, dtype=np.uint64),
                                      "item": np.arange(0, 9, dtype=np.uint64)}, 2)
    asked, _ = ShardedIds.of_tables({"user": np.arange(120, 170, dtype=np.uint64)}, 2)
    user_only, _ = ShardedIds.of_tables({"user": np.arange(100, 140, dtype=np.uint64)}, 2)
    grads = np.linspace(-1, 1, user_only.ids.size * 8, dtype=np.float32).reshape(-1, 8)
    async with PSClient(addresses(cluster), grads_codec="fp16") as direct, \
            PSClientProcess(addresses(cluster), grads_codec="fp16") as child:
        assert child.num_shards == 2
        np.testing.assert_array_equal(await child.lookup_sharded(asked),
                                      await direct.lookup_sharded(asked))
        ack = await child.push_sharded(user_only, grads)
        assert ack.applied == user_only.ids.size
        pushed_ack, rows = await child.push_then_lookup(user_only, grads, asked)
        assert pushed_ack.applied == user_only.ids.size
        np.testing.assert_array_equal(rows, await direct.lookup_sharded(asked))
        assert set(child.wire_bytes()) == {"lookup_out", "lookup_in", "push_out", "push_in"}
        assert all(n > 0 for n in child.wire_bytes().values())
        sent = child.codec_stats.get("grads_up", "fp16", "sent")
        assert sent.arrays == 4 and sent.wire_bytes < sent.raw_bytes  # 2 pushes x 2 shards
        assert await child.cpu_seconds() > 0
    assert pushed.num_shards == 2


async def test_bad_requests_get_their_error_back_and_change_nothing(cluster):
    layout, _ = ShardedIds.of_tables({"user": np.arange(0, 30, dtype=np.uint64)}, 2)
    async with PSClientProcess(addresses(cluster)) as child:
        rows = await child.lookup_sharded(layout)  # the rows exist from here on
        before = digest(cluster)
        with pytest.raises(InvalidArgument, match="grads"):
            await child.push_sharded(layout, np.ones((layout.ids.size, 3), np.float32))
        assert digest(cluster) == before
        np.testing.assert_array_equal(await child.lookup_sharded(layout), rows)  # still serving


async def test_many_requests_in_flight_are_matched_to_their_callers(cluster):
    layouts = [ShardedIds.of_tables({"user": np.arange(k, k + 20, dtype=np.uint64)}, 2)[0]
               for k in range(0, 200, 10)]
    async with PSClient(addresses(cluster)) as direct, \
            PSClientProcess(addresses(cluster)) as child:
        got = await asyncio.gather(*(child.lookup_sharded(layout) for layout in layouts))
        for layout, rows in zip(layouts, got, strict=True):
            np.testing.assert_array_equal(rows, await direct.lookup_sharded(layout))


async def test_unreachable_shards_and_closed_clients_are_unavailable(cluster):
    with pytest.raises(InvalidArgument, match="addresses or a registry"):
        PSClientProcess([])
    child = PSClientProcess(["127.0.0.1:1"], timeout=1.0)
    with pytest.raises(Unavailable):
        await child.connect()
    assert child.pid is None and child.returncode is not None  # the child was reaped
    layout, _ = ShardedIds.of_tables({"user": np.arange(5, dtype=np.uint64)}, 2)
    child = await PSClientProcess(addresses(cluster)).connect()
    assert child.pid is not None and child.returncode is None
    await child.close()
    assert child.pid is None and child.returncode == 0
    with pytest.raises(Unavailable, match="connect"):
        await child.lookup_sharded(layout)


async def test_child_and_local_shards_run_at_the_lower_priority_asked(cluster):
    """Background work beside a trainer yields its core: the PS-client child runs ``nice``
    steps lower (10 by default), and so do LocalPS shards started with ``nice``."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    for nice in (10, 3):
        async with PSClientProcess(addresses(cluster), nice=nice) as child:
            assert child.pid is not None
            assert os.getpriority(os.PRIO_PROCESS, child.pid) == min(own + nice, 19)
    with LocalPS(1, [{"name": "user", "dim": 4}], nice=4) as shards:
        assert os.getpriority(os.PRIO_PROCESS, shards.procs[0].pid) == min(own + 4, 19)


async def test_a_child_that_dies_fails_its_callers_instead_of_hanging(cluster):
    layout, _ = ShardedIds.of_tables({"user": np.arange(10, dtype=np.uint64)}, 2)
    async with PSClientProcess(addresses(cluster)) as child:
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(Unavailable):
            await asyncio.wait_for(child.lookup_sharded(layout), 30)
        with pytest.raises(Unavailable):  # and every later call, at once
            await child.lookup_sharded(layout)
