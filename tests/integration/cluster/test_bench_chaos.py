"""Smoke run of ``persimmon bench chaos --wal`` with two kills (a PS shard, restarted from its
write-ahead log with no rollback, and the loader, a rollback to the newest cut): every record
counted once, the acked probe pushes all there."""

from __future__ import annotations

import json

from services.cli import build_parser


def test_bench_chaos_smoke(tmp_path) -> None:
    out = tmp_path / "chaos.json"
    args = build_parser().parse_args(
        ["bench", "chaos", "--kills", "2", "--records", "5000", "--cut-every", "5",
         "--max-gap", "0", "--wal", "--json", str(out)])  # each kill within 2 cuts: 10 of 25 steps
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["kills"] == 2 and result["unplanned_restarts"] == 0
    assert result["records_lost"] == 0 and result["applied_twice"] == 0
    assert result["occurrences_off"] == 0
    assert result["acked_lost_with_wal"] == 0 and result["wal"] == "batch"
    assert result["kills_by_role"]["ps"] == 1
    assert result["finished"] is True and result["final_step"] == result["steps"] == 25
    assert all(r["median"] > 0 for r in result["recovery_s"].values())
