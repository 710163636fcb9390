"""The shards of one PS as :class:`~clients.ps_client.PSClient` sees them. One shard
(:class:`ShardConnection`): a channel, a stream per method, the requests it sends from its
share of a layout (through the client's codecs, their bytes counted per stream), codec state,
and the numbering that makes pushes idempotent. Every shard (:class:`ShardSet`): opened and
checked together (address ``i`` must serve shard ``i``), their epochs and tables' dims as last
learned, their byte counters, closed together; and the call budget of a request.

Every push message carries ``(client, seq)``: the client's random id (drawn once per
``PSClient``) and a sequence number per shard, raised by one per message and never reused,
also across reconnects. A retry (:meth:`ShardConnection.request`) resends the very same
message, so the shard applies it once and answers the first ack. A push also carries
the shard's epoch as the connection last learned it (Tables, at connect and re-sync).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np

from clients._stream import MultiplexedStream
from services.common import messages as msg
from services.common.auth import ClientSecurity
from services.common.codecs import (
    Codec,
    RowEncoder,
    WireArray,
    WireStats,
    codec_without_feedback,
    decode_array,
    raw_array,
)
from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
    error_from_grpc,
)
from services.common.registry import discover_shards, open_registry
from services.common.retry import RetryPolicy
from services.common.rpc import CLIENT_ID_KEY, open_channel
from services.common.sharding import ShardedIds

__all__ = ["PushNumbers", "Resolver", "ShardAddresses", "ShardConnection", "ShardSet",
           "ShardSettings", "check_grads", "received", "registry_resolver", "replies_rows",
           "sent"]

R = TypeVar("R", bound=msg.Message)
T = TypeVar("T")
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
    """What every shard connection of one client is opened with: ``rows_codec`` encodes the
    rows a lookup asks for, ``grads_codec`` the gradients, ``codec_stats`` counts every
    array's raw and wire bytes per stream (the client's, shared)."""

    rows_codec: str
    grads_codec: str
    retry_s: float
    max_message_bytes: int
    security: ClientSecurity
    push_numbers: PushNumbers
    codec_stats: WireStats


def check_grads(layout: ShardedIds, grads: np.ndarray) -> None:
    """InvalidArgument unless ``grads`` has a row per id of ``layout``."""
    if grads.ndim != 2 or grads.shape[0] != layout.ids.size:
        raise InvalidArgument(f"grads must be ({layout.ids.size}, dim), got {grads.shape}")


def received(stats: WireStats, stream: str, arr: WireArray) -> np.ndarray:
    """``arr`` decoded, counted in ``stats`` as received on ``stream``."""
    out = decode_array(arr, stream)
    stats.add(stream, arr.codec, "received", 4 * out.size, arr.nbytes)
    return out


def sent(stats: WireStats, stream: str, arr: WireArray, x: np.ndarray) -> None:
    """Count ``arr`` (``x`` encoded) in ``stats`` as sent on ``stream``."""
    stats.add(stream, arr.codec, "sent", 4 * x.size, arr.nbytes)


def replies_rows(stats: WireStats, replies: Sequence[msg.LookupReply]) -> np.ndarray:
    """The rows of lookup replies (in shard order, at least one) as one writable float32
    array, counted in ``stats``."""
    parts = [received(stats, "rows_down", reply.rows) for reply in replies]
    rows = np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])  # writable
    return rows if rows.dtype == np.float32 else rows.astype(np.float32)


def _tag(layout: ShardedIds) -> list[int] | None:
    """The layout's step tag as it travels (services.ps.staleness counts it)."""
    return None if layout.tag is None else list(layout.tag)


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

    def lookup_request(self, layout: ShardedIds, read_only: bool = False, *,
                       with_state: bool = False) -> msg.LookupRequest:
        """The Lookup of this shard's slice of ``layout``."""
        k = self.index
        lo, hi = layout.bounds[k], layout.bounds[k + 1]
        return msg.LookupRequest(tables=list(layout.tables), counts=layout.counts[k].tolist(),
                                 ids=raw_array(layout.ids[lo:hi]),
                                 codec="none" if with_state else self.settings.rows_codec,
                                 tag=_tag(layout), read_only=True if read_only else None,
                                 with_state=True if with_state else None)

    def push_request(self, layout: ShardedIds, grads: np.ndarray) -> msg.PushRequest:
        """The Push of this shard's slice of ``layout`` and its rows of ``grads``, numbered
        with the next sequence number and the shard's epoch as last learned."""
        k = self.index
        lo = int(layout.bounds[k])
        return msg.PushRequest(client=self.settings.push_numbers.client_id, seq=self.next_seq(),
                               tables=list(layout.tables), counts=layout.counts[k].tolist(),
                               ids=raw_array(layout.ids[lo:int(layout.bounds[k + 1])]),
                               grads=self._grads(layout, lo, grads),
                               tag=_tag(layout), epoch=self.epoch or None)

    def _grads(self, layout: ShardedIds, lo: int, grads: np.ndarray) -> list[WireArray]:
        """This shard's gradients on the wire: one array, or one per table when the codec
        keeps a residual per id (and so per table)."""
        hi, stats = int(layout.bounds[self.index + 1]), self.settings.codec_stats
        if not self.grads_per_table:
            body = self.grads_encoder.to_wire(layout.ids[lo:hi], grads[lo:hi])
            sent(stats, "grads_up", body, grads[lo:hi])
            return [body]
        bodies = []
        for table, count in zip(layout.tables, layout.counts[self.index].tolist(), strict=True):
            encoder = self.grads_encoders.get(table)
            if encoder is None:
                encoder = self.grads_encoders[table] = RowEncoder(self.settings.grads_codec)
            ids, g = layout.ids[lo:lo + count], grads[lo:lo + count]
            body = encoder.to_wire(ids, g, key=table)
            sent(stats, "grads_up", body, g)
            bodies.append(body)
            lo += count
        return bodies

    def _open(self) -> grpc.aio.Channel:
        return open_channel(self.address, self.settings.security, self.settings.max_message_bytes)

    def _stream(self, method: str) -> MultiplexedStream:
        identity = ((CLIENT_ID_KEY, str(self.settings.push_numbers.client_id)),)
        return MultiplexedStream(self.channel, SERVICE + method,
                                 metadata=(self.settings.security.metadata() or ()) + identity)

    async def request(self, stream: MultiplexedStream, message: msg.Message, reply: type[R]
                      ) -> R:
        """``message``'s reply on ``stream`` (one of this shard's), checked as ``reply``,
        retried as :meth:`retried` does."""
        return await self.retried(stream.method, lambda: stream.request(message, reply))

    async def retried(self, what: str, attempt: Callable[[], Awaitable[R]]) -> R:
        """``attempt()``'s result; where the shard is unavailable (down, restarting),
        ``attempt()`` again on a fresh channel (:meth:`reconnect`), with backoff, until
        ``retry_s`` has passed: the caller pauses, not crashes. (Every call to this shard
        retries here: its streams' requests and its unary calls.)"""
        started, retrying = time.monotonic(), None
        while True:
            channel = self.channel  # (the streams are bound to it: :meth:`reconnect`)
            try:
                return await attempt()
            except Unavailable as exc:
                retrying = retrying or RetryPolicy(deadline_s=self.settings.retry_s).begin(
                    what=what, started=started)
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


