"""gRPC service ``persimmon.PS``: bidirectional Lookup and Push streams, unary Tables and Stats.

Stream requests carry a request id ``rid``; responses echo it, so a client may keep many
requests in flight on one stream. A request that cannot be decoded at all ends the stream
with INVALID_ARGUMENT (or FAILED_PRECONDITION for a protocol mismatch); a decodable but
invalid request gets an in-band ``error`` for its ``rid`` and the stream goes on.

PooledLookup/PooledPush are DES-style partial pooling: ``ids`` are this shard's ids of a
batch, sample by sample (``lengths[b]`` ids for sample ``b``); the shard returns per-sample
sums of its rows and takes back the per-sample (pooled) gradient, spreading it over the ids.

Messages:
    Lookup  → {rid, table, ids: array(uint64), codec: str}   ← {rid, rows: array} | {rid, error}
    Push    → {rid, table, ids: array(uint64), grads: array} ← {rid, applied, dropped_nonfinite,
                                                               not_admitted} | {rid, error}
    PooledLookup → {rid, table, ids: array(uint64), lengths: array(int), codec: str}
                                                     ← {rid, pooled: array (samples, dim)} | {rid, error}
    PooledPush   → {rid, table, ids, lengths, grads: array (samples, dim)}
                                                     ← as Push
    Lookup  → {rid, tables: [str], counts: [int], ids: array(uint64), codec}
                                                     ← {rid, rows: array (sum(counts), dim)}
    Push    → {rid, tables, counts, ids, grads: array (sum(counts), dim) | [array per table]}
                                                     ← {rid, applied, ...} (summed)
              (several tables of one dim in one message, their ids one table after the
              other: every part is checked before any is served or applied; one error
              answers the whole message)
    Push    → {..., lookup: {tables, counts, ids, codec}}    ← {rid, applied, ..., rows}
              (the push, then a lookup that sees it: a worker's next batch rides on the
              push that frees its staleness slot; both parts checked before either is done)
    Tables  → {}                                             ← {shard_id, num_shards, tables}
    Stats   → {table?}                                       ← {shard_id, tables: {name: stats}}
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import numpy as np

from services.common.codecs import Codec, get_codec
from services.common.config import config_to_dict
from services.common.errors import InvalidArgument, PersimmonError, error_to_wire
from services.common.rpc import abort_with, generic_service, unary_handler
from services.common.wire import array_from_wire, array_to_wire, decode_message, encode_message
from services.ps.metrics import PSMetrics
from services.ps.shard import Shard
from services.ps.store import PushResult

__all__ = ["SERVICE_NAME", "PSServicer"]

SERVICE_NAME = "persimmon.PS"

Handler = Callable[[dict[str, Any], dict[str, Codec]], Awaitable[dict[str, Any]]]


class PSServicer:
    """Translates wire messages to :class:`Shard` calls and back."""

    def __init__(self, shard: Shard, metrics: PSMetrics) -> None:
        self.shard = shard
        self.metrics = metrics

    def handlers(self) -> grpc.GenericRpcHandler:
        return generic_service(SERVICE_NAME, {
            "Lookup": grpc.stream_stream_rpc_method_handler(self._lookup_stream),
            "Push": grpc.stream_stream_rpc_method_handler(self._push_stream),
            "PooledLookup": grpc.stream_stream_rpc_method_handler(self._pooled_lookup_stream),
            "PooledPush": grpc.stream_stream_rpc_method_handler(self._pooled_push_stream),
            "Tables": unary_handler(self._tables),
            "Stats": unary_handler(self._stats),
        })

    # ---- streams ----------------------------------------------------------------------------

    async def _lookup_stream(self, requests: AsyncIterator[bytes],
                             context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for out in self._serve_stream("Lookup", self._lookup, requests, context):
            yield out

    async def _push_stream(self, requests: AsyncIterator[bytes],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for out in self._serve_stream("Push", self._push, requests, context):
            yield out

    async def _pooled_lookup_stream(self, requests: AsyncIterator[bytes],
                                    context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for out in self._serve_stream("PooledLookup", self._pooled_lookup, requests,
                                            context):
            yield out

    async def _pooled_push_stream(self, requests: AsyncIterator[bytes],
                                  context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for out in self._serve_stream("PooledPush", self._pooled_push, requests, context):
            yield out

    async def _serve_stream(self, method: str, handle: Handler, requests: AsyncIterator[bytes],
                            context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        codecs: dict[str, Codec] = {}  # this stream's encoders, one per codec name
        limit = self.shard.config.max_message_bytes
        wire = self.metrics.wire_bytes
        async for raw in requests:
            started = time.perf_counter()
            wire.labels(method, "in").inc(len(raw))
            try:
                if len(raw) > limit:
                    raise InvalidArgument(f"message of {len(raw)} bytes exceeds the limit of "
                                          f"{limit} bytes (max_message_bytes)")
                body = decode_message(raw)
            except PersimmonError as exc:
                self.metrics.errors.labels(method, exc.grpc_code.name).inc()
                await abort_with(context, exc)
                return
            rid = body.get("rid")
            try:
                response = await handle(body, codecs)
            except PersimmonError as exc:
                self.metrics.errors.labels(method, exc.grpc_code.name).inc()
                response = {"error": error_to_wire(exc)}
            out = encode_message({"rid": rid, **response})
            wire.labels(method, "out").inc(len(out))
            self.metrics.latency.labels(method).observe(time.perf_counter() - started)
            yield out

    async def _lookup(self, body: dict[str, Any], codecs: dict[str, Codec]) -> dict[str, Any]:
        codec = _codec(body, codecs)
        if "tables" in body:
            tables, counts = _tables_and_counts(body, self.shard.config.max_tables)
            rows = await self.shard.lookup_many(tables, counts, array_from_wire(body.get("ids")))
        else:
            rows = await self.shard.lookup(_table_name(body), array_from_wire(body.get("ids")))
        return {"rows": array_to_wire(rows, codec)}

    async def _push(self, body: dict[str, Any], codecs: dict[str, Codec]) -> dict[str, Any]:
        ids = array_from_wire(body.get("ids"))
        grads = body.get("grads")
        if "tables" in body:
            tables, counts = _tables_and_counts(body, self.shard.config.max_tables)
            decoded = ([_float32(array_from_wire(g)) for g in grads] if isinstance(grads, list)
                       else _float32(array_from_wire(grads)))
            ask = body.get("lookup")
            if ask is None:
                return _ack(await self.shard.push_many(tables, counts, ids, decoded))
            if not isinstance(ask, dict):
                raise InvalidArgument("'lookup' must be a map {tables, counts, ids, codec}")
            asked, asked_counts = _tables_and_counts(ask, self.shard.config.max_tables)
            result, rows = await self.shard.push_then_lookup(
                (tables, counts, ids, decoded),
                (asked, asked_counts, array_from_wire(ask.get("ids"))))
            return {**_ack(result), "rows": array_to_wire(rows, _codec(ask, codecs))}
        table = _table_name(body)
        return _ack(await self.shard.push(table, ids, _float32(array_from_wire(grads))))

    async def _pooled_lookup(self, body: dict[str, Any],
                             codecs: dict[str, Codec]) -> dict[str, Any]:
        table = _table_name(body)
        ids = array_from_wire(body.get("ids"))
        lengths = array_from_wire(body.get("lengths"))
        codec = _codec(body, codecs)
        pooled = await self.shard.pooled_lookup(table, ids, lengths)
        return {"pooled": array_to_wire(pooled, codec)}

    async def _pooled_push(self, body: dict[str, Any], codecs: dict[str, Codec]) -> dict[str, Any]:
        table = _table_name(body)
        ids = array_from_wire(body.get("ids"))
        lengths = array_from_wire(body.get("lengths"))
        grads = _float32(array_from_wire(body.get("grads")))
        return _ack(await self.shard.pooled_push(table, ids, lengths, grads))

    # ---- unary ------------------------------------------------------------------------------

    async def _tables(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        decode_message(raw)
        cfg = self.shard.config
        return encode_message({
            "shard_id": cfg.shard_id, "num_shards": cfg.num_shards,
            "tables": [config_to_dict(t.config) for t in self.shard.tables.values()]})

    async def _stats(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        body = decode_message(raw)
        name = body.get("table")
        names = [_table_name(body)] if name is not None else list(self.shard.tables)
        return encode_message({
            "shard_id": self.shard.config.shard_id,
            "tables": {n: self.shard.table(n).stats() for n in names}})


def _codec(body: dict[str, Any], codecs: dict[str, Codec]) -> Codec:
    """The stream's encoder for the reply codec the request names (default ``none``)."""
    name = body.get("codec", "none")
    if not isinstance(name, str):
        raise InvalidArgument("codec must be a string such as 'fp16'")
    codec = codecs.get(name)
    if codec is None:
        codec = codecs[name] = get_codec(name)
    return codec


