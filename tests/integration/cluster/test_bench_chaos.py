"""Smoke run of ``persimmon bench chaos`` with two kills: every record counted once."""

from __future__ import annotations

import json

from services.cli import build_parser


def test_bench_chaos_smoke(tmp_path) -> None:
    out = tmp_path / "chaos.json"
    args = build_parser().parse_args(
        ["bench", "chaos", "--kills", "2", "--records", "5000", "--cut-every", "5",
         "--max-gap", "0", "--json", str(out)])  # each kill within 2 cuts: 10 of 25 steps
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["kills"] == 2 and result["unplanned_restarts"] == 0
    assert result["records_lost"] == 0 and result["applied_twice"] == 0
    assert result["occurrences_off"] == 0
    assert result["finished"] is True and result["final_step"] == result["steps"] == 25
    assert all(r["median"] > 0 for r in result["recovery_s"].values())
