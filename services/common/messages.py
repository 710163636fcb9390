"""Typed wire messages: one request and one reply dataclass per gRPC method.

A message is a keyword-only dataclass; ``to_wire()`` gives its msgpack map and
``from_wire(body)`` checks a received map (required fields, types, list sizes, array headers,
no unknown fields) and builds it; ``__post_init__`` checks what spans fields (counts against
ids, gradient rows). Anything wrong is a :class:`MalformedMessage` (INVALID_ARGUMENT) raised
before a handler runs, so a bad message changes nothing. Arrays are
:class:`~services.common.codecs.WireArray` values, decoded by the codec they name
(:func:`~services.common.codecs.decode_array`). :mod:`services.common.wire` frames a message:
msgpack, ``v`` (protocol version 2, a mismatch is FAILED_PRECONDITION), the stream's ``rid``.

Protocol 2 (``A`` = array ``{dtype, shape, codec, meta, data}``; ``?`` = optional)::

    persimmon.PS (streams: every frame also carries ``rid``; a failed request is answered
    {rid, error: {error, code, message}} and the stream goes on)
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
      Tables          {}                         → {shard_id, num_shards, tables: [config], epoch?}
      Stats           {table?}                   → {shard_id, tables: {name: stats}, epoch?}
    persimmon.Loader
      Batches (server stream) {rank, world_size, credits} → {kind: "batch", batch} ... then
                                                            {kind: "end", rank}
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

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from services.common.batch import Batch
from services.common.codecs.array import WireArray
from services.common.errors import MalformedMessage
from services.common.wire import ENVELOPE_KEYS, decode_message, encode_message

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
    "BatchesReply",
    "BatchesRequest",
    "DescribeReply",
    "DescribeRequest",
    "LookupReply",
    "LookupRequest",
    "Message",
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
    "TablesReply",
    "TablesRequest",
    "decode",
    "encode",
]

M = TypeVar("M", bound="Message")
Load = Callable[[Any, str], Any]
Dump = Callable[[Any], Any] | None  # None: the value goes on the wire as it is

MAX_ITEMS = 1 << 20  # the longest list or map a message may hold unless a field says less
MAX_TABLES = 4096
MAX_ACK_IDS = 100_000
MAX_TEXT = 4096
MAX_WORKERS = 1 << 20  # the most workers a step tag may name (a shard's max_workers: fewer)
MAX_STEP = 1 << 48  # training steps a step tag may name
#: msgpack objects a PS request frame may hold: a push or lookup naming MAX_TABLES tables,
#: with an array per table (decode_message refuses a frame declaring more before decoding it)
PS_REQUEST_OBJECTS = 32 * MAX_TABLES + 1024
_FLOATS = ("float16", "float32", "float64")
_INTEGERS = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")


# ---- the generic mechanism: field converters derived from the type hints ---------------------

def _load_str(v: Any, where: str) -> str:
    if not isinstance(v, str) or len(v) > MAX_TEXT:
        raise MalformedMessage(f"{where} must be a string of at most {MAX_TEXT} characters, "
                               f"got {_show(v)}")
    return v


def _load_int(v: Any, where: str) -> int:
    if type(v) is not int or not 0 <= v < 2**63:
        raise MalformedMessage(f"{where} must be a non-negative int, got {_show(v)}")
    return v


def _load_bool(v: Any, where: str) -> bool:
    if type(v) is not bool:
        raise MalformedMessage(f"{where} must be true or false, got {_show(v)}")
    return v


def _load_any(v: Any, where: str) -> Any:
    return v


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _list_converters(item: Any, max_items: int) -> tuple[Load, Dump]:
    item_load, item_dump = _converters(item, max_items)

    def load(v: Any, where: str) -> list[Any]:
        if not isinstance(v, list) or len(v) > max_items:
            raise MalformedMessage(f"{where} must be a list of at most {max_items} items, "
                                   f"got {_show(v)}")
        if item is int and all(type(x) is int for x in v) \
                and (not v or (min(v) >= 0 and max(v) < 2**63)):
            return v  # the common cases without a call per item: ids, counts, table names
        if item is str and all(type(x) is str and len(x) <= MAX_TEXT for x in v):
            return v
        where_item = f"{where}[]"
        return [item_load(x, where_item) for x in v]
    return load, None if item_dump is None else (lambda v: [item_dump(x) for x in v])


def _map_converters(value: Any, max_items: int) -> tuple[Load, Dump]:
    value_load, value_dump = _converters(value, max_items)

    def load(v: Any, where: str) -> dict[str, Any]:
        if not isinstance(v, dict) or len(v) > max_items:
            raise MalformedMessage(f"{where} must be a map of at most {max_items} entries, "
                                   f"got {_show(v)}")
        return {_load_str(k, f"{where} key"): value_load(x, f"{where}[{k!r}]")
                for k, x in v.items()}
    return load, None if value_dump is None else (
        lambda v: {k: value_dump(x) for k, x in v.items()})


def _converters(tp: Any, max_items: int) -> tuple[Load, Dump]:
    """How to check (load) and pack (dump) a field of type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is str:
        return _load_str, None
    if tp is int:
        return _load_int, None
    if tp is bool:
        return _load_bool, None
    if tp is Any:
        return _load_any, None
    if origin is list:
        return _list_converters(args[0], max_items)
    if origin is dict:
        return _map_converters(args[1], max_items)
    if tp is WireArray:
        return WireArray.from_wire, WireArray.to_wire
    if isinstance(tp, type) and issubclass(tp, Message):
        return tp.from_wire, tp.to_wire
    if tp is Batch:
        return (lambda v, where: Batch.from_wire(v)), Batch.to_wire
    raise TypeError(f"no wire form for {tp!r}")


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    where: str  # "Class.field", for error texts
    required: bool
    load: Load
    dump: Dump


