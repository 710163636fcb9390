"""Credit-based dispatch in one event loop: routing, credits, back-pressure, re-delivery."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.common.errors import FailedPrecondition, InvalidArgument
from services.loader.dispatch import Dispatcher, Outgoing
from tests.conftest import eventually


def item(batch_id: int) -> Outgoing:
    return Outgoing(batch_id, f"b{batch_id}".encode(), 1, np.array([0]), np.array([1]))


async def take(stream, n: int) -> list[int | None]:
    out = []
    for _ in range(n):
        got = await asyncio.wait_for(anext(stream), 5)
        out.append(None if got is None else got.batch_id)
    return out


async def test_batches_go_to_rank_b_mod_w_within_credits():
    d = Dispatcher(prefetch=8, world_size=2)
    for b in range(8):
        await d.put(item(b))
    s0 = d.stream(0, await d.connect(0, 2, 2))
    s1 = d.stream(1, await d.connect(1, 2, 3))
    assert await take(s0, 2) == [0, 2]
    assert await take(s1, 3) == [1, 3, 5]
    blocked = asyncio.ensure_future(anext(s0))  # 2 unacked = 2 credits: must wait
    await asyncio.sleep(0)
    assert not blocked.done() and d.in_flight() == {0: 2, 1: 3}
    acked, unknown = await d.ack([2, 99, 1])
    assert [o.batch_id for o in acked] == [2, 1] and unknown == [99]
    assert (await asyncio.wait_for(blocked, 5)).batch_id == 4
    await s0.aclose()
    await s1.aclose()


async def test_producer_waits_when_a_rank_queue_is_full():
    d = Dispatcher(prefetch=2, world_size=1)

    async def produce():
        for b in range(6):
            await d.put(item(b))
        await d.finish()

    producer = asyncio.ensure_future(produce())
    await eventually(lambda: d.stats()["ranks"].get("0", {}).get("ready") == 2)
    assert not producer.done()
    stream = d.stream(0, await d.connect(0, 1, 4))
    got = await take(stream, 4)
    assert got == [0, 1, 2, 3]
    await d.ack([0, 1, 2, 3])
    assert await take(stream, 2) == [4, 5]
    await producer
    end = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    assert not end.done()  # the end marker comes only after every ack
    await d.ack([4, 5])
    assert await asyncio.wait_for(end, 5) is None


async def test_end_marker_waits_for_outstanding_acks():
    d = Dispatcher(prefetch=4, world_size=1)
    await d.put(item(0))
    await d.finish()
    stream = d.stream(0, await d.connect(0, 1, 1))
    assert await take(stream, 1) == [0]
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    assert not pending.done()
    await d.ack([0])
    assert await asyncio.wait_for(pending, 5) is None


async def test_reconnect_resends_unacked_batches_first_and_ends_the_old_stream():
    d = Dispatcher(prefetch=8, world_size=1)
    for b in range(5):
        await d.put(item(b))
    old = d.stream(0, await d.connect(0, 1, 3))
    assert await take(old, 3) == [0, 1, 2]
    await d.ack([1])
    new = d.stream(0, await d.connect(0, 1, 3))
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(old), 5)
    assert await take(new, 3) == [0, 2, 3]
    assert d.stats()["ranks"]["0"]["redelivered"] == 2
    # an ack for a batch re-queued but not yet re-sent is accepted
    again = d.stream(0, await d.connect(0, 1, 1))
    acked, _ = await d.ack([3])
    assert [o.batch_id for o in acked] == [3]
    assert await take(again, 1) == [0]
    await new.aclose()
    await again.aclose()


@pytest.mark.parametrize("args,error", [
    ((0, 0, 1), InvalidArgument), ((2, 2, 1), InvalidArgument), ((0, 2, 0), InvalidArgument),
    (("0", 2, 1), InvalidArgument), ((0, 2, True), InvalidArgument), ((0, 3, 1), FailedPrecondition),
])
async def test_bad_connect_arguments(args, error):
    d = Dispatcher(prefetch=1, world_size=2)
    with pytest.raises(error):
        await d.connect(*args)
    assert d.stats()["ranks"] == {}


async def test_world_size_is_learned_from_the_first_worker():
    d = Dispatcher(prefetch=1)
    put = asyncio.ensure_future(d.put(item(3)))
    await asyncio.sleep(0)
    assert not put.done()  # cannot route before the world size is known
    stream = d.stream(1, await d.connect(1, 2, 1))
    assert await take(stream, 1) == [3]
    await put
    with pytest.raises(FailedPrecondition, match="world_size 2"):
        await d.connect(0, 4, 1)
    await stream.aclose()
