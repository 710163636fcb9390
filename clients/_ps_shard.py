"""One PS shard as :class:`~clients.ps_client.PSClient` sees it: a channel, a stream per
method, codec state, and the numbering that makes pushes idempotent.

Every push message carries ``(client, seq)``: the client's random id (drawn once per
``PSClient``) and a sequence number per shard, raised by one per message and never reused,
also across reconnects. A retry (:meth:`ShardConnection.request`) resends the very same
message, so the shard applies it once and answers the first ack. A push also carries
the shard's epoch as the connection last learned it (Tables, at connect and re-sync).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from clients._stream import MultiplexedStream
from services.common import messages as msg
from services.common.auth import ClientSecurity
from services.common.codecs import Codec, RowEncoder, codec_without_feedback
from services.common.errors import FailedPrecondition, Unavailable, error_from_grpc
from services.common.registry import discover_shards, open_registry
from services.common.retry import RetryPolicy
from services.common.rpc import CLIENT_ID_KEY, open_channel

__all__ = ["PushNumbers", "Resolver", "ShardAddresses", "ShardConnection", "ShardSettings",
           "registry_resolver"]

R = TypeVar("R", bound=msg.Message)
Resolver = Callable[[], Awaitable[Sequence[str]]]  # the shards' addresses, in shard order
SERVICE = "/persimmon.PS/"


class PushNumbers:
    """A client id (random, 63 bits: a non-negative msgpack int64) and, per shard, the next
    push sequence number (from 1)."""

    def __init__(self, client_id: int | None = None) -> None:
        self.client_id = secrets.randbits(63) if client_id is None else client_id
        self._next: dict[int, itertools.count[int]] = {}

    def next(self, shard: int) -> int:
        """A fresh sequence number for a push to shard ``shard``."""
        counter = self._next.get(shard)
        if counter is None:
            counter = self._next[shard] = itertools.count(1)
        return next(counter)


class ShardAddresses:
    """The shards' addresses in shard order, refreshed from ``resolver`` where there is one
    (e.g. a registry: a restarted shard may come back on another port); the number of shards
    must not change. The client and each of its shard connections share one."""

    def __init__(self, addresses: Sequence[str], resolver: Resolver | None) -> None:
        self.addresses = list(addresses)
        self.resolver = resolver

    async def resolve(self) -> None:
        """Refresh the addresses from the resolver (none: nothing to do)."""
        if self.resolver is None:
            return
        addresses = list(await self.resolver())
        if self.addresses and len(addresses) != len(self.addresses):
            raise FailedPrecondition(f"the PS now has {len(addresses)} shards, the client "
                                     f"was connected to {len(self.addresses)}")
        self.addresses = addresses


def registry_resolver(url: str, timeout_s: float) -> Resolver:
    """A resolver of the shards registered at ``url`` (waiting up to ``timeout_s`` for every
    one of them)."""
    async def resolve() -> list[str]:
        registry = open_registry(url)
        try:
            shards = await discover_shards(registry, timeout_s=timeout_s)
        finally:
            await registry.close()
        return [m.address for m in shards]

    return resolve


@dataclass(frozen=True, slots=True)
class ShardSettings:
    """What every shard connection of one client is opened with."""

    grads_codec: str
    retry_s: float
    max_message_bytes: int
    security: ClientSecurity
    push_numbers: PushNumbers


class ShardConnection:
    """Channel and streams to shard ``index`` of ``shards``, opened with ``settings``;
    reopened (at the address resolved again) on failure."""

    def __init__(self, settings: ShardSettings, shards: ShardAddresses, index: int) -> None:
        self.settings, self.shards = settings, shards
        self.index = index
        self.address = shards.addresses[index]
        self.epoch = 0  # the shard's epoch as last learned (0: a shard without epochs)
        self.channel = self._open()
        self._reconnecting = asyncio.Lock()
        self.lookup = self._stream("Lookup")
        self.push = self._stream("Push")
        self.push_then_lookup = self._stream("PushThenLookup")
        self.grads_encoders: dict[str, RowEncoder] = {}  # per table: residuals per id
        self.grads_encoder = RowEncoder(settings.grads_codec)  # a whole message's, no residuals
        self.grads_per_table = self.grads_encoder.feedback is not None
        self.pooled_lookup = self._stream("PooledLookup")
        self.pooled_push = self._stream("PooledPush")
        self.pooled_grads_codec: Codec = codec_without_feedback(settings.grads_codec)[0]

    def grads_codecs(self) -> list[Codec]:
        """Every codec this shard's gradients go through (whole messages, per table, pooled)."""
        return [self.grads_encoder.codec, *(e.codec for e in self.grads_encoders.values()),
                self.pooled_grads_codec]

    def next_seq(self) -> int:
        """The sequence number of the next push message to this shard."""
        return self.settings.push_numbers.next(self.index)

    def _open(self) -> grpc.aio.Channel:
        return open_channel(self.address, self.settings.security, self.settings.max_message_bytes)

    def _stream(self, method: str) -> MultiplexedStream:
        identity = ((CLIENT_ID_KEY, str(self.settings.push_numbers.client_id)),)
        return MultiplexedStream(self.channel, SERVICE + method,
                                 metadata=(self.settings.security.metadata() or ()) + identity)

    async def request(self, stream: MultiplexedStream, message: msg.Message, reply: type[R]
                      ) -> R:
        """``message``'s reply on ``stream`` (one of this shard's), checked as ``reply``;
        where the shard is unavailable (down, restarting), the same message again on a fresh
        channel (:meth:`reconnect`), with backoff, until ``retry_s`` has passed: the caller
        pauses, not crashes."""
        started, retrying = time.monotonic(), None
        while True:
            channel = stream.channel
            try:
                return await stream.request(message, reply)
            except Unavailable as exc:
                retrying = retrying or RetryPolicy(deadline_s=self.settings.retry_s).begin(
                    what=stream.method, started=started)
                await retrying.wait(exc)  # raises once the deadline is past
            await self.reconnect(channel)

    async def reconnect(self, failed: grpc.aio.Channel) -> grpc.aio.Channel:
        """A fresh channel to this shard's (re-resolved) address, once per failed channel."""
        async with self._reconnecting:
            ready = failed.get_state() == grpc.ChannelConnectivity.READY
            if failed is self.channel and not ready:  # a READY channel is kept: no cascade
                await self.shards.resolve()
                self.address = self.shards.addresses[self.index]
                self.channel = self._open()
                for stream in vars(self).values():
                    if isinstance(stream, MultiplexedStream):
                        stream.rebind(self.channel)
                await failed.close()
            return self.channel

    async def unary(self, method: str, request: msg.Message, reply: type[R], timeout: float) -> R:
        call = self.channel.unary_unary(SERVICE + method)
        try:
            return msg.decode(reply, await call(
                msg.encode(request), timeout=timeout, metadata=self.settings.security.metadata()))
        except grpc.aio.AioRpcError as exc:
            raise error_from_grpc(exc.code(), f"{self.address}: {exc.details()}") from exc

    async def close(self) -> None:
        for stream in (self.lookup, self.push, self.push_then_lookup, self.pooled_lookup,
                       self.pooled_push):
            await stream.close()
        await self.channel.close()
