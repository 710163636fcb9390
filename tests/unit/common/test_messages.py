"""Typed wire messages: round trips of every method's request and reply, and clear errors for
missing fields, wrong types, unknown fields, oversized lists and fields that disagree."""

from __future__ import annotations

import pickle
import typing

import msgpack
import msgspec
import numpy as np
import pytest

from services.common import messages as m
from services.common.batch import Batch, Jagged
from services.common.codecs import WireArray, decode_array, get_codec, raw_array
from services.common.config import config_to_dict
from services.common.errors import Internal, MalformedMessage, ProtocolMismatch, StaleEpoch
from services.common.wire import Record, decode_message, encode_message
from services.ps.tables import TableConfig

IDS = np.array([3, 9, 12], dtype=np.uint64)


def _lookup() -> m.LookupRequest:
    return m.LookupRequest(tables=["user", "item"], counts=[2, 1], ids=raw_array(IDS),
                           codec="fp16")


def _push() -> m.PushRequest:
    return m.PushRequest(client=7, seq=1, tables=["user"], counts=[3], ids=raw_array(IDS),
                         grads=[raw_array(np.ones((3, 4), np.float32))])


def _batch() -> Batch:
    return Batch(batch_id=7, labels=np.ones(2, np.float32), dense=np.zeros((2, 3), np.float32),
                 sparse={"c1": Jagged(np.arange(3, dtype=np.uint64),
                                      np.array([1, 2], np.int32))}, positions={"p": (1, 2)})


def _table() -> m.TableInfo:
    return msgspec.convert(config_to_dict(TableConfig(name="user", dim=4)), m.TableInfo)


def _stats() -> m.TableStats:
    return m.TableStats(**dict.fromkeys(m.TableStats.__struct_fields__, 0) | {"name": "user"})


SAMPLES: dict[type[m.Message], m.Message] = {
    m.LookupRequest: _lookup(),
    m.LookupReply: m.LookupReply(rows=get_codec("bf16").to_wire(np.ones((3, 4), np.float32))),
    m.PushRequest: _push(),
    m.PushReply: m.PushReply(applied=3, dropped_nonfinite=1, not_admitted=0),
    m.PushThenLookupRequest: m.PushThenLookupRequest(push=_push(), lookup=_lookup()),
    m.PushThenLookupReply: m.PushThenLookupReply(
        push=m.PushReply(applied=1, dropped_nonfinite=0, not_admitted=2),
        lookup=m.LookupReply(rows=raw_array(np.ones((3, 4), np.float32)))),
    m.PooledLookupRequest: m.PooledLookupRequest(table="user", ids=raw_array(IDS),
                                                 lengths=raw_array(np.array([1, 2]))),
    m.PooledLookupReply: m.PooledLookupReply(pooled=raw_array(np.ones((2, 4), np.float32))),
    m.PooledPushRequest: m.PooledPushRequest(client=7, seq=1, table="user", ids=raw_array(IDS),
                                             lengths=raw_array(np.array([1, 2])),
                                             grads=raw_array(np.ones((2, 4), np.float32))),
    m.PooledPushReply: m.PooledPushReply(applied=3, dropped_nonfinite=0, not_admitted=0),
    m.TablesRequest: m.TablesRequest(),
    m.TablesReply: m.TablesReply(shard_id=1, num_shards=2, tables=[_table()]),
    m.StatsRequest: m.StatsRequest(table="user"),
    m.StatsReply: m.StatsReply(shard_id=0, tables={"user": _stats()}),
    m.BatchesRequest: m.BatchesRequest(rank=1, world_size=2, credits=8),
    m.BatchItem: m.BatchItem(batch=m.BatchBody.of(_batch())),
    m.BatchesEnd: m.BatchesEnd(rank=1),
    m.ErrorReply: m.ErrorReply(error=m.ErrorBody(error="NotFound", code="NOT_FOUND",
                                                 message="no table 'x'")),
    m.AckRequest: m.AckRequest(batch_ids=[1, 5]),
    m.AckReply: m.AckReply(acked=[1], unknown=[5]),
    m.DescribeRequest: m.DescribeRequest(),
    m.DescribeReply: m.DescribeReply(source="synthetic:10", batch_size=4, world_size=0,
                                     num_dense=3, dense_features=["d0"],
                                     sparse_features=["c1"], multi_hot={}, buckets={"c1": 9}),
}


def _same(a, b) -> bool:
    """Equal messages: arrays compared by decoded value."""
    if isinstance(a, m.Message | m.BatchBody):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f))
                                          for f in a.__struct_fields__ if f not in ("v", "rid"))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "codec") and hasattr(a, "data"):
        return a.codec == b.codec and np.array_equal(decode_array(a), decode_array(b))
    return a == b


