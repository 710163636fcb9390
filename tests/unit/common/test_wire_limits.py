"""A frame's sizes are bounded before anything is built from it (issue 45, finding 1).

The frame walk (:func:`services.common.wire.count_objects`) counts exactly what msgpack
would build and refuses a frame declaring more objects than the receiver allows, before
msgpack builds any; raw arrays' bytes are checked against their shapes; a request's ids and
pooled lengths travel raw, gradients are floats sized by them, and step tags are bounded.
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest

from services.common.codecs import WireArray, get_codec, raw_array
from services.common.errors import InvalidArgument, MalformedMessage
from services.common.messages import (
    MAX_WORKERS,
    PS_REQUEST_OBJECTS,
    LookupRequest,
    PooledPushRequest,
    PushRequest,
    encode,
)
from services.common.wire import PROTOCOL_VERSION, count_objects, decode_message


def objects(value) -> int:
    """What msgpack builds from ``value``: one object each, a map's keys and values too."""
    if isinstance(value, dict):
        return 1 + sum(objects(k) + objects(v) for k, v in value.items())
    if isinstance(value, list):
        return 1 + sum(objects(v) for v in value)
    return 1


def ids(n: int = 3) -> WireArray:
    return raw_array(np.arange(n, dtype=np.uint64))


HONEST = [
    PushRequest(client=1, seq=1, tables=[f"t{i}" for i in range(26)], counts=[1] * 26,
                ids=ids(26), grads=[get_codec("topk", keep=0.1).to_wire(
                    np.ones((1, 8), np.float32)) for _ in range(26)], tag=[3, 70_000, 8]),
    LookupRequest(tables=["a", "b"], counts=[1, 2], ids=ids(), codec="fp16"),
]


@pytest.mark.parametrize("message", HONEST, ids=["push", "lookup"])
def test_the_walk_counts_what_msgpack_builds(message):
    frame = encode(message, rid=5)
    assert count_objects(frame, PS_REQUEST_OBJECTS) == objects(msgpack.unpackb(frame))


def test_the_walk_counts_every_msgpack_type():
    value = {"v": PROTOCOL_VERSION, "n": [None, True, False, 1, -1, 300, -300, 70_000, 2**40,
                                          -(2**40), 1.5, "x" * 40, "y" * 300, b"z" * 70_000,
                                          msgpack.ExtType(1, b"e" * 300), {"k": [[], {}]}]}
    frame = msgpack.packb(value, use_bin_type=True)
    assert count_objects(frame, 1000) == objects(msgpack.unpackb(frame, raw=False))


@pytest.mark.parametrize("frame", [
    b"\x82\xa1v\x02\xa1x\xdd" + struct.pack(">I", 2**32 - 1),  # declares 4G items, holds none
    msgpack.packb({"v": PROTOCOL_VERSION, "x": [[]] * 100_000}),
    msgpack.packb({"v": PROTOCOL_VERSION, "x": [{}] * 70_000}),
], ids=["declared", "empty-arrays", "empty-maps"])
def test_a_frame_declaring_too_many_objects_is_refused_before_decoding(frame):
    frame += b"\x00" * 4096 if len(frame) < 4096 else b""  # past SCAN_FROM
    with pytest.raises(InvalidArgument, match="more than 65536 msgpack objects"):
        decode_message(frame, max_objects=65536)


def test_msgpack_limits_come_from_the_frame_size():
    """A string or binary cannot claim more bytes than the frame holds."""
    frame = b"\x82\xa1v\x02\xa1x\xc6" + struct.pack(">I", 2**31) + b"\x00" * 10
    with pytest.raises(MalformedMessage, match="msgpack"):
        decode_message(frame)


def test_a_raw_array_must_carry_the_bytes_its_shape_declares():
    body = raw_array(np.arange(4, dtype=np.float32)).to_wire()
    with pytest.raises(MalformedMessage, match="needs 4294967296 bytes, got 16"):
        WireArray.from_wire({**body, "shape": [2**30]}, "grads")


def test_ids_must_travel_raw():
    zipped = get_codec("none+zstd").to_wire(np.arange(3, dtype=np.uint64))
    with pytest.raises(MalformedMessage, match=r"LookupRequest\.ids .*raw \(codec none\)"):
        LookupRequest(tables=["a"], counts=[3], ids=zipped)


def test_gradients_must_be_floats():
    with pytest.raises(MalformedMessage, match=r"PushRequest\.grads\[0\] must be \(3, dim\)"):
        PushRequest(client=1, seq=1, tables=["a"], counts=[3], ids=ids(),
                    grads=[raw_array(np.ones((3, 4), np.int64))])


def test_pooled_lengths_travel_raw_and_size_the_gradients():
    lengths = raw_array(np.array([1, 2], np.int64))
    good = dict(client=1, seq=1, table="a", ids=ids(), lengths=lengths)
    PooledPushRequest(**good, grads=raw_array(np.ones((2, 4), np.float32)))
    with pytest.raises(MalformedMessage, match=r"PooledPushRequest\.grads must be \(samples, dim\) = \(2, dim\)"):
        PooledPushRequest(**good, grads=get_codec("topk").to_wire(np.ones((2**20, 4),
                                                                          np.float32)))
    zipped = get_codec("none+zstd").to_wire(np.array([1, 2], np.int64))
    with pytest.raises(MalformedMessage, match=r"PooledPushRequest\.lengths .*raw"):
        PooledPushRequest(**{**good, "lengths": zipped},
                          grads=raw_array(np.ones((2, 4), np.float32)))


@pytest.mark.parametrize("tag", [[0, 1, MAX_WORKERS + 1], [0, 1, 2**62], [0, 2**60, 4],
                                 [4, 1, 4], [0, 1]])
def test_a_step_tag_is_bounded(tag):
    with pytest.raises(MalformedMessage, match=r"LookupRequest\.tag must be"):
        LookupRequest(tables=["a"], counts=[3], ids=ids(), tag=tag)

