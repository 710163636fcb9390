"""A long-lived bidirectional gRPC stream with many requests in flight, matched by ``rid``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import grpc

from services.common.errors import PersimmonError, Unavailable, error_from_grpc, error_from_wire
from services.common.wire import decode_message, encode_message

__all__ = ["MultiplexedStream"]


class MultiplexedStream:
    """Send request dicts on one stream and await each response by its request id.

    The stream opens lazily and reopens after a failure; a failure fails every request in
    flight with the mapped Persimmon error. ``bytes_out``/``bytes_in`` count wire bytes.
    """

    def __init__(self, channel: grpc.aio.Channel, method: str) -> None:
        self._channel = channel
        self._method = method
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._rids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self.bytes_out = 0
        self.bytes_in = 0

    async def request(self, body: dict[str, Any]) -> dict[str, Any]:
        """Send ``body`` and return the response body; in-band errors are raised."""
        rid = next(self._rids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        raw = encode_message({**body, "rid": rid})
        try:
            async with self._write_lock:
                call = self._ensure_open()
                await call.write(raw)
            self.bytes_out += len(raw)
            response = await future
        except grpc.aio.AioRpcError as exc:
            raise error_from_grpc(exc.code(), exc.details() or "") from exc
        except asyncio.InvalidStateError as exc:  # stream closed under us
            raise Unavailable(f"{self._method} stream closed") from exc
        finally:
            self._pending.pop(rid, None)
        if "error" in response:
            raise error_from_wire(response["error"])
        return response

    def _ensure_open(self) -> grpc.aio.StreamStreamCall:
        if self._call is None or self._call.done():
            self._call = self._channel.stream_stream(self._method)()
            self._reader = asyncio.create_task(self._read(self._call), name=f"read {self._method}")
        return self._call

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        error: PersimmonError | None = None
        try:
            while True:
                raw = await call.read()
                if raw is grpc.aio.EOF:
                    error = Unavailable(f"{self._method} stream ended by the server")
                    break
                self.bytes_in += len(raw)
                body = decode_message(raw)
                future = self._pending.get(body.get("rid"))
                if future is not None and not future.done():
                    future.set_result(body)
        except grpc.aio.AioRpcError as exc:
            error = error_from_grpc(exc.code(), exc.details() or "")
        except PersimmonError as exc:
            error = exc
        except asyncio.CancelledError:
            error = Unavailable(f"{self._method} stream closed")
            raise
        finally:
            if self._call is call:
                self._call = None
            for future in list(self._pending.values()):
                if not future.done():
                    future.set_exception(error or Unavailable(f"{self._method} stream failed"))

    async def close(self) -> None:
        if self._call is not None:
            with contextlib.suppress(Exception):
                await self._call.done_writing()
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        self._call = None
