"""Smoke run of ``persimmon bench plan`` at a tiny size: both ways plan every batch, their
plans agree, the paired ratio comes out."""

from __future__ import annotations

import json

from services.cli import build_parser


def test_bench_plan_smoke(tmp_path) -> None:
    out = tmp_path / "plan.json"
    args = build_parser().parse_args(
        ["bench", "plan", "--batch-sizes", "64,256", "--batches", "2", "--repeats", "2",
         "--shards", "3", "--json", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert set(result["batch_sizes"]) == {"64", "256"}
    for size, row in result["batch_sizes"].items():
        assert row["ids"] == 26 * int(size)
        assert row["ms"] > 0 and row["numpy_ms"] > 0 and row["vs_numpy"] > 0
