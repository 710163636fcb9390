"""A smoke run of ``persimmon bench serve`` on tiny sizes: every figure is there, and hot swaps
under load fail no request and mix no versions (throughput figures are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from services.cli import main

KEYS = {"inprocess_records_per_s", "rest_vs_inprocess", "grpc_vs_inprocess", "latency",
        "swap_failed_requests", "swap_mixed_responses", "swap_p99_ratio",
        "incremental_export_ratio", "full_export_s", "full_export_bytes",
        "incremental_export_s", "incremental_export_bytes"}


def test_bench_serve_smoke(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--rows", "100", "--seconds", "0.3", "--rounds", "1", "--swap-seconds",
                 "1.5", "--swap-every", "0.3", "--export-rows", "5000",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert KEYS <= set(result)
    assert result["rest_failed"] == result["grpc_failed"] == 0
    assert result["rest_vs_inprocess"] > 0 and result["grpc_vs_inprocess"] > 0
    for clients in ("clients_1", "clients_8"):
        q = result["latency"][clients]
        assert q["failed"] == 0 and 0 < q["p50_ms"] <= q["p99_ms"]
    assert result["swap_failed_requests"] == 0 and result["swap_mixed_responses"] == 0
    assert result["swap_versions_seen"] >= 2  # the clients saw a swap
    assert 0 < result["incremental_export_bytes"] < result["full_export_bytes"]