_SPECS: dict[type, tuple[tuple[_Field, ...], frozenset[str]]] = {}


def _spec(cls: type) -> tuple[tuple[_Field, ...], frozenset[str]]:
    """The fields of a message class (computed once per class)."""
    found = _SPECS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        fields = []
        for f in dataclasses.fields(cls):
            tp, optional = hints[f.name], False
            if typing.get_origin(tp) in (typing.Union, types.UnionType) \
                    and type(None) in typing.get_args(tp):
                tp, optional = next(a for a in typing.get_args(tp) if a is not type(None)), True
            load, dump = _converters(tp, f.metadata.get("max_items", MAX_ITEMS))
            required = f.default is dataclasses.MISSING \
                and f.default_factory is dataclasses.MISSING
            fields.append(_Field(f.name, f"{cls.__name__}.{f.name}", required and not optional,
                                 load, dump))
        found = _SPECS[cls] = (tuple(fields), frozenset(f.name for f in fields) | ENVELOPE_KEYS)
    return found


class Message:
    """Base of every message: ``to_wire``/``from_wire`` driven by the dataclass fields."""

    __slots__ = ()
    #: fields of the protocol-1 shape of this message and where their content went
    moved: ClassVar[dict[str, str]] = {}

    def to_wire(self) -> dict[str, Any]:
        """The message's msgpack map (arrays as maps; optional fields left out when None)."""
        out: dict[str, Any] = {}
        for f in _spec(type(self))[0]:
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value if f.dump is None else f.dump(value)
        return out

    @classmethod
    def from_wire(cls: type[M], body: Any, where: str = "") -> M:
        """Check a received map and build the message (``rid`` and ``v`` are ignored)."""
        name = where or cls.__name__
        if not isinstance(body, dict):
            raise MalformedMessage(f"{name} must be a map, got {type(body).__name__}")
        fields, known = _spec(cls)
        if not body.keys() <= known:
            unknown = [k for k in body if k not in known]
            hints = [cls.moved[k] for k in unknown if k in cls.moved]
            raise MalformedMessage(
                f"{name} has unknown fields {[str(k) for k in unknown]}; its fields are "
                f"{sorted(known - ENVELOPE_KEYS)}" + "".join(f" ({h})" for h in hints))
        kwargs = {}
        for f in fields:
            value = body.get(f.name)
            if value is not None:
                kwargs[f.name] = f.load(value, f"{where}.{f.name}" if where else f.where)
            elif f.required:
                raise MalformedMessage(f"{name} needs the field {f.name!r}")
        return cls(**kwargs)


