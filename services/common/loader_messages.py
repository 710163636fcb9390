"""persimmon.Loader's messages: Batches (a server stream of :class:`BatchItem` then one
:class:`BatchesEnd`), Ack and Describe. The protocol's table, and its other service, are in
:mod:`services.common.messages`, which exports these too.

A batch travels as a :class:`BatchBody`, its arrays raw; :meth:`BatchBody.to_batch` checks
dtypes and shapes as it builds the :class:`~services.common.batch.Batch`.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from services.common.batch import Batch, Jagged
from services.common.codecs.array import WireArray
from services.common.codecs.registry import decode_array, raw_array
from services.common.wire import Items, Message, Record, Text, TextMap, UInt

__all__ = [
    "MAX_ACK_IDS",
    "AckReply",
    "AckRequest",
    "BatchBody",
    "BatchItem",
    "BatchesEnd",
    "BatchesReply",
    "BatchesRequest",
    "DescribeReply",
    "DescribeRequest",
    "JaggedBody",
]

MAX_ACK_IDS = 100_000
Ids = Annotated[list[UInt], Meta(max_length=MAX_ACK_IDS)]


class BatchesRequest(Message):
    """Open rank ``rank``'s batch stream with ``credits`` batches allowed unacknowledged."""

    rank: UInt
    world_size: UInt
    credits: UInt


class JaggedBody(Record, kw_only=True):
    """One sparse feature of a batch: ``values`` uint64 (total,), ``lengths`` int32 (B,)."""

    values: WireArray
    lengths: WireArray


class BatchBody(Record, kw_only=True):
    """A :class:`~services.common.batch.Batch` on the wire, arrays raw."""

    batch_id: UInt
    labels: WireArray
    dense: WireArray
    sparse: TextMap[JaggedBody]
    positions: TextMap[tuple[int, int]] = {}

    @classmethod
    def of(cls, batch: Batch) -> BatchBody:
        """The wire form of ``batch`` (zero-copy views: encode before mutating it)."""
        return cls(batch_id=batch.batch_id, labels=raw_array(batch.labels),
                   dense=raw_array(batch.dense),
                   sparse={name: JaggedBody(values=raw_array(f.values),
                                            lengths=raw_array(f.lengths))
                           for name, f in batch.sparse.items()},
                   positions={key: (int(a), int(b)) for key, (a, b) in batch.positions.items()})

    def to_batch(self) -> Batch:
        """The batch (views of the frame); dtypes and shapes that disagree: MalformedMessage."""
        sparse = {name: Jagged(decode_array(f.values, f"{name}.values"),
                               decode_array(f.lengths, f"{name}.lengths"))
                  for name, f in self.sparse.items()}
        return Batch(batch_id=self.batch_id, labels=decode_array(self.labels, "labels"),
                     dense=decode_array(self.dense, "dense"), sparse=sparse,
                     positions=dict(self.positions))


class BatchItem(Message, tag_field="kind", tag="batch"):
    """An item of the Batches stream: one batch."""

    batch: BatchBody


class BatchesEnd(Message, tag_field="kind", tag="end"):
    """The last item of the Batches stream: rank ``rank`` has no more batches."""

    rank: UInt


#: one item of the Batches stream, told apart by ``kind``
BatchesReply = BatchItem | BatchesEnd


class AckRequest(Message):
    batch_ids: Ids


class AckReply(Message):
    acked: Ids
    unknown: Ids


class DescribeRequest(Message):
    pass


class DescribeReply(Message):
    """What a worker needs to build its input layer (``world_size`` 0 until one connects)."""

    source: Text
    batch_size: UInt
    world_size: UInt
    num_dense: UInt
    dense_features: Items[Text]
    sparse_features: Items[Text]
    multi_hot: TextMap[Text]
    buckets: TextMap[UInt]
