"""AUC and logloss against scikit-learn, streaming accumulation, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from services.common.errors import InvalidArgument, TrainingFailed
from services.worker.evaluation import (
    EvalAccumulator,
    auc,
    gather_accumulator,
    logloss,
    logloss_from_logits,
)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("round_to", [None, 1, 0])
def test_auc_equals_sklearn_with_and_without_ties(seed: int, round_to: int | None) -> None:
    rng = np.random.default_rng(seed)
    y = (rng.random(2000) < 0.3).astype(np.float32)
    s = rng.standard_normal(2000) + y
    if round_to is not None:
        s = np.round(s, round_to)   # round_to=0 leaves only a handful of distinct scores
    assert auc(y, s) == pytest.approx(roc_auc_score(y, s), abs=1e-12)


def test_auc_extremes_and_torch_input() -> None:
    y = np.array([0, 0, 1, 1])
    assert auc(y, [0.1, 0.2, 0.8, 0.9]) == 1.0
    assert auc(y, [0.9, 0.8, 0.2, 0.1]) == 0.0
    assert auc(y, [0.5, 0.5, 0.5, 0.5]) == 0.5
    assert auc(torch.tensor(y), torch.tensor([0.1, 0.9, 0.2, 0.8])) == 0.5
    assert math.isnan(auc([1, 1], [0.2, 0.3]))   # one class: undefined


def test_logloss_equals_sklearn() -> None:
    rng = np.random.default_rng(7)
    y = (rng.random(1000) < 0.4).astype(np.float64)
    z = rng.standard_normal(1000) * 3
    p = _sigmoid(z)
    assert logloss(y, p) == pytest.approx(log_loss(y, p), rel=1e-9)
    assert logloss_from_logits(y, z) == pytest.approx(log_loss(y, p), rel=1e-9)
    # huge logits neither overflow nor clip in the logits form
    assert logloss_from_logits([1.0, 0.0], [800.0, -800.0]) == pytest.approx(0.0, abs=1e-12)
    assert logloss_from_logits([0.0], [800.0]) == pytest.approx(800.0)


def test_accumulator_streams_to_the_whole_set_result() -> None:
    rng = np.random.default_rng(3)
    y = (rng.random(3000) < 0.25).astype(np.float32)
    z = rng.standard_normal(3000).astype(np.float32) + y
    acc = EvalAccumulator()
    for lo in range(0, 3000, 256):
        acc.update(torch.from_numpy(y[lo:lo + 256]), torch.from_numpy(z[lo:lo + 256]))
    res = acc.result()
    assert res.count == 3000
    assert res.auc == pytest.approx(roc_auc_score(y, z), abs=1e-12)
    assert res.logloss == pytest.approx(log_loss(y, _sigmoid(z.astype(np.float64))), rel=1e-6)
    assert res.positive_rate == pytest.approx(y.mean())
    assert set(res.as_dict()) == {"auc", "logloss", "count", "positive_rate"}

    half_a, half_b = EvalAccumulator(), EvalAccumulator()
    half_a.update(y[:1500], z[:1500])
    half_b.update(y[1500:], z[1500:])
    half_a.merge(half_b)
    assert half_a.result().auc == pytest.approx(res.auc, abs=1e-12)
    assert gather_accumulator(half_a) is half_a    # no process group: itself
    half_a.reset()
    assert half_a.count == 0
    empty = half_a.result()
    assert math.isnan(empty.auc) and math.isnan(empty.logloss)


@pytest.mark.parametrize("labels, scores, match", [
    ([0, 1], [0.1], "differ in size"),
    ([0, 2], [0.1, 0.2], "0 or 1"),
    ([0, 1], [0.1, float("nan")], "NaN or Inf"),
])
def test_bad_input_is_rejected_and_leaves_the_accumulator_unchanged(labels, scores,
                                                                     match) -> None:
    acc = EvalAccumulator()
    acc.update([0, 1], [0.0, 1.0])
    with pytest.raises(InvalidArgument, match=match):
        acc.update(labels, scores)
    assert acc.count == 2
    assert acc.result().auc == 1.0
    with pytest.raises(InvalidArgument, match=match):
        auc(labels, scores)


def test_logloss_rejects_non_probabilities() -> None:
    with pytest.raises(InvalidArgument, match="\\[0, 1\\]"):
        logloss([0, 1], [0.5, 1.5])


def test_add_step_with_the_steps_loss_equals_update() -> None:
    rng = np.random.default_rng(4)
    y = (rng.random(2048) < 0.3).astype(np.float32)
    z = (rng.standard_normal(2048) + y).astype(np.float32)
    checked, stepped = EvalAccumulator(), EvalAccumulator()
    for lo in range(0, 2048, 512):
        yb, zb = y[lo:lo + 512], z[lo:lo + 512]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            torch.from_numpy(zb), torch.from_numpy(yb))
        checked.update(yb, zb)
        stepped.add_step(yb, zb, float(loss))
    a, b = checked.result(), stepped.result()
    assert b.count == a.count == 2048
    assert b.auc == a.auc
    assert b.logloss == pytest.approx(a.logloss, rel=1e-6)
    assert b.positive_rate == pytest.approx(a.positive_rate)


@pytest.mark.parametrize("logits, loss, error, match", [
    ([0.1, 0.2], float("nan"), TrainingFailed, "diverged"),
    ([0.1], 0.5, InvalidArgument, "differ"),
])
def test_add_step_rejects_bad_input_and_changes_nothing(logits, loss, error, match) -> None:
    acc = EvalAccumulator()
    acc.add_step(np.array([0, 1], np.float32), np.array([0.0, 1.0], np.float32), 0.5)
    with pytest.raises(error, match=match):
        acc.add_step(np.array([0, 1], np.float32), np.array(logits, np.float32), loss)
    assert acc.count == 2
    assert acc.result().auc == 1.0


def test_add_step_labels_other_than_0_or_1_fail_the_result() -> None:
    acc = EvalAccumulator()
    acc.add_step(np.array([0, 2], np.float32), np.array([0.1, 0.2], np.float32), 0.5)
    with pytest.raises(InvalidArgument, match="0 or 1"):
        acc.result()
