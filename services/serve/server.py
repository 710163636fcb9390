"""gRPC service ``persimmon.Serve``: unary ``Predict`` over msgpack (generic handlers, no
protoc), answered by the same micro-batcher as the REST ``POST /v1/predict``.

Messages (``A`` = array ``{dtype, shape, codec, meta, data}``)::

    Predict  {records | lines | ids (+ dense)}  → {version, step, probabilities: A float32 (B,)}

The request fields mean what they mean in the REST body (:mod:`services.serve.admin`); a
bad request is INVALID_ARGUMENT, too many records RESOURCE_EXHAUSTED, no version yet or a
full queue UNAVAILABLE.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import grpc
import numpy as np
from msgspec import Meta

from services.common.codecs import WireArray
from services.common.codecs.registry import raw_array
from services.common.errors import InvalidArgument, ResourceExhausted
from services.common.messages import Message, decode, encode
from services.common.rpc import generic_service, unary_handler
from services.common.wire import MAX_ITEMS, Text, UInt

if TYPE_CHECKING:
    from services.serve.batching import MicroBatcher

__all__ = ["SERVICE_NAME", "PredictReply", "PredictRequest", "ServeServicer"]

SERVICE_NAME = "persimmon.Serve"


Value = str | int | float | bool | None  # one field of a record, as JSON has it
Records = Annotated[list[dict[Text, Value]], Meta(max_length=MAX_ITEMS)]
Lines = Annotated[list[str], Meta(max_length=MAX_ITEMS)]
IdLists = Annotated[dict[Text, list[list[UInt]]], Meta(max_length=MAX_ITEMS)]
Dense = Annotated[list[list[float]], Meta(max_length=MAX_ITEMS)]


class PredictRequest(Message):
    """One of ``records``, ``lines`` or ``ids`` (with ``dense``)."""

    records: Records | None = None
    lines: Lines | None = None
    ids: IdLists | None = None
    dense: Dense | None = None

    def body(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("records", "lines", "ids", "dense")
                if getattr(self, k) is not None}

    def count(self) -> int:
        """The number of records the request holds (checked again once featurized)."""
        return count_records(records=self.records, lines=self.lines, ids=self.ids)


class PredictReply(Message):
    version: Text
    step: UInt
    probabilities: WireArray


class ServeServicer:
    """Predict calls into the service's micro-batcher, ``max_request_records`` at most."""

    def __init__(self, batcher: MicroBatcher, *, max_request_records: int) -> None:
        self.batcher = batcher
        self.max_request_records = max_request_records

    def handlers(self) -> grpc.GenericRpcHandler:
        return generic_service(SERVICE_NAME, {"Predict": unary_handler(self._predict)})

    async def _predict(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request: PredictRequest = decode(PredictRequest, raw)
        records = request.count()
        check_records(records, self.max_request_records)
        answer = await self.batcher.submit(request.body(), records)
        return encode(PredictReply(
            version=answer.version_id, step=answer.step,
            probabilities=raw_array(np.ascontiguousarray(answer.probabilities,
                                                         dtype=np.float32))))


def count_records(*, records: list[Any] | None, lines: list[Any] | None,
                  ids: dict[str, Any] | None) -> int:
    """The number of records a predict request holds, given exactly one of its three forms
    (REST and gRPC alike; checked again once featurized)."""
    given = [x for x in (records, lines, ids) if x is not None]
    if len(given) != 1:
        raise InvalidArgument("give exactly one of 'records', 'lines' or 'ids'")
    if ids is not None:
        first = next(iter(ids.values()), None)
        if not isinstance(first, list):
            raise InvalidArgument("'ids' must map each sparse feature to per-record id lists")
        return len(first)
    return len(given[0])


def check_records(records: int, limit: int) -> None:
    """A request must hold 1 to ``limit`` records."""
    if records < 1:
        raise InvalidArgument("the request holds no records")
    if records > limit:
        raise ResourceExhausted(f"the request holds {records} records; the limit is {limit}")
