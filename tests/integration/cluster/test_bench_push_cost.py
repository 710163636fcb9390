"""Smoke run of ``persimmon bench push_cost`` at a tiny size: every way trains, the paired
ratios come out."""

from __future__ import annotations

import json

from services.cli import build_parser


def test_bench_push_cost_smoke(tmp_path) -> None:
    out = tmp_path / "push_cost.json"
    args = build_parser().parse_args(
        ["bench", "push_cost", "--rows", "512", "--batch-size", "256", "--repeats", "2",
         "--shards", "1", "--wal-fsync", "always", "--work-dir", str(tmp_path),
         "--json", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert set(result["samples_per_s"]) == {"off", "on", "wal_always"}
    assert all(len(v) == 2 and min(v) > 0 for v in result["samples_per_s_runs"].values())
    assert result["on_vs_off"] > 0 and result["wal_always_vs_off"] > 0
    assert list(tmp_path.glob("persimmon-push-cost-*")) == []  # the WALs are cleaned up
