"""persimmon.Loader's messages (see :mod:`services.common.messages` for the protocol)::

    Batches (server stream) {rank, world_size, credits} → {kind: "batch", batch}: BatchItem
                                                          ... then {kind: "end", rank}: BatchesEnd
    Ack             {batch_ids: [int]}                → {acked: [int], unknown: [int]}
    Describe        {}                                → {source, batch_size, world_size,
                                                         num_dense, dense_features,
                                                         sparse_features, multi_hot, buckets}

A batch travels as a :class:`BatchBody`, its arrays raw; :meth:`BatchBody.to_batch` checks
dtypes and shapes as it builds the :class:`~services.common.batch.Batch`.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from services.common.batch import Batch, Jagged
from services.common.codecs.array import WireArray
from services.common.codecs.registry import decode_array, raw_array
from services.common.wire import MAX_ITEMS, Message, Text, UInt

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
TextList = Annotated[list[Text], Meta(max_length=MAX_ITEMS)]


class BatchesRequest(Message):
    """Open rank ``rank``'s batch stream with ``credits`` batches allowed unacknowledged."""

    rank: UInt
    world_size: UInt
    credits: UInt


class JaggedBody(Struct, forbid_unknown_fields=True):
    """One sparse feature of a batch: ``values`` uint64 (total,), ``lengths`` int32 (B,)."""

    values: WireArray
    lengths: WireArray


class BatchBody(Struct, kw_only=True, forbid_unknown_fields=True):
    """A :class:`~services.common.batch.Batch` on the wire, arrays raw."""

    batch_id: UInt
    labels: WireArray
    dense: WireArray
    sparse: Annotated[dict[Text, JaggedBody], Meta(max_length=MAX_ITEMS)]
    positions: Annotated[dict[Text, tuple[int, int]], Meta(max_length=MAX_ITEMS)] = {}

    @classmethod
    def of(cls, batch: Batch) -> BatchBody:
        """The wire form of ``batch`` (zero-copy views: encode before mutating it)."""
        return cls(batch_id=batch.batch_id, labels=raw_array(batch.labels),
                   dense=raw_array(batch.dense),
                   sparse={name: JaggedBody(raw_array(f.values), raw_array(f.lengths))
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
    dense_features: TextList
    sparse_features: TextList
    multi_hot: Annotated[dict[Text, Text], Meta(max_length=MAX_ITEMS)]
    buckets: Annotated[dict[Text, UInt], Meta(max_length=MAX_ITEMS)]
