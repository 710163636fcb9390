"""The write-ahead log's records are typed and versioned (services/ps/wal_records.py): a real
Shard logs typed records and a fresh one recovers them; a record of another version, or one
that is malformed, is refused naming its field and never applied (nothing is cut); a torn or
garbled record at the tail is still cut off as a torn tail; a log written before the records
were typed (the same maps) still recovers."""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from services.common.codecs import raw_array
from services.common.config import config_to_dict
from services.common.errors import FailedPrecondition
from services.common.wire import encode_message
from services.ps.config import PSConfig
from services.ps.dedup import PushOrigin
from services.ps.segments import frame
from services.ps.shard import Shard
from services.ps.wal_records import (
    WAL_VERSION,
    CreateRecord,
    DropRecord,
    OptimizerRecord,
    PushRecord,
    SegmentHeader,
    WalRecord,
    decode_record,
)
from tests.unit.ps.counting import applied_counts, count_grads, counting_table

IDS = np.arange(10, dtype=np.uint64)
LATE = np.arange(100, 104, dtype=np.uint64)  # ids only a refused record pushes
_OPEN: list[Shard] = []


@pytest.fixture(autouse=True)
def _close_shards() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def make_shard(tmp_path) -> Shard:
    shard = Shard(PSConfig(tables=[counting_table("count")], wal_dir=str(tmp_path / "wal"),
                           checkpoint_dir=str(tmp_path / "ckpt")))
    _OPEN.append(shard)
    return shard


def started(tmp_path) -> Shard:
    shard = make_shard(tmp_path)
    asyncio.run(shard.recover())
    return shard


def push(shard: Shard, seq: int, ids: np.ndarray = IDS) -> None:
    shard.push_many_sync(["count"], [ids.size], ids, count_grads(ids.size),
                         origin=PushOrigin(7, seq))


def counts(shard: Shard, ids: np.ndarray = IDS) -> list[int]:
    rows, present = shard.table("count").peek(ids)
    return applied_counts(np.where(present[:, None], rows, 0)).astype(int).tolist()


def segment(tmp_path):
    (path,) = (tmp_path / "wal" / "shard-0-of-1").glob("*.wal")
    return path


def late_push(v: int = WAL_VERSION) -> PushRecord:
    """A well-formed push of ``LATE`` (of version ``v``)."""
    return PushRecord(v=v, origin=(7, 50, 0), fp=1,
                      parts=[("count", raw_array(LATE), raw_array(count_grads(LATE.size)))])


class FuturePush(WalRecord, tag="push"):
    """A push as a later version might write it: another shape."""

    rows: list[int]


class NumberedDrop(WalRecord, tag="drop"):
    table: int


class DropWithMore(WalRecord, tag="drop"):
    table: str
    reason: str


class Mystery(WalRecord, tag="mystery"):
    pass


def test_a_shard_logs_typed_records_and_they_round_trip(tmp_path):
    shard = started(tmp_path)
    shard.create_table(counting_table("new"))
    shard.set_optimizer("new", {"lr": 2.0})
    push(shard, 1)
    shard.drop_table("new")
    assert shard.wal is not None
    base, records = shard.wal.read()
    create, optimizer, pushed, drop = records
    assert base is None and isinstance(create, CreateRecord) and create.config.name == "new"
    assert create.config.optimizer.kind == "sgd"
    assert optimizer == OptimizerRecord.of("new", {"lr": 2.0}) and drop == DropRecord.of("new")
    assert isinstance(pushed, PushRecord) and pushed.origin == (7, 1, 0) and pushed.v == 2
    ((name, ids, grads),) = pushed.arrays()
    assert name == "count" and ids.tolist() == IDS.tolist()
    assert grads.dtype == np.float32 and grads.tolist() == count_grads(IDS.size).tolist()
    header = SegmentHeader.of(2, "c1", 3, rotated=True)
    assert decode_record(bytes(frame(header))[12:]) == header


@pytest.mark.parametrize("where", ["tail", "middle"])
@pytest.mark.parametrize("record", [late_push(v=3), FuturePush(v=3, rows=[1])],
                         ids=["same-shape", "another-shape"])
def test_a_record_of_another_version_is_refused_and_never_applied(tmp_path, where, record):
    """Whatever shape a record of version 3 has, recovery stops at it naming the field v and
    the byte it starts at; neither it nor anything after it is applied, nothing is cut."""
    shard = started(tmp_path)
    push(shard, 1)
    assert shard.wal is not None
    at = segment(tmp_path).stat().st_size
    shard.wal.append(record)
    if where == "middle":
        push(shard, 2)
    size = segment(tmp_path).stat().st_size
    again = make_shard(tmp_path)
    with pytest.raises(FailedPrecondition, match=f"record at byte {at}: a WAL record is of "
                                                 r"version 3 \(field v\); this release reads "
                                                 "version 2"):
        asyncio.run(again.recover())
    assert counts(again) == [1] * 10 and counts(again, LATE) == [0] * 4
    assert segment(tmp_path).stat().st_size == size


