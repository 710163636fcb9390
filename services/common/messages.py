"""Typed wire messages: one request and one reply msgspec Struct per gRPC method.

A message is a keyword-only :class:`msgspec.Struct`; :func:`encode` frames it (msgpack, ``v``:
protocol version 2, the stream's ``rid``) and :func:`decode` checks a received frame straight
into it with a reused msgspec decoder: required fields, types, bounds (in the annotations),
no unknown fields, array headers; ``__post_init__`` checks what spans fields (counts against
ids, gradient rows). Anything wrong is a :class:`MalformedMessage` (INVALID_ARGUMENT) naming
the field, raised before a handler runs, so a bad message changes nothing; another protocol
version is FAILED_PRECONDITION. Arrays are :class:`~services.common.codecs.WireArray` values
whose ``data`` is a view of the frame, decoded by the codec they name
(:func:`~services.common.codecs.decode_array`). The protocol's JSON Schema
(:mod:`services.common.protocol_schema`) is in docs/protocol.md.

Protocol 2 (``A`` = array ``{dtype, shape, codec, meta, data}``; ``?`` = optional)::

    persimmon.PS (streams: every frame also carries ``rid``; a failed request is answered
    {rid, error: {error, code, message}}: ErrorReply, and the stream goes on)
      Lookup          {tables, counts, ids: A uint64, codec,      → {rows: A (len(ids), dim),
                       read_only?, with_state?}                      state?: {name: A}}
      Push            {client, seq, tables, counts, ids: A uint64, → {applied, dropped_nonfinite,
                       grads: [A (len(ids), dim)] | [A per table],    not_admitted}
                       epoch?}
      PushThenLookup  {push: Push request, lookup: Lookup request} → {push: Push reply,
                                                                      lookup: Lookup reply}
      PooledLookup    {table, ids: A uint64, lengths: A int, codec} → {pooled: A (samples, dim)}
      PooledPush      {client, seq, table, ids, lengths,       → as Push
                       grads: A (samples, dim), epoch?}
    persimmon.PS (unary)
      Tables          {}                         → {shard_id, num_shards, tables: [TableInfo], epoch?}
      Stats           {table?}                   → {shard_id, tables: {name: TableStats}, epoch?}
    persimmon.Loader
      Batches (server stream) {rank, world_size, credits} → {kind: "batch", batch}: BatchItem
                                                            ... then {kind: "end", rank}: BatchesEnd
      Ack             {batch_ids: [int]}                → {acked: [int], unknown: [int]}
      Describe        {}                                → {source, batch_size, world_size,
                                                           num_dense, dense_features,
                                                           sparse_features, multi_hot, buckets}

``tables``/``counts``: several tables of one dim in one message, ``ids`` holding each table's
ids one table after the other (``counts[i]`` of table ``i``). ``client``/``seq`` (required on
every push): the pushing client's random id and the push's sequence number on this shard,
from 1 up; a retry resends the same pair and is applied once (:mod:`services.ps.dedup`).
``epoch`` (optional on a push; absent or 0: none given, an older client): the shard's epoch as
the client learned it from Tables or Stats; a shard in another epoch (it was restored since)
refuses the push with FAILED_PRECONDITION (``StaleEpoch``) and applies nothing.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta, Struct

from services.common.codecs.array import WireArray
from services.common.errors import Internal, MalformedMessage, PersimmonError, error_named
from services.common.loader_messages import (
    MAX_ACK_IDS,
    AckReply,
    AckRequest,
    BatchBody,
    BatchesEnd,
    BatchesReply,
    BatchesRequest,
    BatchItem,
    DescribeReply,
    DescribeRequest,
    JaggedBody,
)
from services.common.wire import (
    MAX_ITEMS,
    PROTOCOL_VERSION,
    Message,
    Record,
    Text,
    UInt,
    check_frame,
    decode,
    encode,
    version_error,
)

__all__ = [
    "LOADER_METHODS",
    "MAX_ACK_IDS",
    "MAX_ITEMS",
    "MAX_STEP",
    "MAX_WORKERS",
    "PS_METHODS",
    "PS_REQUEST_OBJECTS",
    "AckReply",
    "AckRequest",
    "BatchBody",
    "BatchItem",
    "BatchesEnd",
    "BatchesReply",
    "BatchesRequest",
    "DescribeReply",
    "DescribeRequest",
    "Envelope",
    "ErrorBody",
    "ErrorReply",
    "JaggedBody",
    "LookupReply",
    "LookupRequest",
    "Message",
    "OptimizerInfo",
    "PooledLookupReply",
    "PooledLookupRequest",
    "PooledPushReply",
    "PooledPushRequest",
    "PushReply",
    "PushRequest",
    "PushThenLookupReply",
    "PushThenLookupRequest",
    "StatsReply",
    "StatsRequest",
    "StorageInfo",
    "TableCounters",
    "TableInfo",
    "TableStats",
    "TablesReply",
    "TablesRequest",
    "decode",
    "encode",
]

MAX_TABLES = 4096
MAX_WORKERS = 1 << 20  # the most workers a step tag may name (a shard's max_workers: fewer)
MAX_STEP = 1 << 48  # training steps a step tag may name
#: msgpack objects a PS request frame may hold: a push or lookup naming MAX_TABLES tables,
#: with an array per table (the frame is refused before decoding when it declares more)
PS_REQUEST_OBJECTS = 32 * MAX_TABLES + 1024
_FLOATS = ("float16", "float32", "float64")
_INTEGERS = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")

# ---- the field types: bounds live in the annotations ----------------------------------------

Names = Annotated[list[Text], Meta(max_length=MAX_TABLES)]
Counts = Annotated[list[UInt], Meta(max_length=MAX_TABLES)]
Tag = Annotated[list[UInt], Meta(min_length=3, max_length=3)]
Arrays = Annotated[list[WireArray], Meta(max_length=MAX_TABLES)]


# ---- cross-field checks ---------------------------------------------------------------------

def _check_ids(ids: WireArray, where: str, field: str = "ids") -> None:
    """Ids (and pooled lengths) travel raw, so their count is bounded by the bytes that came
    (a raw array's bytes are checked against its shape): every other array of a request is
    sized by them."""
    dtypes = ("uint64",) if field == "ids" else _INTEGERS
    if ids.dtype not in dtypes or ids.ndim != 1 or ids.codec != "none":
        kind = "uint64" if field == "ids" else "integer"
        raise MalformedMessage(f"{where}.{field} must be a 1-d {kind} array sent raw (codec "
                               f"none), got {ids.dtype} with shape {list(ids.shape)} and codec "
                               f"{ids.codec!r}")


def _check_parts(tables: list[str], counts: list[int], ids: WireArray, where: str) -> None:
    if not tables:
        raise MalformedMessage(f"{where}.tables must name at least one table")
    if len(counts) != len(tables):
        raise MalformedMessage(f"{where} has {len(counts)} counts for {len(tables)} tables")
    _check_ids(ids, where)
    if sum(counts) != ids.shape[0]:
        raise MalformedMessage(f"{where}.counts add up to {sum(counts)} but there are "
                               f"{ids.shape[0]} ids")


def _check_seq(seq: int, where: str) -> None:
    if seq < 1:
        raise MalformedMessage(f"{where}.seq must be a push sequence number >= 1, got {seq}")


def _check_tag(tag: list[int] | None, where: str) -> None:
    """A step tag is [worker rank, training step, workers] (services.ps.staleness), each
    within the protocol's bounds (a shard bounds ``workers`` further by its config)."""
    if tag is not None and (len(tag) != 3 or min(tag) < 0 or tag[0] >= tag[2]
                            or tag[2] > MAX_WORKERS or tag[1] >= MAX_STEP):
        raise MalformedMessage(f"{where}.tag must be [worker, step, workers] with 0 <= worker "
                               f"< workers <= {MAX_WORKERS} and 0 <= step < {MAX_STEP}, got "
                               f"{tag}")


def _check_rows(arr: WireArray, rows: int, what: str, named: str = "") -> None:
    if arr.ndim != 2 or arr.shape[0] != rows or arr.dtype not in _FLOATS:
        raise MalformedMessage(f"{what} must be {named}({rows}, dim) floats, got {arr.dtype} "
                               f"with shape {list(arr.shape)}")


_PARTS_MOVED = {"table": "name one table as tables=[name], counts=[len(ids)]"}


# ---- errors ---------------------------------------------------------------------------------

class ErrorBody(Record, kw_only=True):
    """A failed request's error: class name, gRPC status name, message."""

    error: Text
    code: Text
    message: str

    @classmethod
    def of(cls, exc: PersimmonError) -> ErrorBody:
        return cls(error=type(exc).__name__, code=exc.grpc_code.name, message=exc.message)

    def exception(self) -> PersimmonError:
        """The Persimmon error it stands for (same class when known)."""
        return error_named(self.error, self.code, self.message)


class ErrorReply(Message):
    """The in-band answer of a failed stream request (the stream goes on)."""

    error: ErrorBody


class Envelope(Struct):
    """What a stream reader needs of any frame: its version, ``rid`` and error, if any (the
    rest is skipped, not built). The error is read by :meth:`exception`, so that a peer's
    unreadable error fails the request it answers, not the stream."""

    v: Any = None
    rid: int | None = None
    error: msgspec.Raw = msgspec.Raw()

    def exception(self) -> PersimmonError | None:
        """The error the frame answers with (:meth:`ErrorBody.exception`), None if none; an
        error that is no :class:`ErrorBody` is :class:`Internal` saying what is wrong."""
        if not self.error:
            return None
        try:
            body = _ERROR.decode(self.error)
        except msgspec.DecodeError as exc:
            return Internal(f"unreadable error reply: {exc}")
        return None if body is None else body.exception()

    @classmethod
    def of(cls, raw: bytes) -> Envelope:
        """The envelope of a received frame; MalformedMessage when it is not one, and
        ProtocolMismatch when it speaks another protocol version."""
        check_frame(raw)
        try:
            envelope = _ENVELOPE.decode(raw)
        except msgspec.DecodeError as exc:
            raise MalformedMessage(f"reply is not a message ({exc})") from exc
        if envelope.v != PROTOCOL_VERSION:
            raise version_error(envelope.v)
        return envelope


_ENVELOPE = msgspec.msgpack.Decoder(Envelope)
_ERROR = msgspec.msgpack.Decoder(ErrorBody | None)


# ---- persimmon.PS ---------------------------------------------------------------------------

class LookupRequest(Message):
    """Rows of several tables of one dim; ``codec`` encodes the reply's rows. ``read_only``:
    the shard creates no row and marks none used (an id without a row reads its initial
    row): a reader beside training, such as a prediction server."""

    moved: ClassVar[dict[str, str]] = _PARTS_MOVED
    tables: Names
    counts: Counts
    ids: WireArray
    codec: Text = "none"
    tag: Tag | None = None
    read_only: bool | None = None  # left off the wire unless asked
    with_state: bool | None = None  # the rows' optimizer state too (a worker's replica)

    def __post_init__(self) -> None:
        _check_parts(self.tables, self.counts, self.ids, "LookupRequest")
        _check_tag(self.tag, "LookupRequest")


class LookupReply(Message):
    """Rows ``(len(ids), dim)`` in request order; with ``with_state``, each optimizer state
    array by name (``(len(ids), ...)``, request order, exact)."""

    rows: WireArray
    state: Annotated[dict[Text, WireArray], Meta(max_length=64)] | None = None


class PushRequest(Message):
    """Gradients of several tables of one dim: one array for all ids, or one per table."""

    moved: ClassVar[dict[str, str]] = {
        **_PARTS_MOVED, "lookup": "a push with a lookup is the PushThenLookup method"}
    client: UInt
    seq: UInt
    tables: Names
    counts: Counts
    ids: WireArray
    grads: Arrays
    tag: Tag | None = None
    epoch: UInt | None = None  # the shard's epoch the client knows (None, 0: not given)

    def __post_init__(self) -> None:
        _check_seq(self.seq, "PushRequest")
        _check_tag(self.tag, "PushRequest")
        _check_parts(self.tables, self.counts, self.ids, "PushRequest")
        if len(self.grads) == 1:
            _check_rows(self.grads[0], self.ids.shape[0], "PushRequest.grads[0]")
        elif len(self.grads) == len(self.tables):
            for i, (g, count) in enumerate(zip(self.grads, self.counts, strict=True)):
                _check_rows(g, count, f"PushRequest.grads[{i}]")
        else:
            raise MalformedMessage(f"PushRequest.grads holds {len(self.grads)} arrays: one for "
                                   f"every id, or one per table ({len(self.tables)})")


class PushReply(Message):
    """Unique ids applied, dropped for NaN/Inf (their gradient, or the update it would have
    made), and not admitted (yet) by the filter."""

    applied: UInt
    dropped_nonfinite: UInt
    not_admitted: UInt


class PushThenLookupRequest(Message):
    """A push, then a lookup that sees it; both checked before either is done."""

    push: PushRequest
    lookup: LookupRequest


class PushThenLookupReply(Message):
    push: PushReply
    lookup: LookupReply


class PooledLookupRequest(Message):
    """Per-sample sums of one table's rows; sample ``b`` owns the next ``lengths[b]`` ids."""

    table: Text
    ids: WireArray
    lengths: WireArray
    codec: Text = "none"

    def __post_init__(self) -> None:
        _check_ids(self.ids, "PooledLookupRequest")
        _check_ids(self.lengths, "PooledLookupRequest", "lengths")


class PooledLookupReply(Message):
    pooled: WireArray


class PooledPushRequest(Message):
    """Per-sample (pooled) gradients ``(len(lengths), dim)``, spread over each sample's ids."""

    client: UInt
    seq: UInt
    table: Text
    ids: WireArray
    lengths: WireArray
    grads: WireArray
    epoch: UInt | None = None  # as PushRequest.epoch

    def __post_init__(self) -> None:
        _check_seq(self.seq, "PooledPushRequest")
        _check_ids(self.ids, "PooledPushRequest")
        _check_ids(self.lengths, "PooledPushRequest", "lengths")
        _check_rows(self.grads, self.lengths.shape[0], "PooledPushRequest.grads",
                    "(samples, dim) = ")


class PooledPushReply(PushReply):
    pass


class TablesRequest(Message):
    pass


class OptimizerInfo(Record, kw_only=True):
    """A table's server-side optimizer (services.ps.tables.OptimizerConfig)."""

    kind: Text
    lr: float
    eps: float
    beta1: float
    beta2: float
    initial_accumulator: float
    weight_decay: float
    ftrl_beta: float
    ftrl_l1: float
    ftrl_l2: float
    weight_bound: float | None = None
    grad_clip: float | None = None


class StorageInfo(Record, kw_only=True):
    """Where a table's rows live (services.ps.tables.StorageConfig)."""

    tier: Text
    path: Text | None = None
    ram_rows: UInt | None = None


class TableInfo(Record, kw_only=True):
    """One table's config as a shard reports it (services.ps.tables.TableConfig)."""

    name: Text
    dim: Annotated[int, Meta(ge=1)]
    dtype: Text
    initializer: Text
    init_low: float
    init_high: float
    init_std: float
    seed: Annotated[int, Meta(ge=0)]
    optimizer: OptimizerInfo
    admit_probability: float
    admit_min_count: UInt
    max_rows: UInt | None
    eviction: Text
    ttl_s: float | None
    initial_capacity: UInt
    storage: StorageInfo


class TablesReply(Message):
    """The shard's place, its table configs and its epoch (None: a shard without epochs)."""

    shard_id: UInt
    num_shards: UInt
    tables: Annotated[list[TableInfo], Meta(max_length=MAX_TABLES)]
    epoch: UInt | None = None


class StatsRequest(Message):
    """Statistics of one table, or of every table when ``table`` is None."""

    table: Text | None = None


class TableCounters(Record, kw_only=True):
    """One table's counters and sizes (as a shard's admin API serves them)."""

    name: Text
    rows: UInt
    capacity: UInt
    bytes: UInt
    disk_rows: UInt
    disk_bytes: UInt
    pending_admission: UInt
    lookups: UInt
    pushes: UInt
    ids_looked_up: UInt
    ids_pushed: UInt
    misses: UInt
    evictions: UInt
    expired: UInt
    deleted: UInt
    dropped_nonfinite: UInt
    refused_nonfinite: UInt
    not_admitted: UInt
    promoted: UInt
    demoted: UInt


class TableStats(TableCounters, kw_only=True):
    """One table's counters and sizes, and the staleness its tagged lookups saw (the mean
    and max of the earlier pushes they missed: the most of any one worker's, of their own
    worker's, of every worker's summed)."""

    tagged_lookups: UInt
    global_staleness_max: UInt
    global_staleness_mean: float
    own_staleness_max: UInt
    own_staleness_mean: float
    total_staleness_max: UInt
    total_staleness_mean: float


class StatsReply(Message):
    shard_id: UInt
    tables: Annotated[dict[Text, TableStats], Meta(max_length=MAX_TABLES)]
    epoch: UInt | None = None


#: method name → (request type, reply type)
PS_METHODS: dict[str, tuple[Any, Any]] = {
    "Lookup": (LookupRequest, LookupReply),
    "Push": (PushRequest, PushReply),
    "PushThenLookup": (PushThenLookupRequest, PushThenLookupReply),
    "PooledLookup": (PooledLookupRequest, PooledLookupReply),
    "PooledPush": (PooledPushRequest, PooledPushReply),
    "Tables": (TablesRequest, TablesReply),
    "Stats": (StatsRequest, StatsReply),
}
LOADER_METHODS: dict[str, tuple[Any, Any]] = {
    "Batches": (BatchesRequest, BatchesReply),
    "Ack": (AckRequest, AckReply),
    "Describe": (DescribeRequest, DescribeReply),
}
