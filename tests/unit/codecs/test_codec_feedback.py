"""Error feedback, thresholds and densities of the sparsifying and 1-bit codecs."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.codecs import decoder, get_codec

EF_CODECS = [("onebit", {"chunk": 64}), ("topk", {"keep": 0.05}), ("dct", {"keep": 0.05, "refresh": 7}),
             ("dct", {"keep": 0.05, "refresh": 7, "drift": None}), ("topk+zstd", {"keep": 0.1})]


def _stream(steps: int, shape, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield (rng.standard_normal(shape) * rng.uniform(0.1, 3.0)).astype(np.float32)


@pytest.mark.parametrize(("name", "params"), EF_CODECS)
def test_error_feedback_identity(name, params):
    """Σ sent = Σ input − residual, per key, with two keys interleaved."""
    codec = get_codec(name, **params)
    total_in = {k: np.zeros(500, np.float64) for k in ("a", "b")}
    total_sent = {k: np.zeros(500, np.float64) for k in ("a", "b")}
    for step, x in enumerate(_stream(40, 500)):
        key = "ab"[step % 2]
        data, meta = codec.encode(x, key=key)
        total_in[key] += x
        total_sent[key] += decoder(name).decode(data, meta, np.dtype(np.float32), x.shape)
    for key in ("a", "b"):
        residual = codec.residual(key)
        np.testing.assert_allclose(total_sent[key], total_in[key] - residual, atol=2e-4)
        assert np.abs(residual).max() > 0  # something really was held back


def test_error_feedback_off_keeps_no_residual():
    codec = get_codec("onebit", error_feedback=False)
    x = next(_stream(1, 300))
    a = codec.decode(*codec.encode(x), np.dtype(np.float32), x.shape)
    b = codec.decode(*codec.encode(x), np.dtype(np.float32), x.shape)
    np.testing.assert_array_equal(a, b)
    assert codec.residual() is None


@pytest.mark.parametrize(("name", "params"), [("dct", {"threshold": 0.0}), ("topk", {"keep": 1.0}),
                                               ("dct", {"keep": 1.0}),
                                               ("dct", {"threshold": 0.0, "values": "fp32"})])
def test_threshold_zero_is_bit_identical(name, params):
    codec = get_codec(name, **params)
    for x in _stream(5, (20, 30), seed=3):
        x[0, :4] = [-0.0, 0.0, 1e-30, -1e30]  # signed zero, tiny and fp16-overflowing values
        data, meta = codec.encode(x, key="w")
        y = decoder(name).decode(data, meta, np.dtype(np.float32), x.shape)
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
        assert len(data) == x.nbytes
    assert not np.any(codec.residual("w"))


def test_sparse_values_out_of_fp16_range_travel_as_fp32():
    x = np.zeros(1000, dtype=np.float32)
    x[10] = 1e6
    codec = get_codec("topk", keep=0.001)
    data, meta = codec.encode(x)
    assert meta["v"] == "fp32"
    assert codec.decode(data, meta, np.dtype(np.float32), x.shape)[10] == 1e6
    assert not np.any(codec.residual())


def test_topk_keeps_exactly_k_every_call():
    codec = get_codec("topk", keep=0.02)
    for x in _stream(20, 2000, seed=4):
        data, meta = codec.encode(x)
        assert meta["k"] == 40 and codec.density() == 0.02


def test_dct_density_on_stationary_stream_paper_schedule():
    """Without error feedback the cached τ keeps the density within 0.5×–2× between refreshes."""
    codec = get_codec("dct", keep=0.01, refresh=100, drift=None, error_feedback=False)
    densities = []
    for x in _stream(400, 5000, seed=5):
        codec.encode(x / np.abs(x).std())  # stationary: unit variance every step
        densities.append(codec.density())
    d = np.array(densities) / 0.01
    assert codec.refreshes == 4
    assert d.min() >= 0.5 and d.max() <= 2.0, (d.min(), d.max())
    assert abs(codec.kept_density / 0.01 - 1) < 0.1


def test_dct_density_with_error_feedback_stays_in_band():
    """Error feedback inflates |x + e| between refreshes; the drift check holds the band."""
    codec = get_codec("dct", keep=0.01, refresh=200, drift=2.0)
    densities = []
    for x in _stream(600, 5000, seed=6):
        codec.encode(x / np.abs(x).std(), key="bucket0")
        densities.append(codec.density("bucket0"))
    d = np.array(densities) / 0.01
    assert d.min() >= 0.5 and d.max() <= 2.0, (d.min(), d.max())
    assert codec.refreshes < 0.05 * 600  # the expensive selection stays rare
    assert codec.tau("bucket0") > 0
    info = codec.info()
    assert info["target_density"] == 0.01 and 0.5 <= info["kept_density"] / 0.01 <= 2


def test_dct_reuses_threshold_between_refreshes():
    codec = get_codec("dct", keep=0.1, refresh=3, drift=None)
    taus = []
    for x in _stream(7, 400, seed=7):
        codec.encode(x, key=0)
        taus.append(codec.tau(0))
    assert taus[0] == taus[1] == taus[2] != taus[3]
    assert taus[3] == taus[4] == taus[5] != taus[6]
    assert codec.refreshes == 3


def test_reset_forgets_residuals():
    codec = get_codec("dct", keep=0.01)
    codec.encode(next(_stream(1, 1000)), key="k")
    assert codec.residual("k") is not None
    codec.reset()
    assert codec.residual("k") is None and codec.tau("k") is None


def test_nonfinite_input_decodes_as_nan_and_keeps_residual():
    codec = get_codec("onebit", chunk=16)
    x = next(_stream(1, 64))
    codec.encode(x, key="g")
    before = codec.residual("g").copy()
    bad = x.copy()
    bad[5] = np.nan
    data, meta = codec.encode(bad, key="g")
    y = decoder("onebit").decode(data, meta, np.dtype(np.float32), bad.shape)
    assert np.all(np.isnan(y)) and len(data) == 0
    np.testing.assert_array_equal(codec.residual("g"), before)


@pytest.mark.parametrize("name", ["int8"])
def test_int8_nonfinite_row_is_nan_row(name):
    x = np.ones((3, 4), dtype=np.float32)
    x[1, 2] = np.inf
    codec = get_codec(name)
    y = codec.decode(*codec.encode(x), np.dtype(np.float32), x.shape)
    assert np.all(np.isnan(y[1])) and np.allclose(y[[0, 2]], 1.0)