class ShardSet:
    """The connections to the shards at ``book`` (in shard order), opened with ``settings``.

    ``dims`` (each known table's dim) is filled at :meth:`open` and by :meth:`tables`; a
    request waits at most ``timeout + retry_s`` for every shard's reply (:meth:`within`).
    """

    def __init__(self, book: ShardAddresses, settings: ShardSettings, timeout: float) -> None:
        self.book, self.settings, self.timeout = book, settings, timeout
        self.budget_s = timeout + settings.retry_s
        self.connections: list[ShardConnection] = []
        self.dims: dict[str, int] = {}

    async def open(self) -> None:
        """Resolve the addresses, open a connection per shard and check that address ``i``
        serves shard ``i`` of ``len(addresses)``; learn the epochs and the tables' dims."""
        await self.book.resolve()
        addresses = self.book.addresses
        self.connections = [ShardConnection(self.settings, self.book, i)
                            for i in range(len(addresses))]
        for i, info in enumerate(await self._tables_of_every_shard()):
            if info.shard_id != i or info.num_shards != len(addresses):
                raise FailedPrecondition(
                    f"{addresses[i]} is shard {info.shard_id} of {info.num_shards}, but the "
                    f"client lists it as shard {i} of {len(addresses)}: give the addresses "
                    "in shard order")
            self._learn_dims(info)
            self.connections[i].epoch = info.epoch or 0

    async def _tables_of_every_shard(self) -> list[msg.TablesReply]:
        return await asyncio.gather(*(s.retried("PS Tables", functools.partial(
            s.unary, "Tables", msg.TablesRequest(), msg.TablesReply, self.timeout))
            for s in self.connections))

    def _learn_dims(self, info: msg.TablesReply) -> None:
        for table in info.tables:
            self.dims[table.name] = table.dim

    @property
    def epochs(self) -> list[int]:
        """Each shard's epoch as last learned (0: a shard without epochs)."""
        return [s.epoch for s in self.connections]

    async def resync(self) -> list[int]:
        """Learn every shard's epoch anew; returns the epochs."""
        infos = await self._tables_of_every_shard()
        for shard, info in zip(self.connections, infos, strict=True):
            shard.epoch = info.epoch or 0
        return self.epochs

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.connections))
        self.connections = []

    async def within(self, pending: Awaitable[T]) -> T:
        """``pending`` within the call budget, else :class:`DeadlineExceeded`."""
        try:
            return await asyncio.wait_for(pending, self.budget_s)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"no reply from the PS within {self.budget_s:g} s "
                                   "(timeout + retry_s)") from exc

    async def tables(self) -> list[msg.TableInfo]:
        """Table configs as the first shard reports them (tables exist on every shard)."""
        info = await self.connections[0].unary("Tables", msg.TablesRequest(), msg.TablesReply,
                                               self.timeout)
        self._learn_dims(info)
        return info.tables

    async def dim(self, table: str) -> int:
        """``table``'s dim, asked of the shards when not known yet (NotFound: no table)."""
        dim = self.dims.get(table)
        if dim is None:
            await self.tables()
            if table not in self.dims:
                raise NotFound(f"table {table!r} does not exist")
            dim = self.dims[table]
        return dim

    async def stats(self, table: str | None = None) -> list[msg.StatsReply]:
        """Every shard's Stats reply, in shard order."""
        return list(await asyncio.gather(*(
            s.unary("Stats", msg.StatsRequest(table=table), msg.StatsReply, self.timeout)
            for s in self.connections)))

    def grads_codecs(self) -> list[Codec]:
        """Every codec the gradients go through, shard by shard."""
        return [codec for s in self.connections for codec in s.grads_codecs()]

    def wire_bytes(self) -> dict[str, int]:
        """Bytes sent and received per stream (pooled lookups and pushes count as lookups
        and pushes, PushThenLookup as a push)."""
        shards = self.connections
        return {
            "lookup_out": sum(s.lookup.bytes_out + s.pooled_lookup.bytes_out for s in shards),
            "lookup_in": sum(s.lookup.bytes_in + s.pooled_lookup.bytes_in for s in shards),
            "push_out": sum(s.push.bytes_out + s.pooled_push.bytes_out
                            + s.push_then_lookup.bytes_out for s in shards),
            "push_in": sum(s.push.bytes_in + s.pooled_push.bytes_in
                           + s.push_then_lookup.bytes_in for s in shards),
        }
