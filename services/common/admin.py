"""The admin REST surface every service shares: health, readiness, metrics, config, errors.

A service builds its app with :func:`make_admin_app` (adding its own ``/v1`` routes) and
serves it in-process with :class:`AdminServer`, which binds port 0 and reports the port.

Every app is guarded once, here (worker, loader, PS, serve and job apps alike): when a token
is configured, every request but ``/healthz``, ``/readyz`` and ``/metrics`` needs
``Authorization: Bearer <token>`` (401 missing, 403 wrong) before any route code runs (with
``admin_open_reads``, GET/HEAD/OPTIONS stay open too); a body over ``max_body_bytes`` is a 413
whether it declares its length or comes chunked: the guard counts the bytes as they arrive and
answers 413 (closing the connection) at the first chunk past the cap, without reading the
rest. The OpenAPI document lists those responses on every route that needs them.
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
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.auth import ServerSecurity, check_authorization, is_loopback
from services.common.errors import PersimmonError, ResourceExhausted

__all__ = ["AdminServer", "ErrorBody", "make_admin_app"]

log = logging.getLogger(__name__)

ErrorBody = {"description": "Error", "content": {"application/json": {"example": {
    "error": "NotFound", "message": "table 'user' does not exist"}}}}

MAX_BODY_BYTES = 16 * 1024 * 1024
_READS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})  # never need the token


def _error_response(exc: PersimmonError, *, close: bool = False) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.http_status == 401 else {}
    if close:  # the rest of the request is never read: the connection cannot be reused
        headers["Connection"] = "close"
    return JSONResponse(status_code=exc.http_status, headers=headers,
                        content={"error": type(exc).__name__, "message": exc.message})


class _BodyTooLarge(ResourceExhausted):
    """A body past the cap (declared or counted): answered 413 on a closed connection."""


class _Guard:
    """ASGI middleware: the bearer token, then the body read here, counted against the cap,
    and handed to the app whole (the app never reads past the cap)."""

    def __init__(self, app: ASGIApp, token: str | None, max_body_bytes: int,
                 open_reads: bool) -> None:
        self.app = app
        self.token = token
        self.max_body_bytes = max_body_bytes
        self.open_reads = open_reads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        try:
            self._authorize(scope, headers)
            body = await self._read_body(headers, receive)
        except PersimmonError as exc:
            await _error_response(exc, close=isinstance(exc, _BodyTooLarge))(
                scope, receive, send)
            return
        if body is not None:
            await self.app(scope, _replay(body, receive), send)

    def _authorize(self, scope: Scope, headers: dict[str, str]) -> None:
        if self.token is None or scope["path"] in OPEN_PATHS:
            return
        if self.open_reads and scope["method"] in _READS:
            return
        check_authorization(headers.get("authorization"), self.token)

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes | None:
        """The whole body (None: the client left); _BodyTooLarge as soon as the declared
        length or the bytes received pass the cap."""
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            raise _BodyTooLarge(f"request body of {length} bytes exceeds the limit of "
                                f"{self.max_body_bytes} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _BodyTooLarge(f"request body of more than {self.max_body_bytes} bytes "
                                    f"exceeds the limit of {self.max_body_bytes} bytes")
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` once, then what the connection sends (disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()
    return replay


class _Route(APIRoute):
    """Documents the guard's 401/403 on every guarded route, its 413 on every mutating one."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        guard: dict[int | str, Any] = {} if path in OPEN_PATHS else {401: ErrorBody,
                                                                     403: ErrorBody}
        if set(kwargs.get("methods") or ()) - _READS:
            guard[413] = ErrorBody
        kwargs["responses"] = {**guard, **(kwargs.get("responses") or {})}
        super().__init__(path, endpoint, **kwargs)


def make_admin_app(*, title: str, registry: CollectorRegistry, config: Callable[[], dict[str, Any]],
                   ready: Callable[[], bool], lifespan: Any = None,
                   security: ServerSecurity | None = None,
                   max_body_bytes: int = MAX_BODY_BYTES, open_reads: bool = False) -> FastAPI:
    """A guarded FastAPI app with /healthz, /readyz, /metrics, /v1/config and JSON error
    bodies; ``security`` None reads ``PERSIMMON_TOKEN``/``PERSIMMON_TOKEN_FILE`` and
    ``PERSIMMON_ADMIN_OPEN_READS``; ``open_reads`` opens the GETs as that does."""
    security = ServerSecurity.from_env() if security is None else security
    app = FastAPI(title=title, version="1", lifespan=lifespan)
    app.router.route_class = _Route
    app.add_middleware(_Guard, token=security.token, max_body_bytes=max_body_bytes,
                       open_reads=open_reads or security.admin_open_reads)

    @app.exception_handler(PersimmonError)
    async def _persimmon_error(_: Request, exc: PersimmonError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""),
                   "type": e.get("type", "value_error")} for e in exc.errors()]
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


_SHUTDOWN_GRACE_S = 5  # seconds (uvicorn takes an int); then close() cancels requests still running


class AdminServer:
    """Serve a FastAPI app with uvicorn inside the running event loop (HTTPS when
    ``security.tls`` is set; ``security`` None reads ``PERSIMMON_TLS_*``)."""

    def __init__(self, app: FastAPI, host: str, port: int, *,
                 security: ServerSecurity | None = None) -> None:
        security = ServerSecurity.from_env() if security is None else security
        if security.token is None and not is_loopback(host):
            log.warning("admin server on %s:%s accepts changes without a token (set "
                        "PERSIMMON_TOKEN)", host, port)
        tls = security.tls.uvicorn_options() if security.tls else {}
        self.scheme = "https" if tls else "http"
        self._server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
            timeout_graceful_shutdown=_SHUTDOWN_GRACE_S, **tls))
        # signals belong to the service (run_service), not to uvicorn
        self._server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
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
