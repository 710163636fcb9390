"""``persimmon bench train`` at tiny size: every figure is there and sane."""

from __future__ import annotations

import math

from bench.train import run


def test_bench_train_reports_both_ratios_from_its_own_runs() -> None:
    result = run(rows=4096, batch_size=512)
    runs = result["runs"]
    assert set(runs) == {"local", "hybrid", "sync"}
    for r in runs.values():
        assert r["samples_per_s"] > 0 and 0.5 < r["auc"] <= 1.0
        assert math.isclose(r["ms_per_step"], 1e3 * 512 / r["samples_per_s"])
    assert math.isclose(result["vs_local"],
                        runs["hybrid"]["samples_per_s"] / runs["local"]["samples_per_s"])
    assert math.isclose(result["hybrid_vs_sync"],
                        runs["hybrid"]["samples_per_s"] / runs["sync"]["samples_per_s"])
    for key in ("hybrid", "sync"):
        assert 0 < runs[key]["step_cpu_ms"] <= 1.2 * runs[key]["step_wall_ms"]
        assert runs[key]["batch_wait_ms"] >= 0
    assert runs["sync"]["staleness_max"] == 0 and runs["hybrid"]["staleness_max"] <= 8
