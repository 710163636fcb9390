"""Bad codec names, bad parameters and corrupted payloads give clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.codecs import decode_array, decoder, get_codec
from services.common.errors import ConfigError, InvalidArgument, MalformedMessage
from services.common.wire import decode_message, encode_message

LOSSY = ["int8", "uniform", "onebit", "topk", "dct", "qsgd", "adaquant", "fp16+zstd", "int8+lz4", "dct+zstd"]


def _body(name: str, **params) -> dict:
    x = np.random.default_rng(0).standard_normal((16, 40)).astype(np.float32)
    body = get_codec(name, **params).to_wire(x).to_wire()
    body["data"] = bytes(body["data"])
    return body


@pytest.mark.parametrize("name", ["nope", "zstd", "fp16+gzip", "FP16", "", "fp16+zstd+lz4+zstd"])
def test_unknown_names_are_invalid_argument(name):
    with pytest.raises(InvalidArgument, match="codec|wrapper"):
        get_codec(name)


def test_wrapper_alone_gets_a_hint():
    with pytest.raises(InvalidArgument, match="none\\+zstd"):
        get_codec("zstd")


@pytest.mark.parametrize(("name", "params"), [
    ("topk", {"keep": 0}), ("topk", {"keep": 1.5}), ("dct", {"refresh": 0}),
    ("dct", {"threshold": -1.0}), ("dct", {"drift": 0.5}), ("dct", {"values": "int4"}),
    ("uniform", {"bits": 1}), ("uniform", {"bits": 9}), ("uniform", {"bits": True}),
    ("uniform", {"error_feedback": 1}),
    ("onebit", {"chunk": 0}), ("qsgd", {"levels": 0}), ("qsgd", {"levels": 1 << 20}),
    ("adaquant", {"s_min": 8, "s_max": 4}), ("qsgd", {"bogus": 1}), ("fp16+zstd", {"keep": 0.1}),
])
def test_bad_parameters_are_invalid_argument(name, params):
    with pytest.raises(InvalidArgument):
        get_codec(name, **params)


def test_non_float_input_is_refused_without_state_change():
    codec = get_codec("dct", keep=0.1)
    x = np.ones(100, dtype=np.float32)
    codec.encode(x, key="k")
    before = codec.residual("k").copy()
    with pytest.raises(InvalidArgument, match="float"):
        codec.encode(np.ones(100, dtype=np.int64), key="k")
    np.testing.assert_array_equal(codec.residual("k"), before)
    assert codec.stats.arrays == 0  # encode() alone does not count; to_wire does


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("damage", ["truncate", "extend", "empty"])
def test_corrupted_buffer_is_malformed(name, damage):
    body = _body(name)
    data = body["data"]
    body["data"] = {"truncate": data[:-1], "extend": data + b"\0", "empty": b""}[damage]
    with pytest.raises(MalformedMessage):
        decoder(name).from_wire(body)
    with pytest.raises(MalformedMessage):
        decode_array(decode_message(encode_message({"a": body}))["a"])


@pytest.mark.parametrize(("name", "key", "value"), [
    ("onebit", "chunk", 0), ("onebit", "chunk", "64"), ("topk", "mode", "weird"),
    ("topk", "k", -1), ("topk", "k", 10**9), ("topk", "v", "fp8"), ("qsgd", "s", 0),
    ("qsgd", "b", 0), ("adaquant", "s", True), ("uniform", "bits", 9), ("uniform", "bits", "4"),
    ("uniform", "bits", None), ("fp16+zstd", "n", 10**12), ("fp16+zstd", "m", 3),
])
def test_corrupted_meta_is_malformed(name, key, value):
    body = _body(name)
    body["meta"][key] = value
    with pytest.raises(MalformedMessage):
        decoder(name).decode(body["data"], body["meta"], np.dtype(np.float32), (16, 40))


def test_missing_meta_is_malformed():
    body = _body("qsgd")
    body["meta"] = {}
    with pytest.raises(MalformedMessage, match="meta 's'"):
        decode_array(body)


def test_sparse_indices_out_of_range_or_unsorted():
    body = _body("topk", keep=0.05)
    k = body["meta"]["k"]
    idx = np.frombuffer(body["data"], dtype="<i4", count=k).copy()
    for bad in (np.r_[idx[:-1], 640], idx[::-1].copy(), np.r_[idx[:-1], idx[-2]]):
        body["data"] = bad.astype("<i4").tobytes() + body["data"][4 * k:]
        with pytest.raises(MalformedMessage, match="indices"):
            decode_array(body)


def test_qsgd_level_above_s_is_malformed():
    body = _body("qsgd", levels=2, bucket=0)  # 2 level bits: the code 3 exists but s = 2
    n = 16 * 40
    body["data"] = body["data"][:4] + b"\xff" * (-(-n * 3 // 8))
    with pytest.raises(MalformedMessage, match="level"):
        decode_array(body)


def test_corrupt_compressed_stream_is_malformed():
    body = _body("fp16+zstd")
    data = bytearray(body["data"])
    data[len(data) // 2] ^= 0xFF
    data[-1] ^= 0xFF
    body["data"] = bytes(data)
    with pytest.raises(MalformedMessage):
        decode_array(body)


def test_unknown_codec_on_the_wire_is_malformed():
    body = _body("int8")
    body["codec"] = "int9"
    with pytest.raises(MalformedMessage, match="int9"):
        decode_array(body)


def test_nonfinite_flag_with_data_is_malformed():
    body = _body("onebit")
    body["meta"] = {"nonfinite": 1}
    with pytest.raises(MalformedMessage):
        decode_array(body)


FLOAT_CODECS = ["int8", "uniform", "onebit", "topk", "dct", "dct_mp", "qsgd", "adaquant"]
FLAGGED = ["onebit", "topk", "dct", "dct_mp", "qsgd", "adaquant"]  # NaN input: {nonfinite: 1}


@pytest.mark.parametrize("name", FLOAT_CODECS)
def test_every_float_codec_refuses_other_dtypes_by_name(name):
    with pytest.raises(InvalidArgument, match=f"codec {name} encodes float arrays"):
        get_codec(name).encode(np.arange(12).reshape(3, 4))
    body = _body(name)
    with pytest.raises(MalformedMessage, match=f"{name} cannot decode to dtype int32"):
        decoder(name).decode(body["data"], body["meta"], np.dtype(np.int32), (16, 40))


@pytest.mark.parametrize("name", FLOAT_CODECS)
def test_nonfinite_input_travels_as_the_flag_or_in_the_payload(name):
    x = np.ones((4, 5), dtype=np.float32)
    x[1, 2] = np.inf
    data, meta = get_codec(name).encode(x)
    got = decoder(name).decode(data, meta, np.dtype(np.float32), x.shape)
    if name in FLAGGED:
        assert meta == {"nonfinite": 1} and bytes(data) == b"" and np.isnan(got).all()
    else:  # int8, uniform: the row's scale is NaN; the flag is not theirs
        assert np.isnan(got[1]).all() and np.isfinite(np.delete(got, 1, axis=0)).all()
        with pytest.raises(MalformedMessage):
            decoder(name).decode(b"", {"nonfinite": 1}, np.dtype(np.float32), x.shape)


def test_codec_spec_validates_at_config_time():
    from services.common.codecs import CodecSpec

    with pytest.raises(ConfigError, match="keep"):
        CodecSpec(name="dct", params={"keep": 2.0})
    with pytest.raises(ConfigError, match="unknown codec"):
        CodecSpec.parse("dtc")


def test_parameters_spelled_in_the_name():
    from services.common.codecs import split_codec_name

    assert split_codec_name("dct:keep=0.005,refresh=100,values=fp32+zstd") == (
        "dct+zstd", {"keep": 0.005, "refresh": 100, "values": "fp32"})
    codec = get_codec("qsgd:levels=127,bucket=0+lz4")
    assert codec.name == "qsgd+lz4" and codec.levels == 127 and codec.bucket == 0
    assert get_codec("dct:keep=0.1", keep=0.2).keep == 0.2  # keywords win


@pytest.mark.parametrize(("name", "match"), [("dct:keep", "key=value"), ("dct:=1", "key=value"),
                                             ("dct:nope=1", "nope"), ("topk:keep=2", "keep")])
def test_bad_spelled_parameters_are_invalid_argument(name, match):
    with pytest.raises(InvalidArgument, match=match):
        get_codec(name)
