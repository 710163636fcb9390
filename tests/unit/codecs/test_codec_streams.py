"""StreamCodecs keeps one codec per stream and counts bytes per stream, codec and direction."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.common.codecs import CodecSpec, StreamCodecs, WireStats, WireStatsCollector
from services.common.config import from_dict
from services.common.errors import ConfigError, MalformedMessage
from services.common.wire import decode_message, encode_message


def _grads(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((64, 16)).astype(np.float32)


def test_each_stream_has_its_own_codec_state():
    streams = StreamCodecs({"grads_up": {"name": "dct", "keep": 0.05}, "rows_down": "fp16+zstd"})
    a, b = streams.codec("grads_up"), streams.codec("rows_down")
    assert a is streams.codec("grads_up") and a is not b
    assert a.name == "dct" and a.keep == 0.05 and b.name == "fp16+zstd"
    assert streams.codec("activations").name == "none"  # the default


def test_bytes_counted_both_ways_per_stream_and_codec():
    sender = StreamCodecs({"grads_up": {"name": "topk", "params": {"keep": 0.1}}})
    receiver = StreamCodecs()
    for step in range(3):
        msg = encode_message({"g": sender.encode("grads_up", _grads(step), key="t0")})
        out = receiver.decode("grads_up", decode_message(msg)["g"])
        assert out.shape == (64, 16)
    sent = sender.stats.get("grads_up", "topk", "sent")
    received = receiver.stats.get("grads_up", "topk", "received")
    assert sent.arrays == received.arrays == 3
    assert sent.raw_bytes == received.raw_bytes == 3 * 64 * 16 * 4
    assert sent.wire_bytes == received.wire_bytes == 3 * 103 * 6  # ceil(10%·1024) pairs, 6 B each
    assert sent.ratio > 6
    d = sender.as_dict()
    assert d["codecs"] == {"grads_up": "topk"}
    assert d["bytes"]["grads_up"]["topk"]["sent"]["arrays"] == 3
    rows = receiver.stats.rows()
    assert rows == [{"stream": "grads_up", "codec": "topk", "direction": "received",
                     "raw_bytes": received.raw_bytes, "wire_bytes": received.wire_bytes,
                     "arrays": 3, "ratio": received.ratio}]


def test_malformed_input_counts_nothing():
    receiver = StreamCodecs()
    body = StreamCodecs({"s": "int8"}).encode("s", _grads()).to_wire()
    body["data"] = bytes(body["data"])[:-3]
    with pytest.raises(MalformedMessage):
        receiver.decode("s", body)
    assert receiver.stats.rows() == []


def test_reset_clears_error_feedback():
    streams = StreamCodecs({"g": "onebit"})
    streams.encode("g", _grads(), key=1)
    assert streams.codec("g").residual(1) is not None
    streams.reset()
    assert streams.codec("g").residual(1) is None


def test_wire_stats_rejects_unknown_direction():
    with pytest.raises(ValueError, match="direction"):
        WireStats().add("s", "none", "sideways", 1, 1)


def test_wire_stats_merged_adds_each_key_and_leaves_the_parts_alone():
    child, lane = WireStats(), WireStats()
    child.add("push", "fp16", "sent", 400, 200)
    child.add("lookup", "none", "received", 64, 64)
    lane.add("push", "fp16", "sent", 40, 20)
    both = WireStats.merged(child, lane)
    assert both.get("push", "fp16", "sent").as_dict() == {
        "raw_bytes": 440, "wire_bytes": 220, "arrays": 2, "ratio": 2.0}
    assert both.get("lookup", "none", "received").arrays == 1
    assert child.get("push", "fp16", "sent").raw_bytes == 400  # the parts are not changed
    assert WireStats.merged().rows() == []


def test_codec_spec_from_config_mapping():
    spec = from_dict(CodecSpec, {"name": "qsgd", "params": {"levels": 7}})
    assert spec.build().levels == 7
    with pytest.raises(ConfigError, match="unknown keys"):
        from_dict(CodecSpec, {"name": "qsgd", "level": 7})
    with pytest.raises(ConfigError, match="mixes"):
        CodecSpec.parse({"name": "qsgd", "params": {}, "levels": 3})
    with pytest.raises(ConfigError):
        CodecSpec.parse(42)


def test_wire_stats_exported_as_prometheus_counters():
    codecs = StreamCodecs({"grads_up": "fp16"})
    codecs.encode("grads_up", np.ones((4, 8), np.float32))
    registry = CollectorRegistry()
    registry.register(WireStatsCollector(codecs.stats.rows))
    text = generate_latest(registry).decode()
    labels = 'codec="fp16",direction="sent",kind="{}",stream="grads_up"'
    assert f"persimmon_codec_bytes_total{{{labels.format('raw')}}} 128.0" in text
    assert f"persimmon_codec_bytes_total{{{labels.format('wire')}}} 64.0" in text