def test_every_method_has_a_sample_and_a_struct_per_request_and_reply():
    for request, reply in [*m.PS_METHODS.values(), *m.LOADER_METHODS.values()]:
        for cls in (request, *(typing.get_args(reply) or (reply,))):
            assert cls in SAMPLES
            assert issubclass(cls, msgspec.Struct) and not hasattr(SAMPLES[cls], "__dict__")
    assert "PushThenLookup" in m.PS_METHODS


def test_no_message_field_is_an_untyped_map():
    """Every field of every message names its types: no ``Any`` below a message."""
    for cls in SAMPLES:
        for info in msgspec.inspect.type_info(cls).fields:
            if info.name not in ("v", "rid"):
                assert "AnyType" not in repr(info.type), (cls.__name__, info.name)


def _structs_below(types: typing.Iterable[typing.Any]) -> set[type]:
    """Every Struct class the types hold, at any depth."""
    found: set[type] = set()
    todo: list[typing.Any] = list(msgspec.inspect.multi_type_info(list(types)))
    while todo:
        t = todo.pop()
        if isinstance(t, msgspec.inspect.StructType):
            if t.cls not in found:
                found.add(t.cls)
                todo.extend(f.type for f in t.fields)
            continue
        for attr in ("type", "item_type", "key_type", "value_type"):
            if hasattr(t, attr):
                todo.append(getattr(t, attr))
        todo.extend(getattr(t, "types", ()) or getattr(t, "item_types", ()))
    return found


def test_every_struct_of_the_protocol_is_a_record():
    """One base config (services.common.wire.Record) for messages and what they nest:
    unknown fields refused everywhere."""
    structs = _structs_below(SAMPLES)
    assert {m.BatchBody, m.JaggedBody, m.ErrorBody, m.TableInfo, m.TableStats,
            WireArray} <= structs
    for cls in structs:
        assert issubclass(cls, Record), cls
        assert cls.__struct_config__.forbid_unknown_fields, cls


def test_the_batches_stream_items_are_told_apart_by_kind():
    raw = m.encode(m.BatchItem(batch=m.BatchBody.of(_batch())))
    assert msgpack.unpackb(raw)["kind"] == "batch"
    item = m.decode(m.BatchesReply, raw)
    assert isinstance(item, m.BatchItem)
    back = item.batch.to_batch()
    assert back.batch_id == 7 and back.positions == {"p": (1, 2)}
    np.testing.assert_array_equal(back.sparse["c1"].lengths, [1, 2])
    assert isinstance(m.decode(m.BatchesReply, m.encode(m.BatchesEnd(rank=3))), m.BatchesEnd)
    bad = msgpack.packb({"v": 2, "kind": "more", "rank": 1})
    with pytest.raises(MalformedMessage, match="kind"):
        m.decode(m.BatchesReply, bad)


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
def test_round_trip_through_a_frame(cls):
    sent = SAMPLES[cls]
    raw = m.encode(sent, rid=11)
    body = decode_message(raw)
    assert body["rid"] == 11
    got = cls.from_wire(body)
    assert _same(sent, got), (sent, got)
    assert _same(got, m.decode(cls, raw))


def test_decoded_arrays_are_views_of_the_received_buffer():
    raw = m.encode(_push())
    got = m.decode(m.PushRequest, raw)
    grads = decode_array(got.grads[0])
    assert not grads.flags.owndata and grads.shape == (3, 4)


@pytest.mark.parametrize("cls", [c for c in SAMPLES if any(
    f.required for f in msgspec.inspect.type_info(c).fields)],
                         ids=lambda c: c.__name__)
def test_every_required_field_is_required(cls):
    body = SAMPLES[cls].to_wire()
    required = [f.name for f in msgspec.inspect.type_info(cls).fields if f.required]
    for name in required:
        with pytest.raises(MalformedMessage, match=f"needs the field '{name}'"):
            cls.from_wire({k: v for k, v in body.items() if k != name})
        with pytest.raises(MalformedMessage, match=f"needs the field '{name}'"):
            m.decode(cls, msgpack.packb({"v": 2, **{k: v for k, v in body.items() if k != name}}))


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
def test_unknown_fields_and_non_maps_are_refused(cls):
    with pytest.raises(MalformedMessage, match="unknown fields \\['bogus'\\]"):
        cls.from_wire({**SAMPLES[cls].to_wire(), "bogus": 1})
    with pytest.raises(MalformedMessage, match="must be a map"):
        cls.from_wire([1, 2])


