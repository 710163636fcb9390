"""The ``uniform`` codec: deterministic nearest rounding per row within half a bf16 step."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.codecs import decode_array, decoder, get_codec
from services.common.errors import MalformedMessage


def _rows(seed: int = 0, shape=(64, 16), scale: float = 0.05) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _round_trip(x: np.ndarray, bits: int = 4) -> np.ndarray:
    codec = get_codec("uniform", bits=bits)
    return decoder("uniform").decode(*codec.encode(x), np.dtype(np.float32), x.shape)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_each_element_within_half_a_step(bits):
    x = _rows(bits)
    y = _round_trip(x, bits)
    q = 2 ** (bits - 1) - 1
    amax = np.abs(x).max(axis=1, keepdims=True)
    assert np.all(np.abs(y - x) <= amax * (1 + 2.0**-7) / (2 * q) * (1 + 1e-5))
    # the row's largest entry is kept to within the bf16 rounding of the scale
    top = np.argmax(np.abs(x), axis=1)
    rows = np.arange(x.shape[0])
    np.testing.assert_allclose(y[rows, top], x[rows, top], rtol=2.0**-7)


def test_deterministic_and_lower_error_than_qsgd_at_fewer_bytes():
    x = _rows(1, (512, 16))
    a, b = get_codec("uniform").encode(x)[0], get_codec("uniform").encode(x)[0]
    assert bytes(a) == bytes(b)
    qsgd = get_codec("qsgd", levels=15, bucket=16)
    data, meta = qsgd.encode(x)
    y_q = qsgd.decode(data, meta, np.dtype(np.float32), x.shape)
    assert len(a) < len(data)  # 10 bytes a 16-wide row against 14
    assert np.mean((_round_trip(x) - x) ** 2) < np.mean((y_q - x) ** 2)


def test_zero_and_tiny_rows():
    x = np.zeros((3, 8), dtype=np.float32)
    x[1, 3] = 1e-44  # subnormal: the scale rounds up to the smallest bf16 that covers it
    x[2] = -3.0e37
    y = _round_trip(x)
    np.testing.assert_array_equal(y[0], 0.0)
    assert abs(y[1, 3] - x[1, 3]) <= 1e-40
    np.testing.assert_allclose(y[2], x[2], rtol=2.0**-7)


def test_nonfinite_row_is_nan_row():
    x = np.ones((3, 4), dtype=np.float32)
    x[1, 2] = np.inf
    x[2, 0] = np.nan
    y = _round_trip(x)
    assert np.all(np.isnan(y[1:])) and np.allclose(y[0], 1.0, rtol=2.0**-7)


def _body(bits: int = 4) -> dict:
    body = get_codec("uniform", bits=bits).to_wire(_rows(2, (4, 6))).to_wire()
    body["data"] = bytes(body["data"])
    return body


def test_code_above_the_range_is_malformed():
    body = _body(4)  # codes 0..14: 15 (0xF) cannot be sent
    body["data"] = body["data"][:8] + b"\xff" * (len(body["data"]) - 8)
    with pytest.raises(MalformedMessage, match="code"):
        decode_array(body)


@pytest.mark.parametrize("scale", [b"\x80\xbf", b"\x80\x7f"])  # -1.0 and +Inf as bf16
def test_negative_or_infinite_scale_is_malformed(scale):
    body = _body()
    body["data"] = scale + body["data"][2:]
    with pytest.raises(MalformedMessage, match="scale"):
        decode_array(body)


def test_bad_input_changes_nothing():
    codec = get_codec("uniform")
    with pytest.raises(Exception, match="float"):
        codec.to_wire(np.ones((2, 4), dtype=np.int32))
    assert codec.stats.arrays == 0 and codec.stats.wire_bytes == 0
    with pytest.raises(MalformedMessage, match="dtype"):
        codec.decode(b"", {"bits": 4}, np.dtype(np.int32), (0, 4))


def test_error_feedback_identity_per_key():
    """With error feedback: Σ sent = Σ input − residual, for each key apart."""
    codec = get_codec("uniform", bits=2, error_feedback=True)
    rng = np.random.default_rng(3)
    totals = {k: [np.zeros((5, 16)), np.zeros((5, 16))] for k in ("a", "b")}
    for step in range(40):
        key = "ab"[step % 2]
        x = rng.standard_normal((5, 16)).astype(np.float32)
        y = codec.decode(*codec.encode(x, key=key), np.dtype(np.float32), x.shape)
        totals[key][0] += x
        totals[key][1] += y
    for key, (pushed, sent) in totals.items():
        residual = codec.residual(key).reshape(5, 16)
        np.testing.assert_allclose(sent, pushed - residual, atol=1e-4)
        assert np.abs(residual).max() <= np.abs(pushed).max()  # bounded, not accumulating
    codec.reset()
    assert codec.residual("a") is None


def test_error_feedback_skips_a_nonfinite_push():
    codec = get_codec("uniform", error_feedback=True)
    x = _rows(4, (2, 8))
    codec.encode(x, key="g")
    before = codec.residual("g").copy()
    x[0, 0] = np.nan
    y = codec.decode(*codec.encode(x, key="g"), np.dtype(np.float32), x.shape)
    assert np.all(np.isnan(y[0])) and not np.isnan(y[1]).any()
    np.testing.assert_array_equal(codec.residual("g"), before)
