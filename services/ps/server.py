"""gRPC service ``persimmon.PS``: Lookup, Push, PushThenLookup and the pooled streams, unary
Tables and Stats (messages: :mod:`services.common.messages`).

Stream requests carry a request id ``rid``; responses echo it, so a client may keep many
requests in flight on one stream. A frame that cannot be decoded at all ends the stream
with INVALID_ARGUMENT (FAILED_PRECONDITION for another protocol version); a decodable but
invalid request gets an in-band ``error`` for its ``rid`` and the stream goes on. Every part
of a request is checked before any is served or applied. Every push names its origin
(``client``, ``seq``) and is applied at most once: a retry gets the first ack
(:mod:`services.ps.dedup`); a push of another ``epoch`` than the shard's (it was restored since)
is refused with FAILED_PRECONDITION (:mod:`services.ps.durability`); Tables and Stats answer the
shard's epoch. A lookup or push may carry a step ``tag`` (worker, step, workers): the shard
counts the staleness of tagged lookups over every worker's pushes (:mod:`services.ps.staleness`,
reported by Stats).

PooledLookup/PooledPush are DES-style partial pooling: ``ids`` are this shard's ids of a
batch, sample by sample (``lengths[b]`` ids for sample ``b``); the shard returns per-sample
sums of its rows and takes back the per-sample (pooled) gradient, spreading it over the ids.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import numpy as np

from services.common.codecs import Codec, decode_array, encode_array, get_codec, raw_array
from services.common.errors import InvalidArgument, MalformedMessage, PersimmonError
from services.common.messages import (
    PS_REQUEST_OBJECTS,
    ErrorBody,
    ErrorReply,
    LookupReply,
    LookupRequest,
    Message,
    PooledLookupReply,
    PooledLookupRequest,
    PooledPushReply,
    PooledPushRequest,
    PushReply,
    PushRequest,
    PushThenLookupReply,
    PushThenLookupRequest,
    StatsRequest,
    TablesReply,
    TablesRequest,
    decode,
    encode,
)
from services.common.rpc import abort_with, generic_service, unary_handler
from services.common.wire import frame_rid
from services.ps.bounds import check_lookup, check_pooled, check_push
from services.ps.dedup import PushOrigin
from services.ps.metrics import PSMetrics
from services.ps.shard import Shard
from services.ps.staleness import step_tags
from services.ps.store import PushResult
from services.ps.tables import table_info

__all__ = ["SERVICE_NAME", "PSServicer"]

SERVICE_NAME = "persimmon.PS"

Handler = Callable[[Any, dict[str, Codec]], Awaitable[Message]]


class PSServicer:
    """Translates wire messages to :class:`Shard` calls and back."""

    def __init__(self, shard: Shard, metrics: PSMetrics) -> None:
        self.shard = shard
        self.metrics = metrics

    def handlers(self) -> grpc.GenericRpcHandler:
        streams: dict[str, tuple[type[Message], Handler]] = {
            "Lookup": (LookupRequest, self._lookup),
            "Push": (PushRequest, self._push),
            "PushThenLookup": (PushThenLookupRequest, self._push_then_lookup),
            "PooledLookup": (PooledLookupRequest, self._pooled_lookup),
            "PooledPush": (PooledPushRequest, self._pooled_push),
        }
        return generic_service(SERVICE_NAME, {
            **{method: grpc.stream_stream_rpc_method_handler(self._stream(method, *spec))
               for method, spec in streams.items()},
            "Tables": unary_handler(self._tables),
            "Stats": unary_handler(self._stats),
        })

    # ---- streams ----------------------------------------------------------------------------

    def _stream(self, method: str, request_type: type[Message], handle: Handler
                ) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext],
                              AsyncIterator[bytes]]:
        async def serve(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[bytes]:
            async for out in self._serve_stream(method, request_type, handle, requests,
                                                context):
                yield out
        return serve

    async def _serve_stream(self, method: str, request_type: type[Message], handle: Handler,
                            requests: AsyncIterator[bytes],
                            context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        codecs: dict[str, Codec] = {}  # this stream's encoders, one per codec name
        limit = self.shard.config.max_message_bytes
        wire = self.metrics.wire_bytes
        async for raw in requests:
            started = time.perf_counter()
            wire.labels(method, "in").inc(len(raw))
            try:
                request, rid = _request(request_type, raw, limit)
            except PersimmonError as exc:
                self.metrics.errors.labels(method, exc.grpc_code.name).inc()
                await abort_with(context, exc)
                return
            try:
                if isinstance(request, PersimmonError):
                    raise request
                reply: Message = await handle(request, codecs)
            except PersimmonError as exc:
                self.metrics.errors.labels(method, exc.grpc_code.name).inc()
                reply = ErrorReply(error=ErrorBody.of(exc))
            out = encode(reply, rid=rid)
            wire.labels(method, "out").inc(len(out))
            self.metrics.latency.labels(method).observe(time.perf_counter() - started)
            yield out

    async def _lookup(self, req: LookupRequest, codecs: dict[str, Codec]) -> LookupReply:
        codec = _codec(req.codec, codecs)
        state: dict[str, np.ndarray] | None = {} if req.with_state else None
        with step_tags(lookup=check_lookup(self.shard, req)):
            rows = await self.shard.lookup_many(req.tables, req.counts,
                                                decode_array(req.ids, "ids"),
                                                read_only=bool(req.read_only), state=state)
        return LookupReply(rows=encode_array(rows, codec), state=None if state is None else
                           {k: raw_array(v) for k, v in state.items()})

    async def _push(self, req: PushRequest, codecs: dict[str, Codec]) -> PushReply:
        with step_tags(push=check_push(self.shard, req)):
            return _ack(await self.shard.push_many(*_push_parts(req), origin=_origin(req)),
                        PushReply)

    async def _push_then_lookup(self, req: PushThenLookupRequest, codecs: dict[str, Codec]
                                ) -> PushThenLookupReply:
        ask = req.lookup
        if ask.with_state:
            raise InvalidArgument("the lookup of a PushThenLookup reads rows only: look the "
                                  "optimizer state up with Lookup")
        codec = _codec(ask.codec, codecs)
        tags = (check_push(self.shard, req.push, "PushThenLookupRequest.push"),
                check_lookup(self.shard, ask, "PushThenLookupRequest.lookup"))
        with step_tags(*tags):
            result, rows = await self.shard.push_then_lookup(
                _push_parts(req.push),
                (ask.tables, ask.counts, decode_array(ask.ids, "lookup.ids")),
                origin=_origin(req.push))
        return PushThenLookupReply(push=_ack(result, PushReply),
                                   lookup=LookupReply(rows=encode_array(rows, codec)))

    async def _pooled_lookup(self, req: PooledLookupRequest, codecs: dict[str, Codec]
                             ) -> PooledLookupReply:
        codec = _codec(req.codec, codecs)
        check_pooled(self.shard, req, "PooledLookupRequest")
        pooled = await self.shard.pooled_lookup(req.table, decode_array(req.ids, "ids"),
                                                decode_array(req.lengths, "lengths"))
        return PooledLookupReply(pooled=encode_array(pooled, codec, key=req.table))

    async def _pooled_push(self, req: PooledPushRequest, codecs: dict[str, Codec]
                           ) -> PooledPushReply:
        check_pooled(self.shard, req, "PooledPushRequest")
        result = await self.shard.pooled_push(
            req.table, decode_array(req.ids, "ids"), decode_array(req.lengths, "lengths"),
            _float32(decode_array(req.grads, "grads")), origin=_origin(req))
        return _ack(result, PooledPushReply)

    # ---- unary ------------------------------------------------------------------------------

    async def _tables(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        decode(TablesRequest, raw, max_bytes=self.shard.config.max_message_bytes)
        cfg = self.shard.config
        return encode(TablesReply(
            shard_id=cfg.shard_id, num_shards=cfg.num_shards, epoch=self.shard.epoch,
            tables=[table_info(t.config)
                    for t in self.shard.tables.values()]))

    async def _stats(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        req: StatsRequest = decode(StatsRequest, raw,
                                   max_bytes=self.shard.config.max_message_bytes)
        return encode(self.shard.stats(req.table))


def _request(request_type: type[Message], raw: bytes, limit: int
             ) -> tuple[Message | MalformedMessage, int | None]:
    """A stream's request and its ``rid``; a frame that is not this request, the error to
    answer in-band. Raises (the stream ends) on a frame too big, of another protocol version,
    or not a msgpack map at all."""
    try:
        request: Message = decode(request_type, raw, max_bytes=limit,
                                  max_objects=PS_REQUEST_OBJECTS)
    except MalformedMessage as exc:
        return exc, frame_rid(raw)
    return request, request.rid


def _codec(name: str, codecs: dict[str, Codec]) -> Codec:
    """The stream's encoder for the reply codec a request names."""
    codec = codecs.get(name)
    if codec is None:
        codec = codecs[name] = get_codec(name)
    return codec


def _float32(grads: np.ndarray) -> np.ndarray:
    return grads if grads.dtype == np.float32 else grads.astype(np.float32)


def _push_parts(req: PushRequest) -> tuple[list[str], list[int], np.ndarray,
                                           np.ndarray | list[np.ndarray]]:
    """The (tables, counts, ids, grads) of a push, decoded (grads as float32)."""
    grads = [_float32(decode_array(g, f"grads[{i}]")) for i, g in enumerate(req.grads)]
    return (req.tables, req.counts, decode_array(req.ids, "ids"),
            grads[0] if len(grads) == 1 else grads)


def _origin(req: PushRequest | PooledPushRequest) -> PushOrigin:
    return PushOrigin(req.client, req.seq, req.epoch or 0)


R = TypeVar("R", PushReply, PooledPushReply)


def _ack(result: PushResult, reply: type[R]) -> R:
    return reply(applied=result.applied, dropped_nonfinite=result.dropped_nonfinite,
                 not_admitted=result.not_admitted)
