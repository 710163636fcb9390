"""The records of a PS shard's write-ahead log, typed: one msgspec Struct per kind, versioned.

A record is a msgpack map (framed by :mod:`services.ps.segments`) whose ``op`` names its kind
and ``v`` its version, :data:`WAL_VERSION`: each segment starts with a :class:`SegmentHeader`,
then holds a :class:`PushRecord` per push the shard applied and a :class:`CreateRecord`,
:class:`DropRecord` or :class:`OptimizerRecord` per table change. Arrays are
:class:`~services.common.codecs.WireArray` values sent raw (codec ``none``: the little-endian
bytes, written without a copy and read back as a view of the record).

:func:`decode_record` checks a record straight from its bytes, as the wire's messages are
checked (:mod:`services.common.messages`): a record of another version is a
:class:`FailedPrecondition` naming the field ``v``; anything else wrong (an unknown kind, a
missing, unknown or mistyped field, ids and gradients that disagree) a
:class:`MalformedMessage` naming the field. A refused record is never applied.

Version 2, the only one: the maps segments of format 2 have held (their ``v`` was the wire
protocol's version, 2, then; it is the log's own now, changed when a record's shape does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import Meta, Struct

from services.common.codecs import WireArray, decode_array, raw_array
from services.common.errors import FailedPrecondition, MalformedMessage
from services.common.messages import MAX_TABLES, OptimizerInfo, TableInfo
from services.common.wire import Text, UInt, explain
from services.ps.tables import TableConfig, table_info

__all__ = ["WAL_VERSION", "CreateRecord", "DropRecord", "OptimizerRecord", "PushPart",
           "PushRecord", "SegmentHeader", "WalRecord", "decode_record", "encode_record_into"]

WAL_VERSION = 2
PushPart = tuple[str, np.ndarray, np.ndarray]  # table, ids, float32 grads (one row per id)
_SETTINGS = frozenset(OptimizerInfo.__struct_fields__)


class WalRecord(Struct, kw_only=True, forbid_unknown_fields=True, tag_field="op"):
    """Base of every record: ``v``, its version (:data:`WAL_VERSION`)."""

    v: int


class SegmentHeader(WalRecord, tag="header"):
    """A segment's first record: the framing ``format`` (:data:`services.ps.segments.FORMAT`),
    the shard's ``epoch``, and the checkpoint its records follow (``base``; None: the shard's
    configured tables), or ``rotated``: it goes on from the segment before it."""

    format: int
    base: Text | None = None
    epoch: UInt = 0
    rotated: bool = False

    @classmethod
    def of(cls, fmt: int, base: str | None, epoch: int, *, rotated: bool = False
           ) -> SegmentHeader:
        return cls(v=WAL_VERSION, format=fmt, base=base, epoch=epoch, rotated=rotated)


class PushRecord(WalRecord, tag="push"):
    """A push the shard applied: its ``origin`` (client, seq, epoch; None: an in-process push
    without one), its fingerprint ``fp`` (:func:`services.ps.dedup.fingerprint`) and, per
    table, the ids and their float32 gradients."""

    origin: tuple[UInt, UInt, UInt] | None
    fp: UInt
    parts: Annotated[list[tuple[Text, WireArray, WireArray]],
                     Meta(min_length=1, max_length=MAX_TABLES)]

    def __post_init__(self) -> None:
        for i, (_, ids, grads) in enumerate(self.parts):
            if ids.codec != "none" or ids.dtype != "uint64" or ids.ndim != 1:
                raise MalformedMessage(
                    f"PushRecord.parts[{i}][1] (ids) must be a raw 1-d uint64 array, got "
                    f"{ids.dtype} with shape {list(ids.shape)} and codec {ids.codec!r}")
            if (grads.codec != "none" or grads.dtype != "float32" or grads.ndim != 2
                    or grads.shape[0] != ids.shape[0]):
                raise MalformedMessage(
                    f"PushRecord.parts[{i}][2] (grads) must be raw float32 rows, one per id "
                    f"({ids.shape[0]}, dim), got {grads.dtype} with shape {list(grads.shape)} "
                    f"and codec {grads.codec!r}")

    @classmethod
    def of(cls, origin: tuple[int, int, int] | None, fp: int, parts: Sequence[PushPart]
           ) -> PushRecord:
        return cls(v=WAL_VERSION, origin=origin, fp=fp,
                   parts=[(name, raw_array(ids), raw_array(grads)) for name, ids, grads in parts])

    def arrays(self) -> list[PushPart]:
        """The parts as arrays (views of the record's bytes)."""
        return [(name, decode_array(ids, "PushRecord ids"),
                 decode_array(grads, "PushRecord grads")) for name, ids, grads in self.parts]


class CreateRecord(WalRecord, tag="create"):
    """A table created, with its config."""

    config: TableInfo

    @classmethod
    def of(cls, config: TableConfig) -> CreateRecord:
        return cls(v=WAL_VERSION, config=table_info(config))


class DropRecord(WalRecord, tag="drop"):
    """A table dropped."""

    table: Text

    @classmethod
    def of(cls, table: str) -> DropRecord:
        return cls(v=WAL_VERSION, table=table)


class OptimizerRecord(WalRecord, tag="optimizer"):
    """A table's optimizer settings changed: ``changes`` by setting name (those of
    :class:`~services.common.messages.OptimizerInfo`)."""

    table: Text
    changes: Annotated[dict[Text, float | Text | None], Meta(min_length=1, max_length=64)]

    def __post_init__(self) -> None:
        unknown = sorted(set(self.changes) - _SETTINGS)
        if unknown:
            raise MalformedMessage(f"OptimizerRecord.changes names unknown settings {unknown}; "
                                   f"the settings are {sorted(_SETTINGS)}")

    @classmethod
    def of(cls, table: str, changes: dict[str, Any]) -> OptimizerRecord:
        return cls(v=WAL_VERSION, table=table, changes=changes)


AnyRecord = SegmentHeader | PushRecord | CreateRecord | DropRecord | OptimizerRecord
_KINDS: dict[Any, str] = {cls.__struct_config__.tag: cls.__name__
                          for cls in (SegmentHeader, PushRecord, CreateRecord, DropRecord,
                                      OptimizerRecord)}
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(AnyRecord)


class _Peek(Struct):
    """A record's kind and version alone (every other field skipped)."""

    op: Any = None
    v: Any = None


_PEEK = msgspec.msgpack.Decoder(_Peek)


def encode_record_into(record: WalRecord, buffer: bytearray, offset: int) -> None:
    """Write ``record`` into ``buffer`` from ``offset`` on (arrays copied once, there)."""
    _ENCODER.encode_into(record, buffer, offset)


def decode_record(payload: bytes | memoryview) -> AnyRecord:
    """The record in ``payload``, checked; FailedPrecondition for another version,
    MalformedMessage naming the field for anything else wrong."""
    try:
        record = _DECODER.decode(payload)
    except msgspec.ValidationError as exc:
        where = _check_version(payload)
        raise MalformedMessage(explain(exc, where)) from exc
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"a WAL record must be a msgpack map ({exc})") from exc
    except MalformedMessage:
        _check_version(payload)
        raise
    if record.v != WAL_VERSION:
        raise _version_error(record.v)
    return record


def _check_version(payload: bytes | memoryview) -> str:
    """Raise the version's error if the record names another; else the record's class name
    by its kind (``WalRecord`` when it names none that is known)."""
    try:
        peek = _PEEK.decode(payload)
    except msgspec.DecodeError:
        return "WalRecord"
    if peek.v != WAL_VERSION:
        raise _version_error(peek.v)
    return _KINDS.get(peek.op, "WalRecord") if isinstance(peek.op, str) else "WalRecord"


def _version_error(version: Any) -> FailedPrecondition:
    said = "names no version (field v)" if version is None else \
        f"is of version {version!r} (field v)"
    return FailedPrecondition(f"a WAL record {said}; this release reads version {WAL_VERSION}: "
                              "recover the log with the release that wrote it and take a "
                              "checkpoint, or move the log aside")
