"""Whole training runs at tiny size: 2 PS shard processes, workers, planted synthetic data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from services.demo import LocalPS
from services.loader.synthetic import SyntheticConfig, SyntheticDataset
from services.worker.config import TrainerConfig, ps_table_configs
from services.worker.local import run_local_training

# Measured on 2 CPU cores (seed 0, 65,536 training rows, batch 256, hybrid S=8): test AUC
# 0.7915 vs oracle 0.8196 (gap 0.028) with 2 workers, 0.7914 with 1. The gap shrinks with
# data (0.020 at 196,608 rows); this bound is for the tiny size only.
TOLERANCE = 0.04


def test_two_workers_hybrid_reach_oracle_auc_within_tolerance() -> None:
    data = SyntheticDataset(SyntheticConfig(seed=0))
    train = list(data.batches(256, 65_536))
    test = list(data.batches(4096, 16_384, split="test"))
    oracle = data.oracle(16_384)["auc"]
    tables = ps_table_configs({f: 16 for f in data.config.sparse_names}, lr=0.05)
    with LocalPS(2, tables) as cluster:
        summary = run_local_training(
            ps_addresses=cluster.addresses, train_batches=train, eval_batches=test,
            config=TrainerConfig(mode="hybrid", staleness=8, lr=3e-3), num_workers=2)
    assert summary["num_workers"] == 2 and summary["steps"] == len(train) // 2
    assert summary["eval_samples"] == 16_384  # both workers' halves of the test split
    assert summary["auc"] >= oracle - TOLERANCE, (summary["auc"], oracle)
    assert summary["staleness_max"] <= 8
    assert summary["wire_bytes"]["push_out"] > 0 and summary["samples_per_s"] > 0


def test_persimmon_train_writes_the_summary_json(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "train",
         "--train-data", "synthetic:16384", "--eval-rows", "8192", "--batch-size", "256",
         "--mode", "sync", "--lr", "0.003", "--summary-json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    for key in ("auc", "logloss", "samples_per_s", "steps", "mode", "wire_bytes", "oracle_auc"):
        assert key in summary, key
    assert summary["mode"] == "sync" and summary["steps"] == 64
    assert summary["staleness_max"] == 0
    assert 0.65 < summary["auc"] < summary["oracle_auc"] + 0.01
    assert set(summary["wire_bytes"]) == {"lookup_out", "lookup_in", "push_out", "push_in"}


def test_persimmon_train_rejects_unknown_data_spec() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "train", "--train-data", "parquet:/nowhere"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "only 'synthetic" in proc.stderr
