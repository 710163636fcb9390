"""Rows pushed by id: error feedback kept per id (RowEncoder, RowResiduals)."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.codecs import RowEncoder, RowResiduals, decode_array
from services.common.errors import InvalidArgument

DIM = 4


def _push(enc: RowEncoder, ids, rows) -> np.ndarray:
    return decode_array(enc.to_wire(np.asarray(ids, np.uint64), rows, key="t"))


@pytest.mark.parametrize(("name", "params"), [("topk", {"keep": 0.1}), ("dct", {"keep": 0.1}),
                                              ("onebit", {"chunk": 8}), ("dct+zstd", {}),
                                              ("uniform", {"bits": 2, "error_feedback": True})])
def test_per_id_identity_over_changing_id_sets(name, params):
    """For every id: Σ sent = Σ pushed − residual, although each push names other ids."""
    rng = np.random.default_rng(0)
    enc = RowEncoder(name, **params)
    assert enc.feedback is not None
    pushed = np.zeros((50, DIM))
    sent = np.zeros((50, DIM))
    for _ in range(30):
        ids = np.sort(rng.choice(50, size=int(rng.integers(1, 30)), replace=False))
        rows = rng.standard_normal((ids.size, DIM)).astype(np.float32)
        out = _push(enc, ids, rows)
        pushed[ids] += rows
        sent[ids] += out
    residual = enc.residual(np.arange(50, dtype=np.uint64), DIM)
    np.testing.assert_allclose(sent, pushed - residual, atol=1e-4)
    assert np.abs(residual).sum() > 0  # compression really held something back


def test_residual_comes_back_with_its_id_only():
    enc = RowEncoder("topk", keep=0.05)
    big = np.zeros((4, DIM), np.float32)
    big[0, 0] = 10.0          # the one kept entry
    big[1] = [1, 2, 3, 4]     # held back for id 11
    _push(enc, [10, 11, 12, 13], big)
    np.testing.assert_array_equal(enc.residual(np.array([11], np.uint64), DIM)[0], [1, 2, 3, 4])
    # id 11 absent: its residual stays put and is not sent with other ids
    out = _push(enc, [12, 20], np.zeros((2, DIM), np.float32))
    assert not out.any()
    np.testing.assert_array_equal(enc.residual(np.array([11], np.uint64), DIM)[0], [1, 2, 3, 4])
    # id 11 pushed again with zeros: its residual is what travels
    out = _push(enc, [11], np.zeros((1, DIM), np.float32))
    assert out[0, 3] == 4.0


def test_codecs_without_error_feedback_keep_no_residual():
    enc = RowEncoder("fp16")
    assert enc.feedback is None
    rows = np.random.default_rng(1).standard_normal((3, DIM)).astype(np.float32)
    np.testing.assert_allclose(_push(enc, [1, 2, 3], rows), rows, rtol=2**-10)
    assert not enc.residual(np.array([1], np.uint64), DIM).any()


def test_error_feedback_off_by_parameter_keeps_no_residual():
    assert RowEncoder("dct", error_feedback=False).feedback is None


def test_nonfinite_push_keeps_old_residuals():
    enc = RowEncoder("topk", keep=0.05)
    rows = np.arange(8, dtype=np.float32).reshape(2, DIM)
    _push(enc, [1, 2], rows)
    before = enc.residual(np.array([1, 2], np.uint64), DIM)
    bad = np.ones((2, DIM), np.float32)
    bad[0, 0] = np.nan
    assert np.isnan(_push(enc, [1, 2], bad)).all()
    np.testing.assert_array_equal(enc.residual(np.array([1, 2], np.uint64), DIM), before)


def test_bad_shapes_are_refused_and_change_nothing():
    enc = RowEncoder("topk", keep=0.5)
    _push(enc, [1, 2], np.ones((2, DIM), np.float32))
    size = len(enc.feedback)
    with pytest.raises(InvalidArgument, match="len\\(ids\\), dim"):
        _push(enc, [1, 2, 3], np.ones((2, DIM), np.float32))
    with pytest.raises(InvalidArgument, match="width"):
        _push(enc, [1, 2], np.ones((2, DIM + 1), np.float32))
    assert len(enc.feedback) == size


def test_residual_store_grows_and_resets():
    store = RowResiduals()
    ids = np.arange(100, dtype=np.uint64) * 7
    rows = np.random.default_rng(2).standard_normal((100, 3)).astype(np.float32)
    for lo in range(0, 100, 10):  # grows past its first arena in small steps
        store.put(ids[lo:lo + 10], rows[lo:lo + 10])
    assert len(store) == 100
    np.testing.assert_array_equal(store.take(ids[::-1], 3), rows[::-1])
    assert not store.take(np.array([1, 2], np.uint64), 3).any()
    store.reset()
    assert len(store) == 0 and not store.take(ids, 3).any()
