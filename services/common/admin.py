"""The admin REST surface every service shares: health, readiness, metrics, config, errors.

A service builds its app with :func:`make_admin_app` (adding its own ``/v1`` routes) and
serves it in-process with :class:`AdminServer`, which binds port 0 and reports the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from services.common.errors import PersimmonError

__all__ = ["AdminServer", "ErrorBody", "make_admin_app"]

log = logging.getLogger(__name__)

ErrorBody = {"description": "Error", "content": {"application/json": {"example": {
    "error": "NotFound", "message": "table 'user' does not exist"}}}}


def make_admin_app(*, title: str, registry: CollectorRegistry, config: Callable[[], dict[str, Any]],
                   ready: Callable[[], bool], lifespan: Any = None) -> FastAPI:
    """A FastAPI app with /healthz, /readyz, /metrics, /v1/config and JSON error bodies."""
    app = FastAPI(title=title, version="1", lifespan=lifespan)

    @app.exception_handler(PersimmonError)
    async def _persimmon_error(_: Request, exc: PersimmonError) -> JSONResponse:
        return JSONResponse(status_code=exc.http_status,
                            content={"error": type(exc).__name__, "message": exc.message})

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()]
        return JSONResponse(status_code=422, content={
            "error": "InvalidArgument", "message": "request body or parameters are invalid",
            "detail": errors})

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], responses={503: ErrorBody})
    async def readyz() -> JSONResponse:
        """Readiness: the service can take traffic."""
        ok = ready()
        return JSONResponse(status_code=200 if ok else 503,
                            content={"status": "ready" if ok else "not ready"})

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        """Prometheus text exposition."""
        return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/config", tags=["config"])
    async def get_config() -> dict[str, Any]:
        """The effective configuration of this process."""
        return config()

    return app


class AdminServer:
    """Serve a FastAPI app with uvicorn inside the running event loop."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self._server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, lifespan="on"))
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._task: asyncio.Task[None] | None = None
        self.port = port

    async def start(self) -> int:
        """Start serving; returns the bound port once the socket is listening."""
        self._task = asyncio.create_task(self._server.serve(), name="admin-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # re-raise the bind error
                raise OSError("admin server stopped during start-up")
            await asyncio.sleep(0.01)
        sockets = [s for srv in self._server.servers for s in srv.sockets]
        self.port = sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