def encode(message: Message, *, rid: int | None = None) -> bytes:
    """A framed message (with ``rid`` on a stream)."""
    return encode_message(message.to_wire(), rid=rid)


def decode(cls: type[M], raw: bytes, **limits: Any) -> M:
    """Unframe and check one message of type ``cls``."""
    return cls.from_wire(decode_message(raw, **limits))


# ---- cross-field checks ---------------------------------------------------------------------

def _check_ids(ids: WireArray, where: str, field: str = "ids") -> None:
    """Ids (and pooled lengths) travel raw, so their count is bounded by the bytes that came
    (:meth:`WireArray.from_wire` checks a raw array's bytes against its shape): every other
    array of a request is sized by them."""
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
                               f"{_show(tag)}")


def _check_rows(arr: WireArray, rows: int, what: str, named: str = "") -> None:
    if arr.ndim != 2 or arr.shape[0] != rows or arr.dtype not in _FLOATS:
        raise MalformedMessage(f"{what} must be {named}({rows}, dim) floats, got {arr.dtype} "
                               f"with shape {list(arr.shape)}")


_PARTS_MOVED = {"table": "name one table as tables=[name], counts=[len(ids)]"}


# ---- persimmon.PS ---------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class LookupRequest(Message):
    """Rows of several tables of one dim; ``codec`` encodes the reply's rows. ``read_only``:
    the shard creates no row and marks none used (an id without a row reads its initial
    row): a reader beside training, such as a prediction server."""

    moved: ClassVar[dict[str, str]] = _PARTS_MOVED
    tables: list[str] = field(metadata={"max_items": MAX_TABLES})
    counts: list[int] = field(metadata={"max_items": MAX_TABLES})
    ids: WireArray
    codec: str = "none"
    tag: list[int] | None = field(default=None, metadata={"max_items": 3})
    read_only: bool | None = None  # left off the wire unless asked
    with_state: bool | None = None  # the rows' optimizer state too (a worker's replica)

    def __post_init__(self) -> None:
        _check_parts(self.tables, self.counts, self.ids, "LookupRequest")
        _check_tag(self.tag, "LookupRequest")


@dataclass(kw_only=True, slots=True)
class LookupReply(Message):
    """Rows ``(len(ids), dim)`` in request order; with ``with_state``, each optimizer state
    array by name (``(len(ids), ...)``, request order, exact)."""

    rows: WireArray
    state: dict[str, WireArray] | None = None


@dataclass(kw_only=True, slots=True)
class PushRequest(Message):
    """Gradients of several tables of one dim: one array for all ids, or one per table."""

    moved: ClassVar[dict[str, str]] = {
        **_PARTS_MOVED, "lookup": "a push with a lookup is the PushThenLookup method"}
    client: int
    seq: int
    tables: list[str] = field(metadata={"max_items": MAX_TABLES})
    counts: list[int] = field(metadata={"max_items": MAX_TABLES})
    ids: WireArray
    grads: list[WireArray] = field(metadata={"max_items": MAX_TABLES})
    tag: list[int] | None = field(default=None, metadata={"max_items": 3})
    epoch: int | None = None  # the shard's epoch the client knows (None, 0: not given)

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


@dataclass(kw_only=True, slots=True)
class PushReply(Message):
    """Unique ids applied, dropped for NaN/Inf (their gradient, or the update it would have
    made), and not admitted (yet) by the filter."""

    applied: int
    dropped_nonfinite: int
    not_admitted: int


@dataclass(kw_only=True, slots=True)
class PushThenLookupRequest(Message):
    """A push, then a lookup that sees it; both checked before either is done."""

    push: PushRequest
    lookup: LookupRequest


@dataclass(kw_only=True, slots=True)
class PushThenLookupReply(Message):
    push: PushReply
    lookup: LookupReply


