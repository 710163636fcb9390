"""Async service lifecycle: explicit start/close, owned background tasks, signal handling."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["AsyncService", "ServingService", "cancel_and_wait", "freeze_startup_objects",
           "raise_if_cancelled", "run_service", "serve_from_flags", "settle"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def settle(future: asyncio.Future[T], task: asyncio.Future[T]) -> None:
    """Give ``future`` the outcome of the finished ``task`` (its result, its exception or its
    cancellation), unless ``future`` is already done."""
    if future.done():
        return
    if task.cancelled():
        future.cancel()
    elif (exc := task.exception()) is not None:
        future.set_exception(exc)
    else:
        future.set_result(task.result())


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` if the current task was asked to stop and a library swallowed
    the request: redis-py's asyncio client (8.x) can return a command's reply when a cancel
    lands just as the reply arrives, leaving ``cancelling()`` set and the task running on.
    Call it after such awaits in a loop that must end when its task is cancelled."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has finished unwinding."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class AsyncService:
    """Base for every long-running service.

    Subclasses override :meth:`on_start` and :meth:`on_close`; background work is started
    with :meth:`spawn`, which owns the task: :meth:`close` cancels and awaits every one.
    """

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._started = False
        self._closed = asyncio.Event()

    async def on_start(self) -> None:  # pragma: no cover - overridden
        """Bind servers and open resources."""

    async def on_close(self) -> None:  # pragma: no cover - overridden
        """Stop servers and release resources (tasks are already cancelled)."""

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a task owned by this service; a crash is logged, not swallowed."""
        if name in self._tasks and not self._tasks[name].done():
            raise RuntimeError(f"task {name!r} is already running")
        task = asyncio.create_task(coro, name=name)
        self._tasks[name] = task
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    async def start(self) -> None:
        if self._started:
            return
        await self.on_start()
        self._started = True

    async def close(self) -> None:
        """Cancel and await owned tasks, then :meth:`on_close`. Safe to call twice."""
        if self._closed.is_set():
            return
        self._closed.set()
        tasks = [t for t in self._tasks.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._started:
            await self.on_close()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def __aenter__(self) -> AsyncService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ServingService(AsyncService):
    """A service listening on a gRPC and an admin port. ``config`` has ``host``,
    ``advertise``, ``grpc_port`` and ``admin_port``; ``grpc_port``/``admin_port`` here hold
    the bound ports once started (port 0 in the config: any free one)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.grpc_port: int = config.grpc_port
        self.admin_port: int = config.admin_port
        self._admin: Any = None  # the AdminServer once started (its scheme: http or https)

    @property
    def address(self) -> str:
        """The ``host:port`` others dial for gRPC."""
        return self.config.advertise or f"{self.config.host}:{self.grpc_port}"

    @property
    def admin_url(self) -> str:
        host = self.config.advertise.rpartition(":")[0] if self.config.advertise \
            else self.config.host
        scheme = self._admin.scheme if self._admin is not None else "http"
        return f"{scheme}://{host}:{self.admin_port}"


def freeze_startup_objects() -> None:
    """Move every object alive now (imported modules, compiled kernels, servers, apps) to
    the collector's permanent generation: a server that allocates many short-lived objects
    per message otherwise walks all of them again at every full collection."""
    gc.collect()
    gc.freeze()


def write_ready_file(path: str, service: AsyncService) -> None:
    """Write the bound ports of a started service as JSON, atomically (a launcher that gave
    port 0 polls for this file instead of racing for a port it picked itself)."""
    ports = {name: getattr(service, name) for name in ("grpc_port", "admin_port")
             if hasattr(service, name)}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(ports, f)
    os.replace(tmp, path)


async def run_service(service: AsyncService, *, ready_file: str | None = None) -> None:
    """Start ``service``, run until SIGTERM/SIGINT (or until it closes itself), then close it.

    ``ready_file``: where to write the bound ports once the service serves."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
        freeze_startup_objects()
        if ready_file:
            write_ready_file(ready_file, service)
        waiter = asyncio.create_task(service.wait_closed())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for t in (waiter, stopper):
            t.cancel()
        log.info("shutting down")
    finally:
        await service.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def serve_from_flags(args: Any, name: str, config: Any,
                     make_service: Callable[[Any], AsyncService]) -> int:
    """The body of ``persimmon ps`` / ``persimmon loader``: print the effective ``config``,
    stop there with ``--check-config``, else run the service until SIGTERM."""
    from services.common.config import print_config

    print_config(name, config)
    if args.check_config:
        return 0
    asyncio.run(run_service(make_service(config), ready_file=args.ready_file))
    return 0
