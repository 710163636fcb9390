"""``persimmon train --validation-fraction``: the validation rows are the last rows of the
training files, the rest train, and the best validated state is kept as with
``--validation-data``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _persimmon(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "PERSIMMON_CACHE_DIR": str(cwd / "cache")}
    return subprocess.run([sys.executable, "-m", "services.cli", "--log-level", "WARNING",
                           *argv], capture_output=True, text=True, timeout=240, cwd=cwd,
                          env=env)


def test_validation_fraction_holds_out_the_last_training_rows(tmp_path: Path) -> None:
    synth = _persimmon("synth", "--rows", "8192", "--test-rows", "4096", "--out", "data",
                       cwd=tmp_path)
    assert synth.returncode == 0, synth.stderr[-2000:]
    meta = json.loads(synth.stdout)
    # 6,144 training rows: 24 steps of 256 per epoch, validated once per epoch
    proc = _persimmon("train", "--train-data", meta["source"], "--eval-data",
                      meta["test_source"], "--batch-size", "256", "--epochs", "2",
                      "--validation-fraction", "0.25", "--eval-every", "24",
                      "--summary-json", "summary.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cache"]["train"]["rows"] == 6144
    assert summary["cache"]["validation"]["rows"] == 2048
    assert summary["steps"] == 2 * 24 and summary["eval_samples"] == 4096
    aucs = [h["auc"] for h in summary["validation"]]
    assert len(aucs) == 2 and min(aucs) > 0.6, aucs
    assert summary["best_validation_auc"] == max(aucs)
    assert summary["best_step"] == 24 * (1 + aucs.index(max(aucs)))
    assert meta["oracle"]["auc"] - 0.1 < summary["auc"] < meta["oracle"]["auc"] + 0.01