@dataclass(kw_only=True, slots=True)
class PooledLookupRequest(Message):
    """Per-sample sums of one table's rows; sample ``b`` owns the next ``lengths[b]`` ids."""

    table: str
    ids: WireArray
    lengths: WireArray
    codec: str = "none"

    def __post_init__(self) -> None:
        _check_ids(self.ids, "PooledLookupRequest")
        _check_ids(self.lengths, "PooledLookupRequest", "lengths")


@dataclass(kw_only=True, slots=True)
class PooledLookupReply(Message):
    pooled: WireArray


@dataclass(kw_only=True, slots=True)
class PooledPushRequest(Message):
    """Per-sample (pooled) gradients ``(len(lengths), dim)``, spread over each sample's ids."""

    client: int
    seq: int
    table: str
    ids: WireArray
    lengths: WireArray
    grads: WireArray
    epoch: int | None = None  # as PushRequest.epoch

    def __post_init__(self) -> None:
        _check_seq(self.seq, "PooledPushRequest")
        _check_ids(self.ids, "PooledPushRequest")
        _check_ids(self.lengths, "PooledPushRequest", "lengths")
        _check_rows(self.grads, self.lengths.shape[0], "PooledPushRequest.grads",
                    "(samples, dim) = ")


@dataclass(kw_only=True, slots=True)
class PooledPushReply(PushReply):
    pass


@dataclass(kw_only=True, slots=True)
class TablesRequest(Message):
    pass


@dataclass(kw_only=True, slots=True)
class TablesReply(Message):
    """The shard's place, its table configs and its epoch (None: a shard without epochs)."""

    shard_id: int
    num_shards: int
    tables: list[dict[str, Any]]
    epoch: int | None = None


@dataclass(kw_only=True, slots=True)
class StatsRequest(Message):
    """Statistics of one table, or of every table when ``table`` is None."""

    table: str | None = None


@dataclass(kw_only=True, slots=True)
class StatsReply(Message):
    shard_id: int
    tables: dict[str, dict[str, Any]]
    epoch: int | None = None


# ---- persimmon.Loader -----------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class BatchesRequest(Message):
    """Open rank ``rank``'s batch stream with ``credits`` batches allowed unacknowledged."""

    rank: int
    world_size: int
    credits: int


@dataclass(kw_only=True, slots=True)
class BatchesReply(Message):
    """One item of the Batches stream: ``kind`` ``"batch"`` with a batch, or ``"end"``."""

    kind: str
    batch: Batch | None = None
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.kind == "batch" and self.batch is None:
            raise MalformedMessage("a Batches item of kind 'batch' needs a batch")
        if self.kind not in ("batch", "end"):
            raise MalformedMessage(f"unexpected Batches item kind {self.kind!r}")


@dataclass(kw_only=True, slots=True)
class AckRequest(Message):
    batch_ids: list[int] = field(metadata={"max_items": MAX_ACK_IDS})


@dataclass(kw_only=True, slots=True)
class AckReply(Message):
    acked: list[int]
    unknown: list[int]


@dataclass(kw_only=True, slots=True)
class DescribeRequest(Message):
    pass


@dataclass(kw_only=True, slots=True)
class DescribeReply(Message):
    """What a worker needs to build its input layer (``world_size`` 0 until one connects)."""

    source: str
    batch_size: int
    world_size: int
    num_dense: int
    dense_features: list[str]
    sparse_features: list[str]
    multi_hot: dict[str, Any] = field(default_factory=dict)
    buckets: dict[str, Any] = field(default_factory=dict)


#: method name → (request type, reply type)
PS_METHODS: dict[str, tuple[type[Message], type[Message]]] = {
    "Lookup": (LookupRequest, LookupReply),
    "Push": (PushRequest, PushReply),
    "PushThenLookup": (PushThenLookupRequest, PushThenLookupReply),
    "PooledLookup": (PooledLookupRequest, PooledLookupReply),
    "PooledPush": (PooledPushRequest, PooledPushReply),
    "Tables": (TablesRequest, TablesReply),
    "Stats": (StatsRequest, StatsReply),
}
LOADER_METHODS: dict[str, tuple[type[Message], type[Message]]] = {
    "Batches": (BatchesRequest, BatchesReply),
    "Ack": (AckRequest, AckReply),
    "Describe": (DescribeRequest, DescribeReply),
}
