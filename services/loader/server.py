"""gRPC service ``persimmon.Loader``: the Batches server stream, unary Ack and Describe
(messages: :mod:`services.common.messages`).

A worker rank opens Batches with its credits and receives ``{kind: "batch", batch}`` items,
then ``{kind: "end", rank}`` once the source is exhausted and every batch of the rank is
acknowledged. A rank that opens a new Batches stream ends its previous one and receives its
unacknowledged batches again first. Bad requests end the call with INVALID_ARGUMENT (or
FAILED_PRECONDITION for a world size that differs from the loader's, or another protocol
version).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.common.errors import PersimmonError
from services.common.messages import (
    MAX_ACK_IDS,
    AckReply,
    AckRequest,
    BatchesEnd,
    BatchesRequest,
    DescribeReply,
    DescribeRequest,
    decode,
    encode,
)
from services.common.rpc import abort_with, generic_service, unary_handler
from services.loader.pipeline import Pipeline

__all__ = ["MAX_ACK_IDS", "SERVICE_NAME", "LoaderServicer"]

SERVICE_NAME = "persimmon.Loader"


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
            req: BatchesRequest = decode(BatchesRequest, request)
            generation = await self.dispatcher.connect(req.rank, req.world_size, req.credits)
            rank = req.rank
        except PersimmonError as exc:
            await abort_with(context, exc)
            return
        sent = self.pipeline.metrics.sent_bytes
        try:
            async for item in self.dispatcher.stream(rank, generation):
                if item is None:
                    yield encode(BatchesEnd(rank=rank))
                    return
                sent.inc(len(item.payload))
                yield item.payload
        except PersimmonError as exc:
            await abort_with(context, exc)

    async def _ack(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        req: AckRequest = decode(AckRequest, request)
        acked, unknown = await self.dispatcher.ack(req.batch_ids)
        self.pipeline.acked(acked)
        return encode(AckReply(acked=[o.batch_id for o in acked], unknown=list(unknown)))

    async def _describe(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        decode(DescribeRequest, request)
        return encode(DescribeReply(**describe(self.pipeline)))


def describe(pipeline: Pipeline) -> dict[str, Any]:
    """What a worker needs to build its model's input layer."""
    schema = pipeline.source.schema
    cfg = pipeline.config
    return {"source": cfg.source, "batch_size": cfg.batch_size,
            "world_size": pipeline.dispatcher.world_size, "num_dense": len(schema.dense),
            **schema.describe()}
