"""gRPC plumbing shared by every service: generic handlers over msgpack, no protoc.

Handlers receive and return *bytes*; the servicer decodes with
:func:`services.common.wire.decode_message` itself so that a malformed body becomes a
clear INVALID_ARGUMENT (a deserializer exception would surface as INTERNAL).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import grpc

from services.common.errors import PersimmonError, error_from_grpc
from services.common.wire import MAX_MESSAGE_BYTES

__all__ = [
    "abort_with",
    "channel_options",
    "generic_service",
    "make_server",
    "raise_for_rpc_error",
    "unary_handler",
]


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
                max_message_bytes: int = MAX_MESSAGE_BYTES) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server bound to ``host:port`` (0 picks a free port); returns it and the port."""
    server = grpc.aio.server(options=channel_options(max_message_bytes))
    server.add_generic_rpc_handlers(handlers)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    return server, bound


def raise_for_rpc_error(exc: grpc.aio.AioRpcError) -> PersimmonError:
    """The Persimmon error for a failed call (callers ``raise ... from exc``)."""
    return error_from_grpc(exc.code(), exc.details() or "")