@pytest.mark.parametrize("record, field", [
    ("grads", r"PushRecord.parts\[0\]\[2\] \(grads\) must be raw float32 rows, one per id "
              r"\(4, dim\), got float32 with shape \[3, 2\]"),
    ("ids", r"PushRecord.parts\[0\]\[1\] \(ids\) must be a raw 1-d uint64 array, got int64"),
    (NumberedDrop(v=2, table=3), "DropRecord.table: Expected `str`, got `int`"),
    (DropWithMore(v=2, table="count", reason="x"), r"DropRecord has unknown fields \['reason'\]"),
    (Mystery(v=2), "WalRecord.op: Invalid value 'mystery'"),
    (OptimizerRecord(v=2, table="count", changes={"lr": 1.0}), None),  # made bad below
], ids=["grads", "ids", "mistyped", "unknown-field", "unknown-kind", "unknown-setting"])
def test_a_malformed_record_is_refused_naming_its_field(tmp_path, record, field):
    """A record that passes its CRC but not its type, last in the log: corruption naming the
    field (not a torn tail: it was written whole), nothing applied, nothing cut."""
    if record == "grads":
        record = late_push()
        record.parts = [("count", raw_array(LATE), raw_array(count_grads(3)))]
    elif record == "ids":
        record = late_push()
        record.parts = [("count", raw_array(LATE.astype(np.int64)),
                         raw_array(count_grads(LATE.size)))]
    elif isinstance(record, OptimizerRecord):
        record.changes = {"lr": 1.0, "speed": 2.0}
        field = r"OptimizerRecord.changes names unknown settings \['speed'\]"
    shard = started(tmp_path)
    push(shard, 1)
    assert shard.wal is not None
    at = segment(tmp_path).stat().st_size
    shard.wal.append(record)
    size = segment(tmp_path).stat().st_size
    again = make_shard(tmp_path)
    with pytest.raises(FailedPrecondition, match=f"corrupt at byte {at} of {size}: it passes "
                                                 f"its CRC but is not a well-formed record: "
                                                 f"{field}"):
        asyncio.run(again.recover())
    assert counts(again) == [1] * 10 and counts(again, LATE) == [0] * 4
    assert segment(tmp_path).stat().st_size == size


@pytest.mark.parametrize("damage", ["cut in its arrays", "a payload byte flipped",
                                    "its frame head cut short"])
def test_a_torn_or_garbled_typed_record_at_the_tail_is_cut_and_the_log_goes_on(tmp_path,
                                                                                damage):
    shard = started(tmp_path)
    push(shard, 1)
    good = segment(tmp_path).stat().st_size
    push(shard, 2, LATE)
    path = segment(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "cut in its arrays":
        data = data[:-20]
    elif damage == "a payload byte flipped":
        data[good + 40] ^= 0xFF
    else:
        data = data[:good + 7]
    path.write_bytes(bytes(data))
    again = make_shard(tmp_path)
    got = asyncio.run(again.recover())
    assert got == {"pushes": 1, "skipped": 0, "changes": 0, "dropped_bytes": len(data) - good}
    assert path.stat().st_size == good
    assert counts(again) == [1] * 10 and counts(again, LATE) == [0] * 4
    push(again, 2, LATE)  # the unacked push, retried, goes after the good records
    third = make_shard(tmp_path)
    asyncio.run(third.recover())
    assert counts(third) == [1] * 10 and counts(third, LATE) == [1] * 4


def _old_frame(body: dict) -> bytes:
    """A record as the log wrote it before its records were typed: a msgpack map through the
    wire's encoder (which put the protocol version, 2, in ``v``), framed."""
    payload = encode_message(body)
    head = zlib.crc32(struct.pack("<I", len(payload)))
    return struct.pack("<III", len(payload), head, zlib.crc32(payload, head)) + payload


def test_a_log_written_before_the_records_were_typed_recovers(tmp_path):
    """Version 2 is the maps format-2 segments held: a log of them, every kind, still comes
    back exactly (a change to a record's shape must move WAL_VERSION on, or this fails)."""
    directory = tmp_path / "wal" / "shard-0-of-1"
    directory.mkdir(parents=True)
    created = counting_table("new")
    ids = IDS[:4]
    records = [
        {"op": "header", "format": 2, "base": None, "epoch": 1},
        {"op": "create", "config": config_to_dict(created)},
        {"op": "optimizer", "table": "new", "changes": {"lr": 3.0}},
        {"op": "push", "origin": [7, 1, 0], "fp": 5, "parts": [
            ["new", raw_array(ids).to_wire(), raw_array(count_grads(ids.size)).to_wire()],
            ["count", raw_array(ids).to_wire(), raw_array(count_grads(ids.size)).to_wire()]]},
        {"op": "push", "origin": None, "fp": 0, "parts": [
            ["count", raw_array(ids).to_wire(), raw_array(count_grads(ids.size)).to_wire()]]},
        {"op": "create", "config": config_to_dict(counting_table("gone"))},
        {"op": "drop", "table": "gone"},
    ]
    assert msgpack.unpackb(encode_message(records[2]))["v"] == 2
    (directory / f"{1:012d}.wal").write_bytes(b"".join(_old_frame(r) for r in records))
    shard = make_shard(tmp_path)
    got = asyncio.run(shard.recover())
    assert got == {"pushes": 2, "skipped": 0, "changes": 4, "dropped_bytes": 0}
    assert sorted(shard.tables) == ["count", "new"] and shard.epoch == 1
    assert shard.table("new").config.optimizer.lr == 3.0
    rows, _ = shard.table("new").peek(ids)
    assert applied_counts(rows).astype(int).tolist() == [3] * 4  # lr 3, one push
    assert counts(shard, ids) == [2] * 4
    push(shard, 2)  # and it goes on, typed, after the old records
    assert counts(shard) == [3] * 4 + [1] * 6


def test_the_log_takes_typed_records_only(tmp_path):
    """A map would be written and then refused by every recovery: refused when appended."""
    shard = started(tmp_path)
    size = segment(tmp_path).stat().st_size
    assert shard.wal is not None
    with pytest.raises(TypeError, match="typed records, got dict"):
        shard.wal.append({"op": "drop", "table": "count"})  # type: ignore[arg-type]
    assert segment(tmp_path).stat().st_size == size
