"""A long-lived bidirectional gRPC stream with many typed requests in flight, matched by ``rid``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any, TypeVar

import grpc

from services.common.errors import PersimmonError, Unavailable, error_from_grpc
from services.common.messages import Envelope, Message, decode, encode

__all__ = ["MultiplexedStream"]

_CLOSE_TIMEOUT_S = 5.0  # a stream that cannot half-close in this long is cancelled

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Message)


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Read a given-up write's outcome, so that asyncio logs no unretrieved error."""
    if not task.cancelled():
        task.exception()


class MultiplexedStream:
    """Send typed requests on one stream and await each typed reply by its request id.

    The stream opens lazily and reopens after a failure; a failure fails every request in
    flight with the mapped Persimmon error (:class:`Unavailable` where the server is down:
    its owner may reconnect, :meth:`rebind` the stream and send again).
    ``bytes_out``/``bytes_in`` count wire bytes.
    """

    def __init__(self, channel: grpc.aio.Channel, method: str, *,
                 metadata: tuple[tuple[str, str], ...] | None = None) -> None:
        self._channel = channel
        self.method = method
        self._metadata = metadata  # sent when the stream opens, e.g. the bearer token
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        # rid -> (future, the call it was written on): a call's end fails only its own
        self._pending: dict[int, tuple[asyncio.Future[bytes], Any]] = {}
        self._rids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self.bytes_out = 0
        self.bytes_in = 0

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel the stream opens on."""
        return self._channel

    async def request(self, message: Message, reply: type[R]) -> R:
        """Send ``message`` and return its reply, checked as ``reply``; in-band errors are
        raised."""
        return decode(reply, await self._request_once(message))

    def rebind(self, channel: grpc.aio.Channel) -> None:
        """Use ``channel`` from now on (after a reconnect); the stream reopens on it."""
        if channel is not self._channel:
            self._channel = channel
            self._call = None

    async def _request_once(self, message: Message) -> bytes:
        """The reply frame to ``message`` (an in-band error is raised)."""
        rid = next(self._rids)
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        raw = encode(message, rid=rid)
        try:
            async with self._write_lock:
                call = self._ensure_open()
                self._pending[rid] = (future, call)
                await self._write(call, raw, future)
            self.bytes_out += len(raw)
            response = await future
        except grpc.aio.AioRpcError as exc:
            raise error_from_grpc(exc.code(), exc.details() or "") from exc
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:  # closed under us
            raise Unavailable(f"{self.method} stream closed") from exc
        finally:
            self._pending.pop(rid, None)
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()  # retrieved: a failed write leaves nobody awaiting it
        return response

    async def _write(self, call: grpc.aio.StreamStreamCall, raw: bytes,
                     answered: asyncio.Future[bytes]) -> None:
        """Write ``raw`` on ``call``, or give up the write once ``answered`` is done (when the
        call ends, its reader fails ``answered`` with the error the caller then raises):
        grpc.aio leaves a write pending for ever on a call that its channel's close cancelled
        before the connection was up, and the write lock with it."""
        writing = asyncio.ensure_future(call.write(raw))
        try:
            await asyncio.wait((writing, answered), return_when=asyncio.FIRST_COMPLETED)
        finally:
            given_up = not writing.done()  # the reply came first, or the call ended
            if given_up:
                writing.cancel()
                writing.add_done_callback(_retrieve)
        if given_up or writing.cancelled():
            return
        try:
            writing.result()
        except grpc.aio.AioRpcError as exc:  # the call had ended (e.g. its peer died,
            # INTERNAL "Internal error from Core"): this request was not served on it
            raise Unavailable(f"{self.method} stream ended before the request was "
                              f"written: {exc.code().name} {exc.details()}") from exc

    def _ensure_open(self) -> grpc.aio.StreamStreamCall:
        if self._call is None or self._call.done():
            self._call = self._channel.stream_stream(self.method)(metadata=self._metadata)
            self._reader = asyncio.create_task(self._read(self._call), name=f"read {self.method}")
        return self._call

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        error: PersimmonError | None = None
        try:
            while True:
                raw = await call.read()
                if raw is grpc.aio.EOF:
                    error = Unavailable(f"{self.method} stream ended by the server")
                    break
                self.bytes_in += len(raw)
                envelope = Envelope.of(raw)
                entry = self._pending.get(envelope.rid)  # type: ignore[arg-type]
                if entry is not None and not entry[0].done():
                    if (failure := envelope.exception()) is not None:
                        entry[0].set_exception(failure)
                    else:
                        entry[0].set_result(raw)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INTERNAL and "from Core" in (exc.details() or ""):
                # the transport broke under the stream (its peer died): unavailable, so the
                # requests it carried are retried (pushes are idempotent, lookups read)
                error = Unavailable(f"{self.method} stream broke: {exc.details()}")
            else:
                error = error_from_grpc(exc.code(), exc.details() or "")
        except PersimmonError as exc:
            error = exc
        except asyncio.CancelledError:
            error = Unavailable(f"{self.method} stream closed")
            raise
        finally:
            if self._call is call:
                self._call = None
            for future, on in list(self._pending.values()):
                if on is call and not future.done():
                    future.set_exception(error or Unavailable(f"{self.method} stream failed"))

    async def close(self) -> None:
        call = self._call  # the reader may clear self._call while done_writing() is awaited
        if call is not None:
            with contextlib.suppress(Exception):  # a half-close the peer never takes
                await asyncio.wait_for(call.done_writing(), _CLOSE_TIMEOUT_S)  # must not hang
            call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        self._call = None
