"""The coordination registry against a real redis-server and in-process: registration, TTL
expiry of a dead member, discovery in shard order, job state, PS shards registering."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from services.common.errors import ConfigError, InvalidArgument, Unavailable
from services.common.registry import (
    Heartbeat,
    InProcessRegistry,
    Member,
    Registry,
    discover_shards,
    open_registry,
)
from services.ps.config import PSConfig
from services.ps.service import PSService
from tests.conftest import eventually, free_port, swallowing_first_cancel


@pytest.fixture(params=["redis", "memory"])
async def registry(request, redis_url) -> AsyncIterator[Registry]:
    job = uuid.uuid4().hex[:8]
    url = f"{redis_url}?job={job}" if request.param == "redis" else f"memory://{job}"
    reg = open_registry(url)
    yield reg
    await reg.close()


def shard(k: int, n: int = 3, port: int = 5000) -> Member:
    return Member(kind="ps", index=k, count=n, address=f"10.0.0.{k}:{port}",
                  admin_url=f"http://10.0.0.{k}:8081")


async def test_register_and_discover_in_shard_order(registry: Registry) -> None:
    for k in (2, 0, 1):
        await registry.register(shard(k), ttl_s=30)
    await registry.register(Member(kind="loader", index=0, address="loader:50060"), ttl_s=30)
    found = await discover_shards(registry, timeout_s=2)
    assert [m.address for m in found] == ["10.0.0.0:5000", "10.0.0.1:5000", "10.0.0.2:5000"]
    assert found[1] == shard(1)
    assert [m.address for m in await registry.members("loader")] == ["loader:50060"]
    assert await registry.members("worker") == []


async def test_dead_member_expires_and_reregisters(registry: Registry) -> None:
    await registry.register(shard(0, n=2), ttl_s=30)
    await registry.register(shard(1, n=2), ttl_s=0.3)     # stops heart-beating: killed
    remaining: list[Member] = []

    async def gone() -> bool:
        remaining[:] = await registry.members("ps")
        return [m.index for m in remaining] == [0]

    await eventually(gone)
    with pytest.raises(Unavailable, match="not all registered"):
        await discover_shards(registry, timeout_s=0.2)
    await registry.register(shard(1, n=2, port=6000), ttl_s=30)  # restarted elsewhere
    found = await discover_shards(registry, timeout_s=2)
    assert found[1].address == "10.0.0.1:6000"


async def test_heartbeat_keeps_alive_and_deregisters_on_close(registry: Registry) -> None:
    beat = Heartbeat(registry, shard(0, n=1), ttl_s=0.3)
    await beat.start()
    seen = []

    async def refreshed() -> bool:  # alive after several TTLs: refreshed by the heartbeat
        seen.append(len(await registry.members("ps")))
        return len(seen) >= 20

    await eventually(refreshed, interval=0.05)
    assert set(seen) == {1}
    await beat.close()
    assert await registry.members("ps") == []


async def test_job_state(registry: Registry) -> None:
    assert await registry.state() == {}
    manifest = {"checkpoint_id": "step-10", "step": 10, "parts": {"dense": {"bytes": 3}}}
    await registry.update_state(step=10, checkpoint=manifest, dense_version=1)
    await registry.update_state(step=12)
    state = await registry.state()
    assert state == {"step": 12, "checkpoint": manifest, "dense_version": 1}
    state["step"] = 99  # a copy: the registry is unchanged
    assert (await registry.state())["step"] == 12


async def test_bad_input(registry: Registry) -> None:
    with pytest.raises(InvalidArgument):
        Member(kind="ps", index=2, count=2, address="a:1")
    with pytest.raises(InvalidArgument):
        Member(kind="scheduler", index=0, address="a:1")
    with pytest.raises(InvalidArgument):
        await registry.register(shard(0), ttl_s=0)
    assert await registry.members("ps") == []
    with pytest.raises(ConfigError, match="redis://"):
        open_registry("http://localhost:6379")


async def test_redis_down_is_unavailable() -> None:
    reg = open_registry(f"redis://127.0.0.1:{free_port()}/0?job=x")
    with pytest.raises(Unavailable, match="registry"):
        await reg.members("ps")
    await reg.close()


async def test_in_process_ttl_uses_its_clock() -> None:
    now = [100.0]
    reg = InProcessRegistry(clock=lambda: now[0])
    await reg.register(shard(0, n=1), ttl_s=5)
    now[0] = 104.9
    assert len(await reg.members("ps")) == 1
    now[0] = 105.0
    assert await reg.members("ps") == []


async def test_ps_shards_register_and_leave(redis_url, tmp_path) -> None:
    url = f"{redis_url}?job={uuid.uuid4().hex[:8]}"
    services = []
    for k in (1, 0):
        service = PSService(PSConfig(shard_id=k, num_shards=2, grpc_port=0, admin_port=0,
                                     registry=url, heartbeat_ttl_s=5))
        await service.start()
        services.append(service)
    reg = open_registry(url)
    try:
        found = await discover_shards(reg, timeout_s=5)
        assert [m.address for m in found] == [services[1].address, services[0].address]
        assert found[0].admin_url == services[1].admin_url
        await services[0].close()  # shard 1 exits cleanly: deregistered at once
        assert [m.index for m in await reg.members("ps")] == [0]
    finally:
        for s in services:
            await s.close()
        await reg.close()



async def test_ps_client_process_finds_the_shards_in_the_registry(redis_url) -> None:
    import numpy as np

    from clients.ps_process import PSClientProcess
    from services.common.sharding import ShardedIds
    from services.ps.tables import TableConfig

    url = f"{redis_url}?job={uuid.uuid4().hex[:8]}"
    services = []
    try:
        for k in (0, 1):
            service = PSService(PSConfig(shard_id=k, num_shards=2, grpc_port=0, admin_port=0,
                                         registry=url, heartbeat_ttl_s=5,
                                         tables=[TableConfig(name="user", dim=4)]))
            await service.start()
            services.append(service)
        layout, _ = ShardedIds.of_tables({"user": np.arange(40, dtype=np.uint64)}, 2)
        async with PSClientProcess(registry=url) as child:
            assert child.addresses == [s.address for s in services]
            assert (await child.lookup_sharded(layout)).shape == (40, 4)
    finally:
        for s in services:
            await s.close()


async def test_loader_registers(redis_url) -> None:
    from services.loader.config import LoaderConfig
    from services.loader.service import LoaderService

    url = f"{redis_url}?job={uuid.uuid4().hex[:8]}"
    service = LoaderService(LoaderConfig(source="synthetic:1000", grpc_port=0, admin_port=0,
                                         registry=url, advertise="loader-0:50061"))
    reg = open_registry(url)
    await service.start()
    try:
        (member,) = await reg.members("loader")
        assert member.address == "loader-0:50061"
        assert member.admin_url == f"http://loader-0:{service.admin_port}"
    finally:
        await service.close()
    assert await reg.members("loader") == []
    await reg.close()


async def test_worker_finds_the_registered_loader() -> None:
    from services.worker.service import registered_loader

    url = f"memory://{uuid.uuid4().hex[:8]}"
    with pytest.raises(Unavailable, match="no loader"):
        await registered_loader(url, timeout_s=0.1)
    await open_registry(url).register(Member(kind="loader", index=0, address="ld:50061"), 30)
    assert await registered_loader(url) == "ld:50061"


async def test_heartbeat_closes_when_redis_py_swallows_its_cancel(redis_url) -> None:
    """The cancel of ``close`` lands while a refresh waits on Redis and the client loses it:
    the heartbeat still stops (before the fix ``close`` waited forever)."""
    registry = open_registry(f"{redis_url}?job={uuid.uuid4().hex[:8]}")
    beat = Heartbeat(registry, shard(0, n=1), ttl_s=0.3)
    await beat.start()
    entered = asyncio.Event()
    registry._redis.set = swallowing_first_cancel(registry._redis.set, entered)
    await asyncio.wait_for(entered.wait(), 5)
    closing = asyncio.create_task(beat.close())
    done, _ = await asyncio.wait([closing], timeout=5)  # waits without cancelling again
    if not done:
        closing.cancel()  # a second cancel of the beat gets through
    assert done, "the heartbeat ran on past its cancel"
    assert await registry.members("ps") == []
    await registry.close()
