from __future__ import annotations

import asyncio
import os
import signal

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
