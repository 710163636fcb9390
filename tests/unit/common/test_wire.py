from __future__ import annotations

import msgpack
import numpy as np
import pytest

from services.common.codecs import (
    WireArray,
    available_codecs,
    decode_array,
    decoder,
    encode_array,
    get_codec,
    raw_array,
)
from services.common.errors import InvalidArgument, MalformedMessage, ProtocolMismatch
from services.common.wire import PROTOCOL_VERSION, decode_message, encode_message


@pytest.mark.parametrize("dtype", ["float32", "float16", "uint64", "int32", "bool"])
def test_raw_array_round_trip_is_exact(dtype):
    arr = (np.random.default_rng(0).random((5, 3)) * 100).astype(dtype)
    body = decode_message(encode_message({"a": raw_array(arr)}))
    out = decode_array(body["a"])
    assert out.dtype == arr.dtype and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


def test_big_endian_input_travels_little_endian():
    arr = np.arange(6, dtype=">f4").reshape(2, 3)
    out = decode_array(decode_message(encode_message({"a": raw_array(arr)}))["a"])
    np.testing.assert_array_equal(out, arr)


def test_packing_uses_a_memoryview_and_unpacking_does_not_copy():
    arr = np.arange(10, dtype=np.float32)
    wire = raw_array(arr)
    assert isinstance(wire, WireArray) and wire.codec == "none"
    assert isinstance(wire.data, memoryview) and np.shares_memory(np.asarray(wire.data), arr)
    raw = encode_message({"a": wire})
    body = decode_message(raw)
    out = decode_array(body["a"])
    assert not out.flags.owndata  # a view over the received buffer


def test_every_message_carries_the_protocol_version():
    assert PROTOCOL_VERSION == 2
    frame = msgpack.unpackb(encode_message({"x": 1}, rid=4))
    assert frame == {"x": 1, "v": PROTOCOL_VERSION, "rid": 4}
    assert decode_message(encode_message({"x": 1}, rid=4)) == {"x": 1, "rid": 4}
    with pytest.raises(ProtocolMismatch, match="protocol version 7"):
        decode_message(msgpack.packb({"v": 7}))
    with pytest.raises(ProtocolMismatch, match="protocol version 1.*speaks version 2"):
        decode_message(msgpack.packb({"v": 1, "table": "user"}))
    with pytest.raises(ProtocolMismatch, match="no protocol version"):
        decode_message(msgpack.packb({"x": 1}))


def test_size_limit_is_checked_before_parsing():
    raw = encode_message({"x": b"\0" * 100})
    assert decode_message(raw, max_bytes=len(raw))["x"] == b"\0" * 100
    with pytest.raises(InvalidArgument, match="exceeds the limit"):
        decode_message(raw, max_bytes=len(raw) - 1)


def test_values_without_a_wire_form_are_refused():
    with pytest.raises(TypeError, match="cannot put a object"):
        encode_message({"x": object()})


@pytest.mark.parametrize("payload", [b"\xc1", b"", msgpack.packb([1, 2]), msgpack.packb("s"),
                                     b"\x85\xa1", msgpack.packb({1: 2})])
def test_malformed_messages(payload):
    with pytest.raises(MalformedMessage):
        decode_message(payload)


@pytest.mark.parametrize("mutate,match", [
    (lambda b: b.update(dtype="complex128"), "dtype"),
    (lambda b: b.update(dtype=["float32"]), "dtype"),
    (lambda b: b.update(shape=[-1]), "shape"),
    (lambda b: b.update(shape="3"), "shape"),
    (lambda b: b.update(shape=[True, 6]), "shape"),
    (lambda b: b.update(shape=[1] * 9), "shape"),
    (lambda b: b.update(data=b.pop("data").tobytes()[:-1]), "needs 24 bytes"),
    (lambda b: b.update(shape=[10**12]), "limit"),
    (lambda b: b.update(data="text"), "data: Expected `bytes`"),
    (lambda b: b.update(codec="nope"), "unknown codec"),
    (lambda b: b.update(codec="qsgd:s=3"), "parameters"),
    (lambda b: b.update(meta=[1]), "meta"),
    (lambda b: b.update(extra=1), "unknown fields \\['extra'\\]"),
])
def test_bad_array_headers(mutate, match):
    body = raw_array(np.zeros(6, np.float32)).to_wire()
    mutate(body)
    with pytest.raises(MalformedMessage, match=match):
        decode_array(body)
    with pytest.raises(MalformedMessage):
        decode_array([1, 2, 3])


@pytest.mark.parametrize("name,rtol", [("none", 0), ("fp16", 2**-11), ("bf16", 2**-8)])
def test_float_codecs_round_trip_and_count_bytes(name, rtol):
    x = np.random.default_rng(1).normal(size=(64, 16)).astype(np.float32)
    codec = get_codec(name)
    body = decode_message(encode_message({"a": encode_array(x, codec)}))
    out = decode_array(body["a"])
    np.testing.assert_allclose(out, x, rtol=rtol, atol=0)
    assert out.dtype == np.float32
    assert codec.stats.raw_bytes == x.nbytes
    assert codec.stats.wire_bytes == x.nbytes // (1 if name == "none" else 2)


def test_bf16_keeps_nan_inf_and_rounds_to_nearest_even():
    x = np.array([np.nan, np.inf, -np.inf, 1.0, 1.00390625, 1.01171875], np.float32)
    out = decoder("bf16").from_wire(get_codec("bf16").to_wire(x))
    assert np.isnan(out[0]) and out[1] == np.inf and out[2] == -np.inf
    assert out[3] == 1.0 and out[4] == 1.0 and out[5] == 1.015625


def test_unknown_codec_and_bad_params():
    assert {"none", "fp16", "bf16"} <= set(available_codecs())
    with pytest.raises(InvalidArgument, match="unknown codec"):
        get_codec("zip9")
    with pytest.raises(InvalidArgument, match="bad parameters"):
        get_codec("fp16", levels=3)


def test_corrupted_codec_payload():
    body = get_codec("fp16").to_wire(np.ones(8, np.float32)).to_wire()
    body["data"] = bytes(body["data"])[:-2]
    with pytest.raises(MalformedMessage, match="needs 16 bytes"):
        decode_array(body)
