"""Worker-side client of the loader: ``LoaderClient`` (async) and ``SyncLoaderClient``.

A worker of rank r opens the ``Batches`` stream with a number of *credits* (the most batches
the loader may have out to it unacknowledged) and acknowledges each batch once it is done
with it; every ack frees a credit. If the stream breaks, the client reconnects within
``reconnect_timeout_s``; the loader then re-sends the batches it has not seen acknowledged,
and the client drops those it already handed out (they will be acked by the caller), so
the caller sees each batch once. Iteration ends at the loader's end marker. Every call names
the client (``client_id``, random unless given) in its ``persimmon-client`` metadata, so the
loader's per-client-id stream cap tells its streams from other clients' on the same host.

    async with LoaderClient("127.0.0.1:50061", rank=0, world_size=2, credits=8) as loader:
        async for batch in loader.batches():
            train(batch)
            await loader.ack(batch)
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import AsyncGenerator, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

import grpc

from services.common import messages as msg
from services.common.auth import ClientSecurity
from services.common.batch import Batch
from services.common.errors import InvalidArgument, error_from_grpc
from services.common.retry import Retrying, RetryPolicy
from services.common.rpc import CLIENT_ID_KEY, open_channel
from services.common.tls import ClientTLS
from services.common.wire import MAX_MESSAGE_BYTES

__all__ = ["LoaderClient", "SyncLoaderClient"]

T = TypeVar("T")
R = TypeVar("R", bound=msg.Message)
_SERVICE = "/persimmon.Loader/"
_RETRY = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


class LoaderClient:
    """One worker rank's connection to one loader (``token``/``tls`` default to
    ``PERSIMMON_TOKEN``(``_FILE``) and ``PERSIMMON_TLS_CA``…)."""

    def __init__(self, address: str, *, rank: int = 0, world_size: int = 1, credits: int = 8,
                 reconnect_timeout_s: float = 30.0,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, token: str | None = None,
                 tls: ClientTLS | None = None, client_id: str | None = None) -> None:
        if client_id is not None and not (isinstance(client_id, str)
                                          and 0 < len(client_id) <= 64 and client_id.isprintable()):
            raise InvalidArgument(f"client_id must be 1 to 64 printable characters, got "
                                  f"{client_id!r}")
        if not 0 <= rank < world_size:
            raise InvalidArgument(f"rank must be in [0, {world_size}), got {rank}")
        if credits < 1:
            raise InvalidArgument(f"credits must be >= 1, got {credits}")
        self.address = address
        self.rank = rank
        self.world_size = world_size
        self.credits = credits
        self.reconnect_timeout_s = reconnect_timeout_s
        self._max_message_bytes = max_message_bytes
        self._security = ClientSecurity.resolve(token=token, tls=tls)
        self.client_id = client_id if client_id is not None else secrets.token_hex(8)
        self._metadata = (*(self._security.metadata() or ()), (CLIENT_ID_KEY, self.client_id))
        self._channel: grpc.aio.Channel | None = None
        self._outstanding: set[int] = set()
        self.reconnects = 0
        self.bytes_in = 0

    def _chan(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = open_channel(self.address, self._security, self._max_message_bytes)
        return self._channel

    async def _unary(self, method: str, request: msg.Message, reply: type[R],
                     timeout: float = 30.0) -> R:
        call = self._chan().unary_unary(_SERVICE + method)
        try:
            raw = await call(msg.encode(request), timeout=timeout,
                             metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise error_from_grpc(exc.code(), exc.details() or "") from exc
        return msg.decode(reply, raw, max_bytes=self._max_message_bytes)

    async def describe(self) -> msg.DescribeReply:
        """Feature names, dense width, batch size and world size of the loader."""
        return await self._unary("Describe", msg.DescribeRequest(), msg.DescribeReply)

    async def ack(self, batches: Batch | int | Iterable[Batch | int]) -> msg.AckReply:
        """Acknowledge batches (objects or ids); returns the ids ``acked`` and those the
        loader did not know (``unknown``: acknowledged before, or never sent)."""
        items = [batches] if isinstance(batches, Batch | int) else list(batches)
        ids = [b.batch_id if isinstance(b, Batch) else int(b) for b in items]
        reply = await self._unary("Ack", msg.AckRequest(batch_ids=ids), msg.AckReply)
        self._outstanding.difference_update(ids)
        return reply

    async def batches(self) -> AsyncGenerator[Batch, None]:
        """This rank's batches until the loader's end marker, reconnecting on failures."""
        request = msg.encode(msg.BatchesRequest(
            rank=self.rank, world_size=self.world_size, credits=self.credits))
        policy = RetryPolicy(deadline_s=self.reconnect_timeout_s)
        retrying: Retrying | None = None  # since the stream last delivered a batch
        while True:
            call = self._chan().unary_stream(_SERVICE + "Batches")(
                request, metadata=self._metadata)
            try:
                async for raw in call:
                    retrying = None
                    self.bytes_in += len(raw)
                    item: msg.BatchItem | msg.BatchesEnd = msg.decode(msg.BatchesReply, raw, max_bytes=self._max_message_bytes)
                    if isinstance(item, msg.BatchesEnd):
                        return
                    batch = item.batch.to_batch()
                    if batch.batch_id in self._outstanding:
                        continue  # re-sent after a reconnect; the caller already has it
                    self._outstanding.add(batch.batch_id)
                    yield batch
                error: Exception = error_from_grpc(grpc.StatusCode.UNAVAILABLE,
                                                   "Batches stream ended without an end marker")
                code = grpc.StatusCode.UNAVAILABLE
            except grpc.aio.AioRpcError as exc:
                error, code = error_from_grpc(exc.code(), exc.details() or ""), exc.code()
            finally:
                call.cancel()
            if code not in _RETRY:
                raise error
            retrying = retrying or policy.begin(what=f"Batches stream of {self.address}")
            await retrying.wait(error)
            self.reconnects += 1

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> LoaderClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SyncLoaderClient:
    """Blocking wrapper: a private event loop in a daemon thread runs a :class:`LoaderClient`."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="persimmon-loader-client")
        self._thread.start()
        self._client = LoaderClient(address, **kwargs)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def describe(self) -> msg.DescribeReply:
        return self._run(self._client.describe())

    def ack(self, batches: Batch | int | Iterable[Batch | int]) -> msg.AckReply:
        return self._run(self._client.ack(batches))

    def batches(self) -> Iterator[Batch]:
        stream = self._client.batches()

        async def next_batch() -> Batch | None:
            try:
                return await anext(stream)
            except StopAsyncIteration:
                return None

        try:
            while (batch := self._run(next_batch())) is not None:
                yield batch
        finally:
            self._run(stream.aclose())

    def close(self) -> None:
        self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> SyncLoaderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