@pytest.mark.parametrize(("cls", "field", "value", "match"), [
    (m.LookupRequest, "tables", "user", "LookupRequest.tables: Expected `array`"),
    (m.LookupRequest, "tables", [1], "LookupRequest.tables\\[0\\]: Expected `str`"),
    (m.LookupRequest, "counts", [2, -1], "LookupRequest.counts\\[1\\]: Expected `int` >= 0"),
    (m.LookupRequest, "counts", [True, 2], "LookupRequest.counts\\[0\\]: Expected `int`"),
    (m.LookupRequest, "codec", 5, "LookupRequest.codec: Expected `str`"),
    (m.LookupRequest, "ids", {"dtype": "uint64"}, "LookupRequest.ids needs the field 'shape'"),
    (m.LookupRequest, "tag", [0, 1], "LookupRequest.tag: Expected `array` of length >= 3"),
    (m.PushRequest, "grads", {"dtype": "float32"}, "PushRequest.grads: Expected `array`"),
    (m.PushReply, "applied", 1.5, "PushReply.applied: Expected `int`"),
    (m.StatsRequest, "table", "x" * 5000, "StatsRequest.table: Expected `str` of length <= 4096"),
    (m.StatsReply, "tables", {"user": [1]}, "StatsReply.tables\\[...\\] must be a map"),
    (m.AckRequest, "batch_ids", list(range(m.MAX_ACK_IDS + 1)), "length <= 100000"),
    (m.AckRequest, "batch_ids", [-1], "AckRequest.batch_ids\\[0\\]: Expected `int` >= 0"),
    (m.BatchesRequest, "rank", "0", "BatchesRequest.rank: Expected `int`"),
    (m.BatchItem, "batch", {"batch_id": 1}, "BatchItem.batch needs the field"),
    (m.TablesReply, "tables", [{"name": "t", "dim": 0}], "TablesReply.tables\\[0\\]"),
])
def test_wrong_types_are_malformed(cls, field, value, match):
    body = {**SAMPLES[cls].to_wire(), field: value}
    with pytest.raises(MalformedMessage, match=match):
        cls.from_wire(body)
    with pytest.raises(MalformedMessage, match=match):  # straight from a frame: the same
        m.decode(cls, msgpack.packb({**body, "v": 2}))


@pytest.mark.parametrize(("change", "match"), [
    ({"counts": [2]}, "1 counts for 2 tables"),
    ({"counts": [2, 2]}, "add up to 4 but there are 3 ids"),
    ({"tables": [], "counts": []}, "at least one table"),
    ({"ids": raw_array(IDS.astype(np.int64)).to_wire()}, "1-d uint64"),
    ({"ids": raw_array(IDS.reshape(3, 1)).to_wire()}, "1-d uint64"),
])
def test_lookup_fields_that_disagree(change, match):
    with pytest.raises(MalformedMessage, match=match):
        m.LookupRequest.from_wire({**_lookup().to_wire(), **change})


@pytest.mark.parametrize(("grads", "match"), [
    ([], "holds 0 arrays"),
    ([np.ones((4, 4))], "must be \\(3, dim\\)"),
    ([np.ones(3)], "must be \\(3, dim\\)"),
    ([np.ones((1, 4)), np.ones((2, 4))], "holds 2 arrays"),
])
def test_push_gradients_must_match_the_ids(grads, match):
    body = {**_push().to_wire(), "grads": [raw_array(g.astype(np.float32)).to_wire()
                                           for g in grads]}
    with pytest.raises(MalformedMessage, match=match):
        m.PushRequest.from_wire(body)


def test_per_table_gradients_match_each_count():
    body = {**_push().to_wire(), "tables": ["a", "b"], "counts": [1, 2],
            "grads": [raw_array(np.ones((1, 4), np.float32)).to_wire(),
                      raw_array(np.ones((2, 4), np.float32)).to_wire()]}
    assert len(m.PushRequest.from_wire(body).grads) == 2
    body["grads"] = body["grads"][::-1]
    with pytest.raises(MalformedMessage, match="grads\\[0\\] must be \\(1, dim\\)"):
        m.PushRequest.from_wire(body)


def test_old_shapes_get_a_hint_where_their_content_went():
    v1_push = {"table": "user", "ids": raw_array(IDS).to_wire(),
               "grads": raw_array(np.ones((3, 4), np.float32)).to_wire()}
    with pytest.raises(MalformedMessage, match="tables=\\[name\\]"):
        m.PushRequest.from_wire(v1_push)
    with pytest.raises(MalformedMessage, match="PushThenLookup method"):
        m.PushRequest.from_wire({**_push().to_wire(), "lookup": _lookup().to_wire()})
    with pytest.raises(ProtocolMismatch, match="version 1"):
        m.decode(m.PushRequest, msgpack.packb({**v1_push, "v": 1}, use_bin_type=True))


