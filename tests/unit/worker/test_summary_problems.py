"""A fit without a result is an error, never a NaN reported as one: no valid record, a NaN
loss, an empty or one-class evaluation set; labels outside {0, 1} name their data; the
summary JSON then says why (strict JSON: NaN as null)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.common.errors import InvalidArgument, TrainingFailed
from services.worker.distributed import _rank_error
from services.worker.evaluation import EvalAccumulator
from services.worker.service import check_result, failure_summary, report_summary
from services.worker.summary import summary_problem

GOOD = {"mode": "sync", "steps": 4, "loss": 0.5, "auc": 0.7, "eval_samples": 100,
        "train_auc": 0.6, "history": [{"step": 4, "auc": 0.7}]}


@pytest.mark.parametrize(("change", "says"), [
    ({"steps": 0, "loss": math.nan, "auc": math.nan}, "consumed no valid record"),
    ({"loss": math.nan}, "the training loss is nan"),
    ({"auc": math.nan, "eval_samples": 0}, "the evaluation set is empty"),
    ({"auc": math.nan}, "the evaluation set holds one class only"),
    ({"auc": math.nan, "eval_samples": None}, "the training data (nothing was evaluated) "
                                              "holds one class only"),
])
def test_what_a_summary_without_a_result_says(change: dict[str, Any], says: str) -> None:
    assert summary_problem(GOOD) is None
    assert says in str(summary_problem({**GOOD, **change}))


def test_the_summary_json_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "summary.json"
    with pytest.raises(TrainingFailed, match="one class only"):
        report_summary({**GOOD, "auc": math.nan}, str(path))
    written = json.loads(path.read_text(), parse_constant=pytest.fail)  # no NaN literal
    assert written["auc"] is None and "one class only" in written["error"]
    assert written["steps"] == 4 and capsys.readouterr().out == ""  # no result printed
    check_result(GOOD, str(path))  # a result: nothing raised, nothing written
    assert "error" in json.loads(path.read_text())
    assert report_summary(GOOD, str(path)) == 0
    assert json.loads(path.read_text()) == GOOD and '"auc": 0.7' in capsys.readouterr().out
    # a run without validation data has no best validation AUC: null, printed and written
    assert report_summary({**GOOD, "best_validation_auc": math.nan}, str(path)) == 0
    printed = json.loads(capsys.readouterr().out, parse_constant=pytest.fail)
    assert printed["best_validation_auc"] is None and printed["auc"] == 0.7
    assert json.loads(path.read_text(), parse_constant=pytest.fail)["best_validation_auc"] is None


def test_a_failure_during_training_leaves_its_reason(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    with pytest.raises(TrainingFailed), failure_summary(str(path)):
        raise TrainingFailed("the training loss is nan: the model diverged")
    assert json.loads(path.read_text()) == {
        "error": "the training loss is nan: the model diverged"}
    with pytest.raises(ValueError), failure_summary(str(tmp_path / "other.json")):
        raise ValueError("a bug is no user's summary")
    assert not (tmp_path / "other.json").exists()


def test_labels_outside_0_1_and_nan_losses_name_their_data() -> None:
    acc = EvalAccumulator("the training data")
    acc.add_step(np.array([0.0, 2.0, 1.0], np.float32), np.zeros(3, np.float32), 0.7)
    with pytest.raises(InvalidArgument, match=r"the training data: labels must be 0 or 1, "
                                              r"got 2 \(1 of 3\)"):
        acc.result()
    with pytest.raises(InvalidArgument, match="the evaluation data: labels"):
        EvalAccumulator("the evaluation data").update([1.0, -1.0], [0.3, 0.2])
    with pytest.raises(TrainingFailed, match="diverged"):
        acc.add_step(np.zeros(2, np.float32), np.zeros(2, np.float32), math.nan)


def test_a_failing_rank_keeps_its_error_class() -> None:
    error = _rank_error(1, TrainingFailed("the training loss is nan"), "Traceback ...")
    assert type(error) is TrainingFailed and error.message == (
        "local rank 1: the training loss is nan")
    assert "Traceback ..." in _rank_error(0, None, "Traceback ...").message
