from __future__ import annotations

import asyncio
import os
import signal

from fastapi import FastAPI

from services.common import admin
from services.common.lifecycle import AsyncService, run_service


class Ticker(AsyncService):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    async def on_start(self) -> None:
        self.events.append("start")
        self.spawn(self._tick(), "tick")

    async def _tick(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self.events.append("tick cancelled")

    async def on_close(self) -> None:
        self.events.append("closed")


async def test_close_cancels_and_awaits_owned_tasks():
    service = Ticker()
    async with service:
        await asyncio.sleep(0)
    assert service.events == ["start", "tick cancelled", "closed"]
    await service.close()  # idempotent
    assert service.events.count("closed") == 1


async def test_sigterm_closes_the_service():
    service = Ticker()
    runner = asyncio.create_task(run_service(service))
    while "start" not in service.events:
        await asyncio.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(runner, 10)
    assert service.events[-1] == "closed"


async def test_admin_server_close_cancels_a_request_that_never_ends(monkeypatch):
    """close() gives running requests the shutdown grace, then cancels them: a hung
    request cannot keep a service from closing."""
    monkeypatch.setattr(admin, "_SHUTDOWN_GRACE_S", 0.5)
    app = FastAPI()
    started, cancelled = asyncio.Event(), asyncio.Event()

    @app.get("/hang")
    async def hang() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    server = admin.AdminServer(app, "127.0.0.1", 0)
    port = await server.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /hang HTTP/1.1\r\nHost: test\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.wait_for(server.close(), 20)
    assert cancelled.is_set()
    writer.close()


async def test_raise_if_cancelled_ends_a_loop_whose_library_swallowed_the_cancel():
    """A call that swallows its task's cancel (as redis-py's asyncio client can) leaves the
    loop running; checking ``cancelling()`` after it ends the loop."""
    from services.common.lifecycle import raise_if_cancelled

    swallowed = 0

    async def swallowing_call() -> None:
        nonlocal swallowed
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if swallowed:  # only the first cancel is lost
                raise
            swallowed += 1  # the library returns normally: the cancel is lost

    async def loop(check: bool) -> int:
        rounds = 0
        while True:
            await swallowing_call()
            rounds += 1
            if check:
                raise_if_cancelled()

    for check in (False, True):
        swallowed = 0
        task = asyncio.create_task(loop(check))
        await asyncio.sleep(0.005)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=0.5)
        assert bool(done) is check  # without the check the loop runs on past its cancel
        assert swallowed == 1
        if not done:
            task.cancel()  # a second cancel goes through
            await asyncio.wait([task], timeout=0.5)
            assert task.done()
    raise_if_cancelled()  # a task nobody cancelled runs on