def test_nested_errors_name_their_place():
    body = m.PushThenLookupRequest(push=_push(), lookup=_lookup()).to_wire()
    body["lookup"]["counts"] = [9, 9]
    with pytest.raises(MalformedMessage, match="add up to 18"):
        m.PushThenLookupRequest.from_wire(body)
    body["lookup"] = {"tables": ["user"]}
    with pytest.raises(MalformedMessage, match="PushThenLookupRequest.lookup needs the field"):
        m.PushThenLookupRequest.from_wire(body)


def test_optional_fields_are_left_out_and_null_means_absent():
    assert m.StatsRequest().to_wire() == {}
    assert m.StatsRequest.from_wire({"table": None}).table is None
    assert m.BatchesEnd(rank=1).to_wire() == {"kind": "end", "rank": 1}
    with pytest.raises(MalformedMessage, match="LookupRequest.tables: Expected `array`, got `null`"):
        m.LookupRequest.from_wire({**_lookup().to_wire(), "tables": None})


def test_an_error_reply_is_read_back_as_its_error_on_the_map_it_always_was():
    sent = m.ErrorReply(error=m.ErrorBody.of(StaleEpoch("restored since")))
    raw = m.encode(sent, rid=3)
    assert msgpack.unpackb(raw) == {"v": 2, "rid": 3, "error": {
        "error": "StaleEpoch", "code": "FAILED_PRECONDITION", "message": "restored since"}}
    envelope = m.Envelope.of(raw)
    error = envelope.exception()
    assert envelope.rid == 3 and type(error) is StaleEpoch and error.message == "restored since"
    assert m.Envelope.of(m.encode(m.AckReply(acked=[1], unknown=[]), rid=4)).exception() is None
    assert m.Envelope.of(encode_message({"error": None}, rid=5)).exception() is None


@pytest.mark.parametrize(("error", "match"), [
    ("junk", "got `str`"),
    ({"error": "NotFound", "message": "m"}, "missing required field `code`"),
    ({"error": "NotFound", "code": "NOT_FOUND", "message": 7}, "Expected `str`, got `int`"),
    ({"error": "x" * 5000, "code": "NOT_FOUND", "message": "m"}, "length <= 4096"),
    ({"error": "NotFound", "code": "NOT_FOUND", "message": "m", "why": 1}, "unknown field"),
])
def test_an_unreadable_error_fails_its_request_as_internal_not_the_stream(error, match):
    """A peer's error reply that is no ErrorBody: the frame's envelope is read (its rid still
    names the request to fail) and the error is Internal saying what is wrong."""
    envelope = m.Envelope.of(encode_message({"error": error}, rid=6))
    failure = envelope.exception()
    assert envelope.rid == 6 and type(failure) is Internal
    assert "unreadable error reply" in failure.message and match in failure.message


def test_frames_pack_messages_and_arrays_inside_plain_maps():
    raw = encode_message({"push": _push(), "a": raw_array(IDS)})
    body = decode_message(raw)
    assert m.PushRequest.from_wire(body["push"]).tables == ["user"]
    np.testing.assert_array_equal(decode_array(body["a"]), IDS)


def test_a_default_made_elsewhere_is_left_out_as_the_default_is():
    """msgspec leaves a scalar default out only when it is the default object; a value equal
    to it that was made elsewhere (unpickled in the PS client process, read from a flag) must
    give the same frame, nested messages included."""
    made_elsewhere = pickle.loads(pickle.dumps("none"))
    default = next(f.default for f in msgspec.structs.fields(m.LookupRequest)
                   if f.name == "codec")
    assert made_elsewhere == default and made_elsewhere is not default
    here = msgspec.structs.replace(_lookup(), codec="none")
    there = msgspec.structs.replace(_lookup(), codec=made_elsewhere)
    assert m.encode(there, rid=4) == m.encode(here, rid=4)
    assert "codec" not in there.to_wire() and there.codec is made_elsewhere  # not changed
    assert (m.encode(m.PushThenLookupRequest(push=_push(), lookup=there))
            == m.encode(m.PushThenLookupRequest(push=_push(), lookup=here)))
    pooled = {"table": "user", "ids": raw_array(IDS), "lengths": raw_array(IDS)}
    assert (m.encode(m.PooledLookupRequest(**pooled, codec=made_elsewhere))
            == m.encode(m.PooledLookupRequest(**pooled)))
