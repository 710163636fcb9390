"""Smoke run of ``persimmon bench recovery --wal`` at a tiny size: the figures exist and hold
(the supervised restart from ``--restore job`` is tests/integration/cluster/test_recovery.py)."""

from __future__ import annotations

import json

from services.cli import build_parser


def test_bench_recovery_smoke(tmp_path) -> None:
    out = tmp_path / "recovery.json"
    args = build_parser().parse_args(
        ["bench", "recovery", "--rows", "2048", "--eval-rows", "1024", "--batch-size", "256",
         "--wal", "--json", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["recovered"] is True
    assert result["lost_acked_updates"] == 0 and result["wal"] is True
    assert result["lost_after_checkpoint"] == 0  # 1009 of the 2048 probe rows without the WAL
    assert result["recovery_s"] > 0
    assert result["steps"] == 8 and result["checkpoint_step"] < result["kill_step"] < 8
    assert abs(result["auc_delta"]) < 0.5 and 0.5 < result["auc_baseline"] <= 1.0
