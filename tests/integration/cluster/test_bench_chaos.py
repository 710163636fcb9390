"""Smoke run of ``persimmon bench chaos --wal`` with one fault of each of its 7 roles (a PS
shard restarted from its write-ahead log, the loader, a worker, a PS shard during a cut, a
WAL append cut short by a full tmpfs, a REST restore under pushes, a partitioned worker
retrying after the restart): every record counted once, no acked update lost, no zombie push
applied, every stale push refused, no cut with a restored shard's part beside the others'. Needs root (it mounts a tmpfs per shard)."""

from __future__ import annotations

import json
import os

import pytest

from services.cli import build_parser

ZERO = ("records_lost", "applied_twice", "occurrences_off", "acked_lost_with_wal",
        "wal_fault_acked_lost", "zombie_pushes_applied", "unplanned_restarts",
        "inconsistent_cuts")


def test_bench_chaos_wal_faults_smoke(tmp_path) -> None:
    if os.geteuid() != 0:  # must run, never skip
        pytest.fail("bench chaos --wal mounts a tmpfs per shard: run the suite as root")
    out = tmp_path / "chaos.json"
    args = build_parser().parse_args(
        ["bench", "chaos", "--kills", "7", "--records", "12000", "--cut-every", "5",
         "--max-gap", "0", "--wal", "--json", str(out)])  # each fault within 2 cuts of 60 steps
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["kills_by_role"] == {role: 1 for role in (
        "ps", "loader", "worker", "ps-cut", "enospc", "restore", "partition")}
    for key in ZERO:
        assert result[key] == 0, (key, result)
    assert result["unplanned_causes"] == [], result
    assert result["wal_fault_pushes_refused"] > 0  # the full log refused pushes: it bit
    assert result["stale_pushes_refused"] > 0 and result["workers_stale"] > 0  # fenced
    assert result["partition_retries_refused"] == result["partitioned_exited"] == 1
    assert result["cuts_refused"] is not None and result["wal"] == "batch"
    assert result["finished"] is True and result["final_step"] == result["steps"] == 60
    assert all(r["median"] > 0 for r in result["recovery_s"].values())
    assert not [line for line in open("/proc/mounts") if "persimmon-chaos-" in line]


def test_bench_chaos_without_wal_has_null_wal_figures(tmp_path) -> None:
    out = tmp_path / "chaos.json"
    args = build_parser().parse_args(
        ["bench", "chaos", "--kills", "1", "--records", "2000", "--cut-every", "5",
         "--max-gap", "0", "--json", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["kills"] == 1 and result["records_lost"] == result["applied_twice"] == 0
    assert result["zombie_pushes_applied"] is None and result["wal_fault_acked_lost"] is None
    assert result["null_reasons"] == {"*": "measured with --wal only"}
