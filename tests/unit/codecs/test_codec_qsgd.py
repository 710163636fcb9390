"""QSGD is unbiased; AdaQuant raises s as the loss falls and ships s in meta."""

from __future__ import annotations

import math

import numpy as np
import pytest

from services.common.codecs import decoder, get_codec
from services.common.errors import ConfigError, InvalidArgument


@pytest.mark.parametrize(("levels", "bucket"), [(1, 0), (4, 8), (15, 0)])
def test_qsgd_is_unbiased(levels, bucket):
    """The mean of 10^4 decodes lies within 4σ of v, σ from the per-element Bernoulli variance."""
    v = np.random.default_rng(0).standard_normal(32).astype(np.float32)
    codec = get_codec("qsgd", levels=levels, bucket=bucket, seed=1)
    dec = decoder("qsgd")
    trials = 10_000
    total = np.zeros_like(v, dtype=np.float64)
    for _ in range(trials):
        data, meta = codec.encode(v)
        total += dec.decode(data, meta, np.dtype(np.float32), v.shape)
    mean = total / trials
    b = bucket or v.size
    norms = np.repeat(np.sqrt(np.add.reduceat(v.astype(np.float64) ** 2, np.arange(0, v.size, b))),
                      b)
    r = np.abs(v) * levels / norms
    p = r - np.floor(r)
    sigma = np.sqrt(p * (1 - p)) * norms / levels / np.sqrt(trials)
    assert np.all(np.abs(mean - v) <= 4 * sigma + 1e-6 * np.abs(v))
    assert np.any(sigma > 0)  # the test really exercised randomness


def test_qsgd_is_seeded_and_random():
    v = np.linspace(-1, 1, 100).astype(np.float32)
    a = get_codec("qsgd", seed=5).encode(v)[0]
    b = get_codec("qsgd", seed=5).encode(v)[0]
    c = get_codec("qsgd", seed=6).encode(v)[0]
    assert bytes(a) == bytes(b) and bytes(a) != bytes(c)


def test_adaquant_levels_rise_as_loss_falls():
    codec = get_codec("adaquant", s0=2, s_min=2, s_max=64, window=5)
    losses = 2.0 * np.exp(-np.linspace(0, 6, 200)) + 0.01 * np.cos(np.arange(200))  # noisy fall
    levels = [codec.report_loss(loss) for loss in np.maximum.accumulate(losses[::-1])[::-1]]
    assert levels[0] == 2
    assert all(b >= a for a, b in zip(levels, levels[1:], strict=False))
    assert levels[-1] > 8
    assert levels[-1] <= 64


def test_adaquant_formula_and_clipping():
    codec = get_codec("adaquant", s0=2, s_min=3, s_max=10, window=1, f0_steps=1)
    assert codec.levels == 3  # s0 clipped up to s_min before any loss
    assert codec.report_loss(4.0) == 3  # ceil(sqrt(1)·2) = 2 → clipped to 3
    assert codec.report_loss(1.0) == 4  # ceil(sqrt(4)·2)
    assert codec.report_loss(0.25) == 8  # ceil(sqrt(16)·2)
    assert codec.report_loss(0.01) == 10  # 40 → clipped to s_max
    assert codec.report_loss(0.0) == 10


def test_adaquant_outlier_first_loss_does_not_pin_s():
    """F_0 is the mean of the first 8 losses: one outlying first minibatch (40 where the
    others are 1) must not pin s at s_max, as F_0 = that one loss did (sqrt(40)·2 → 13)."""
    codec = get_codec("adaquant", s0=2, s_min=2, s_max=8, window=4)
    losses = [40.0] + [1.0] * 30
    levels = [codec.report_loss(loss) for loss in losses]
    f0 = sum(losses[:8]) / 8                                   # 47 / 8
    assert codec.initial_loss == pytest.approx(f0)
    assert levels[-1] == math.ceil(math.sqrt(f0 / 1.0) * 2) == 5
    assert max(levels[8:]) < 8
    steady = get_codec("adaquant", s0=2, s_max=8, window=4)
    assert [steady.report_loss(1.0) for _ in range(12)] == [2] * 12   # no fall, no new levels
    with pytest.raises(ConfigError):
        get_codec("adaquant", f0_steps=0)


def test_adaquant_levels_travel_in_meta():
    codec = get_codec("adaquant", s0=2, s_max=32, window=1, f0_steps=1, seed=0)
    x = np.random.default_rng(1).standard_normal(256).astype(np.float32)
    codec.report_loss(1.0)
    coarse = codec.to_wire(x)
    codec.report_loss(0.01)
    fine = codec.to_wire(x)
    assert coarse.meta["s"] == 2 and fine.meta["s"] == 20
    assert fine.nbytes > coarse.nbytes
    fresh = decoder("adaquant")  # a receiver that never saw a loss
    err_coarse = np.abs(fresh.from_wire(coarse) - x).mean()
    err_fine = np.abs(fresh.from_wire(fine) - x).mean()
    assert err_fine < err_coarse / 3


@pytest.mark.parametrize("loss", [float("nan"), -1.0, "abc", None])
def test_adaquant_rejects_bad_losses(loss):
    codec = get_codec("adaquant")
    with pytest.raises(InvalidArgument):
        codec.report_loss(loss)
    assert codec.initial_loss is None and codec.levels == 2