def _float32(grads: np.ndarray) -> np.ndarray:
    return grads if grads.dtype == np.float32 else grads.astype(np.float32)


def _ack(result: PushResult) -> dict[str, Any]:
    return {"applied": result.applied, "dropped_nonfinite": result.dropped_nonfinite,
            "not_admitted": result.not_admitted}


def _tables_and_counts(body: dict[str, Any], max_tables: int) -> tuple[list[str], list[int]]:
    """The ``tables`` and ``counts`` of a multi-table Lookup or Push."""
    tables, counts = body.get("tables"), body.get("counts")
    if not isinstance(tables, list) or not tables \
            or not all(isinstance(t, str) and t for t in tables):
        raise InvalidArgument("'tables' must be a non-empty list of table names")
    if len(tables) > max_tables:
        raise InvalidArgument(f"{len(tables)} tables exceed the limit of {max_tables}")
    if not isinstance(counts, list) or not all(type(c) is int and c >= 0 for c in counts):
        raise InvalidArgument("'counts' must be a list of non-negative ints, one per table")
    return tables, counts


def _table_name(body: dict[str, Any]) -> str:
    name = body.get("table")
    if not isinstance(name, str) or not name:
        raise InvalidArgument("request needs a 'table' name (a non-empty string)")
    return name
