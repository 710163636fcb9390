"""gRPC plumbing shared by every service: generic handlers over msgpack, no protoc.

Handlers receive and return *bytes*; the servicer decodes with
:func:`services.common.wire.decode_message` itself so that a malformed body becomes a
clear INVALID_ARGUMENT (a deserializer exception would surface as INTERNAL).

Every server made by :func:`make_server` is guarded by one interceptor: the bearer token
when one is configured (UNAUTHENTICATED / PERMISSION_DENIED before any handler runs), a
limit of concurrent streams per client host and a smaller one per client id (the
``persimmon-client`` call metadata Persimmon's clients send; RESOURCE_EXHAUSTED), and a
deadline on unary calls (DEADLINE_EXCEEDED). Clients open channels with :func:`open_channel`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from services.common.auth import (
    ClientSecurity,
    ServerSecurity,
    check_authorization,
    is_loopback,
)
from services.common.errors import (
    DeadlineExceeded,
    PersimmonError,
    ResourceExhausted,
    error_from_grpc,
)
from services.common.wire import MAX_MESSAGE_BYTES

__all__ = [
    "CLIENT_ID_KEY",
    "abort_with",
    "channel_options",
    "generic_service",
    "make_server",
    "open_channel",
    "raise_for_rpc_error",
    "unary_handler",
]

log = logging.getLogger(__name__)

MAX_STREAMS_PER_CLIENT = 256
MAX_STREAMS_PER_CLIENT_ID = 64
CLIENT_ID_KEY = "persimmon-client"  # call metadata: the client's id, for its stream limit
MAX_UNARY_S = 60.0


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def generic_service(name: str, handlers: dict[str, grpc.RpcMethodHandler]) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(name, handlers)


async def abort_with(context: grpc.aio.ServicerContext, exc: PersimmonError) -> None:
    """End the call with the status that ``exc`` maps to."""
    await context.abort(exc.grpc_code, exc.message)


def unary_handler(fn: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """A unary-unary handler (bytes → bytes) whose PersimmonErrors become gRPC statuses."""
    @functools.wraps(fn)
    async def wrapped(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return await fn(request, context)
        except PersimmonError as exc:
            await abort_with(context, exc)
            raise  # unreachable: abort raises
    return grpc.unary_unary_rpc_method_handler(wrapped)


def make_server(handlers: list[grpc.GenericRpcHandler], host: str, port: int,
                max_message_bytes: int = MAX_MESSAGE_BYTES, *,
                security: ServerSecurity | None = None,
                max_streams_per_client: int = MAX_STREAMS_PER_CLIENT,
                max_streams_per_client_id: int = MAX_STREAMS_PER_CLIENT_ID,
                max_unary_s: float = MAX_UNARY_S) -> tuple[grpc.aio.Server, int]:
    """A guarded grpc.aio server bound to ``host:port`` (0 picks a free port); returns it and
    the port. ``security`` None reads ``PERSIMMON_TOKEN``/``PERSIMMON_TLS_*``."""
    security = ServerSecurity.from_env() if security is None else security
    guard = _Guard(security.token, (max_streams_per_client, max_streams_per_client_id),
                   max_unary_s)
    server = grpc.aio.server(options=channel_options(max_message_bytes), interceptors=[guard])
    server.add_generic_rpc_handlers(handlers)
    address = f"{host}:{port}"
    if security.tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, security.tls.grpc_credentials())
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    if security.token is None and not is_loopback(host):
        log.warning("gRPC server on %s accepts calls without a token (set PERSIMMON_TOKEN)",
                    address)
    return server, bound


def open_channel(address: str, security: ClientSecurity | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.aio.Channel:
    """A channel to ``address``: TLS when ``security.tls`` is set (tokens go as call metadata,
    see :meth:`ClientSecurity.metadata`)."""
    options = channel_options(max_message_bytes)
    if security is None or security.tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, security.tls.grpc_credentials(), options=options)


def _client_host(peer: str) -> str:
    """``ipv4:1.2.3.4:5678`` → ``1.2.3.4``; ``ipv6:[::1]:5678`` → ``::1``."""
    address = peer.split(":", 1)[1] if ":" in peer else peer
    return (address.rsplit(":", 1)[0] if ":" in address else address).strip("[]")


_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _behavior(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    return getattr(handler, _FACTORIES[handler.request_streaming, handler.response_streaming][0])


def _replace(handler: grpc.RpcMethodHandler, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    factory = _FACTORIES[handler.request_streaming, handler.response_streaming][1]
    return factory(behavior, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


class _Guard(grpc.aio.ServerInterceptor):
    """Token check, stream limits per client host and per client id, and unary deadline
    around every handler."""

    def __init__(self, token: str | None, max_streams: tuple[int, int],
                 max_unary_s: float) -> None:
        if min(max_streams) < 1 or max_unary_s <= 0:
            raise ValueError("max_streams_per_client and max_streams_per_client_id must be "
                             ">= 1 and max_unary_s > 0")
        self._token = token
        self._max_streams, self._max_streams_per_id = max_streams
        self._max_unary_s = max_unary_s
        self._open: Counter[str] = Counter()  # per host ("host") and per id ("id:...")

    async def intercept_service(self, continuation: Callable[..., Any],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        if self._token is not None:
            header = next((v for k, v in details.invocation_metadata or ()
                           if k == "authorization"), None)
            try:
                check_authorization(header if isinstance(header, str) else None, self._token)
            except PersimmonError as exc:
                return _replace(handler, _rejecting(exc))
        behavior = _behavior(handler)
        if handler.request_streaming or handler.response_streaming:
            return _replace(handler, self._limited(behavior))
        return _replace(handler, self._bounded(behavior))

    async def _enter(self, context: grpc.aio.ServicerContext) -> list[str]:
        """The counters this stream holds (its host's, its client id's), or an abort."""
        host = _client_host(context.peer())
        client_id = next((v for k, v in context.invocation_metadata() or ()
                          if k == CLIENT_ID_KEY and isinstance(v, str)), None)
        keys = [host]
        if self._open[host] >= self._max_streams:
            await abort_with(context, ResourceExhausted(
                f"client {host} already has {self._open[host]} streams open on this "
                f"server, the limit (max_streams_per_client) is {self._max_streams}"))
        if client_id is not None:
            key = f"id:{client_id[:64]}"
            if self._open[key] >= self._max_streams_per_id:
                await abort_with(context, ResourceExhausted(
                    f"client id {client_id[:64]!r} already has {self._open[key]} streams open "
                    "on this server, the limit (max_streams_per_client_id) is "
                    f"{self._max_streams_per_id}"))
            keys.append(key)
        for key in keys:
            self._open[key] += 1
        return keys

    def _leave(self, keys: list[str]) -> None:
        for key in keys:
            self._open[key] -= 1
            if self._open[key] <= 0:
                del self._open[key]

    def _limited(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            async def limited_stream(request: Any, context: grpc.aio.ServicerContext
                                     ) -> AsyncIterator[Any]:
                held = await self._enter(context)
                try:
                    async for item in behavior(request, context):
                        yield item
                finally:
                    self._leave(held)
            return limited_stream

        async def limited(request: Any, context: grpc.aio.ServicerContext) -> Any:
            held = await self._enter(context)
            try:
                return await behavior(request, context)
            finally:
                self._leave(held)
        return limited

    def _bounded(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def bounded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await asyncio.wait_for(behavior(request, context), self._max_unary_s)
            except TimeoutError:
                await abort_with(context, DeadlineExceeded(
                    f"the call ran longer than the server's limit of {self._max_unary_s} s "
                    "(max_unary_s) and was cancelled"))
        return bounded


def _rejecting(exc: PersimmonError) -> Callable[..., Any]:
    async def reject(request: Any, context: grpc.aio.ServicerContext) -> None:
        await abort_with(context, exc)
    return reject


def raise_for_rpc_error(exc: grpc.aio.AioRpcError) -> PersimmonError:
    """The Persimmon error for a failed call (callers ``raise ... from exc``)."""
    return error_from_grpc(exc.code(), exc.details() or "")
