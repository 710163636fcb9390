"""Redis Streams source against a real redis-server: consumer groups, XACK only after the
worker's ack, a restart that re-reads its pending entries, XAUTOCLAIM of a dead consumer."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from services.common.errors import InvalidArgument, Unavailable
from services.loader.config import LoaderConfig
from services.loader.sources import make_source
from tests.conftest import eventually, free_port, swallowing_first_cancel
from tests.integration.loader.loader_support import consume_until, drain, until

pytestmark = pytest.mark.service


def line(i: int) -> bytes:
    return f"{i % 2}\t{i}\t{2 * i}\tc{i % 5}\tx{i}".encode()


@pytest.fixture
async def stream(redis_url):
    """(redis client, stream name, spec prefix) for a fresh stream; deleted afterwards."""
    client = aioredis.Redis.from_url(redis_url)
    name = f"events-{uuid.uuid4().hex[:8]}"
    yield client, name, f"redis://{urlsplit(redis_url).netloc}/{name}"
    await client.delete(name)
    await client.aclose()


async def add(client, name: str, rows: range, payload=line) -> None:
    pipe = client.pipeline()
    for i in rows:
        pipe.xadd(name, {"data": payload(i)})
    await pipe.execute()


async def pending(client, name: str, group: str) -> int:
    return int((await client.xpending(name, group))["pending"])


async def no_pending(client, name: str) -> bool:
    return await pending(client, name, "g") == 0


async def test_ack_after_worker_ack_and_restart_rereads_pending(stream, start_loader):
    client, name, prefix = stream
    await add(client, name, range(300))
    spec = f"{prefix}?group=g&consumer=c1&dense=2&sparse=2"
    common = dict(source=spec, batch_size=50, poll_records=100, dense_log1p=False)
    first = await start_loader(**common)
    acked = await drain(first.address, limit=2)           # 100 rows acknowledged
    await drain(first.address, limit=2, ack=False)         # 100 more delivered, not acked
    acked_rows = {int(v) for b in acked for v in b.dense[:, 0]}
    await eventually(lambda: first.source.acked == 100)   # one whole read chunk: XACKed
    assert await pending(client, name, "g") == 200
    await first.close()

    second = await start_loader(**common)
    _, seen = await consume_until(second.address, set(range(300)) - acked_rows)
    assert acked_rows | seen == set(range(300))
    assert not acked_rows & seen  # XACKed entries are not delivered again
    await until(lambda: no_pending(client, name))
    await eventually(lambda: second.source.offsets()[f"redis:{name}"]["in_flight"] == 0)


async def test_the_read_loop_stops_when_redis_py_swallows_its_cancel(stream):
    """A loader's close cancels the producer while XREADGROUP waits; redis-py may lose that
    cancel. The read loop still ends (before the fix the loader's close hung for ever)."""
    _, _, prefix = stream
    source = make_source(LoaderConfig(source=f"{prefix}?group=g&dense=2&sparse=2"))
    await source.start()
    entered = asyncio.Event()
    source._redis.xreadgroup = swallowing_first_cancel(source._redis.xreadgroup, entered)

    async def read() -> None:
        async for _ in source.blocks():
            pass

    task = asyncio.create_task(read())
    await asyncio.wait_for(entered.wait(), 5)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=5)  # waits without cancelling again
    if not done:
        task.cancel()  # a second cancel gets through
        await asyncio.wait([task], timeout=5)
    await source.close()
    assert done, "the read loop ran on past its cancel"


async def test_an_unreachable_redis_or_a_key_that_is_no_stream_is_a_clear_error(stream):
    """Not "internal error: ConnectionError" (the loader's first line to a person): Redis
    unreachable is Unavailable naming its address, a key of another type InvalidArgument;
    the key is left as it was."""
    client, name, prefix = stream
    dead = f"127.0.0.1:{free_port()}"
    source = make_source(LoaderConfig(source=f"redis://{dead}/{name}?group=g&dense=2&sparse=2"))
    with pytest.raises(Unavailable, match=f"cannot reach Redis at {dead}: "):
        await source.start()
    await client.set(name, "a string, not a stream")
    source = make_source(LoaderConfig(source=f"{prefix}?group=g&dense=2&sparse=2"))
    with pytest.raises(InvalidArgument, match=f"cannot read '{name}' at .* as a stream: "
                                              "WRONGTYPE"):
        await source.start()
    assert await client.get(name) == b"a string, not a stream"


async def test_a_failing_read_is_retried_with_backoff_until_redis_answers_again(stream, caplog):
    """A read error (a real one: the consumer group destroyed under the source, NOGROUP) is
    retried through the retry policy, with no deadline, for as long as it lasts; once the
    group is back the source reads on, every entry once."""
    client, name, prefix = stream
    source = make_source(LoaderConfig(source=f"{prefix}?group=g&dense=2&sparse=2",
                                      poll_timeout_ms=20))
    await source.start()
    await client.xgroup_destroy(name, "g")
    caplog.set_level(logging.WARNING, logger="services.common.retry")

    async def read(want: int) -> int:
        got = 0
        async for block in source.blocks():
            got += block.size
            if got >= want:
                return got
        return got

    task = asyncio.create_task(read(30))
    try:
        def failures() -> list[str]:
            return [r.getMessage() for r in caplog.records
                    if r.getMessage().startswith(f"redis read of {name} failed")]

        async def streak() -> bool:
            return len(failures()) >= 4

        await until(streak)
        assert not task.done()
        assert all("NOGROUP" in m and f"retry {i + 1} in " in m
                   for i, m in enumerate(failures()[:4]))
        await client.xgroup_create(name, "g", id="0")
        await add(client, name, range(30))
        assert await asyncio.wait_for(task, 10) == 30
    finally:
        task.cancel()
        await source.close()


async def test_entries_of_a_dead_consumer_are_claimed(stream, start_loader):
    client, name, prefix = stream
    await add(client, name, range(100))
    await client.xgroup_create(name, "g", id="0")
    taken = await client.xreadgroup("g", "dead", {name: ">"}, count=40)
    assert len(taken[0][1]) == 40  # delivered to a consumer that will never ack
    loader = await start_loader(source=f"{prefix}?group=g&consumer=alive&dense=2&sparse=2",
                                batch_size=20, claim_idle_ms=100, dense_log1p=False)
    _, seen = await consume_until(loader.address, set(range(100)))
    assert seen == set(range(100))
    assert loader.source.describe()["claimed"] == 40
    await until(lambda: no_pending(client, name))
    consumers = {c["name"]: c["pending"] for c in await client.xinfo_consumers(name, "g")}
    assert consumers.get(b"dead", consumers.get("dead")) == 0



async def test_bad_entries_are_dead_lettered_and_acknowledged(stream, start_loader, tmp_path):
    client, name, prefix = stream
    await add(client, name, range(10))
    await client.xadd(name, {"data": b"1\tnot-a-number\t2\tc\tx"})
    await client.xadd(name, {"other": b"no data field"})
    await add(client, name, range(10, 20))
    dead = tmp_path / "dead.jsonl"
    loader = await start_loader(source=f"{prefix}?group=g&dense=2&sparse=2", batch_size=5,
                                dead_letter=str(dead), dense_log1p=False)
    _, seen = await consume_until(loader.address, set(range(20)))
    assert seen == set(range(20))
    await until(lambda: no_pending(client, name))
    reasons = sorted(json.loads(x)["reason"] for x in dead.read_text().splitlines())
    assert reasons == ["dense_not_numeric", "empty_message"]
    assert loader.pipeline.stats()["malformed_total"] == 2
