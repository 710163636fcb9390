"""``persimmon bench load`` at a tiny size: the figures exist, are consistent, and the CLI
knows the target."""

from __future__ import annotations

import json

from bench.load import run
from services.cli import build_parser


def test_bench_load_smoke():
    result = run(seconds=1.0, clients=2, universe=4000, batch=64, warmup_s=0.5, baseline_s=0.5,
                 sample_every_s=0.5)
    assert result["ops_per_s"] > 0 and result["baseline_ops_per_s"] > 0
    assert 0 < result["p50_ms"] <= result["p99_ms"]
    assert len(result["rss_samples_mb"]) == 3  # after warm-up, then every 0.5 s
    assert result["rss_growth_mb"] == result["rss_samples_mb"][-1] - result["rss_after_warmup_mb"]
    json.dumps(result)


def test_bench_load_is_a_cli_target():
    args = build_parser().parse_args(["bench", "load", "--seconds", "3", "--clients", "5",
                                      "--json", "out.json"])
    assert (args.seconds, args.clients, args.json, args.soak) == (3.0, 5, "out.json", False)
