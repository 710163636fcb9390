"""gRPC service ``persimmon.Loader``: the Batches server stream, unary Ack and Describe.

Messages (msgpack bodies, see :mod:`services.common.wire`):
    Batches  → {rank, world_size, credits}
             ← stream of {kind: "batch", batch: <Batch wire form, see services.common.batch>}
               ending with {kind: "end", rank} once the source is exhausted and every batch
               of the rank is acknowledged
    Ack      → {batch_ids: [int]}        ← {acked: [int], unknown: [int]}
    Describe → {}                        ← {sparse_features, dense_features, num_dense,
                                           batch_size, world_size (0 until a worker connects
                                           unless configured), source, ...}

A rank that opens a new Batches stream ends its previous one and receives its
unacknowledged batches again first. Bad requests end the call with INVALID_ARGUMENT (or
FAILED_PRECONDITION for a world size that differs from the loader's).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.common.errors import InvalidArgument, PersimmonError
from services.common.rpc import abort_with, generic_service, unary_handler
from services.common.wire import decode_message, encode_message
from services.loader.pipeline import Pipeline

__all__ = ["MAX_ACK_IDS", "SERVICE_NAME", "LoaderServicer"]

SERVICE_NAME = "persimmon.Loader"
MAX_ACK_IDS = 100_000


class LoaderServicer:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.dispatcher = pipeline.dispatcher

    def handlers(self) -> grpc.GenericRpcHandler:
        return generic_service(SERVICE_NAME, {
            "Batches": grpc.unary_stream_rpc_method_handler(self._batches),
            "Ack": unary_handler(self._ack),
            "Describe": unary_handler(self._describe),
        })

    async def _batches(self, request: bytes, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[bytes]:
        try:
            body = decode_message(request)
            generation = await self.dispatcher.connect(body.get("rank"), body.get("world_size"),
                                                       body.get("credits"))
            rank = int(body["rank"])  # validated by connect
        except PersimmonError as exc:
            await abort_with(context, exc)
            return
        sent = self.pipeline.metrics.sent_bytes
        try:
            async for item in self.dispatcher.stream(rank, generation):
                if item is None:
                    yield encode_message({"kind": "end", "rank": rank})
                    return
                sent.inc(len(item.payload))
                yield item.payload
        except PersimmonError as exc:
            await abort_with(context, exc)

    async def _ack(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        body = decode_message(request)
        ids = body.get("batch_ids")
        if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise InvalidArgument("batch_ids must be a list of non-negative integers")
        if len(ids) > MAX_ACK_IDS:
            raise InvalidArgument(f"at most {MAX_ACK_IDS} batch ids per Ack, got {len(ids)}")
        acked, unknown = await self.dispatcher.ack(ids)
        self.pipeline.acked(acked)
        return encode_message({"acked": [o.batch_id for o in acked], "unknown": unknown})

    async def _describe(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        decode_message(request)
        return encode_message(describe(self.pipeline))


def describe(pipeline: Pipeline) -> dict[str, Any]:
    """What a worker needs to build its model's input layer."""
    schema = pipeline.source.schema
    cfg = pipeline.config
    return {"source": cfg.source, "batch_size": cfg.batch_size,
            "world_size": pipeline.dispatcher.world_size, "num_dense": len(schema.dense),
            **schema.describe()}
