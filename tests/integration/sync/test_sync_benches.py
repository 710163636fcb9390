"""Smoke runs of ``persimmon bench sync`` and ``persimmon bench staleness`` at tiny sizes."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

import bench.staleness as staleness_bench
import bench.sync as sync_bench
from bench.staleness import STALENESS, default_row, staleness_config, staleness_list
from services.cli import main
from services.common.errors import ConfigError
from services.local.compare import STRATEGY_SETTINGS

TINY = ["--rows", "2048", "--eval-rows", "2048", "--batch-size", "128", "--workers", "2"]


def bench(tmp_path: Path, target: str, *extra: str) -> dict[str, Any]:
    """``persimmon bench <target>`` in this process (its workers are forked from here)."""
    out, png = tmp_path / f"{target}.json", tmp_path / f"{target}.png"
    assert main(["--log-level", "WARNING", "bench", target, *TINY, *extra,
                 "--json", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 0
    return json.loads(out.read_text())


def finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


# One strategy of each kind of cross-node figure: flat (allreduce), node-aware
# (hierarchical), none (gossip). Every strategy trains in test_sync_training.
SMOKE_STRATEGIES = ["allreduce", "hierarchical", "gossip"]


def test_bench_sync_reports_each_strategy_asked(tmp_path: Path) -> None:
    result = bench(tmp_path, "sync", "--lamb-scale", "2",
                   "--strategies", ",".join(SMOKE_STRATEGIES), "--codecs", "none,dct")
    lossy = result["lossy_averaging"]  # every pair trained or refused, the refusal named
    assert [(r["strategy"], r["codec"]) for r in lossy["rows"]] == [
        (name, codec) for name in SMOKE_STRATEGIES for codec in ("none", "dct")]
    for r in lossy["rows"]:
        if "refused" in r:
            assert r["codec"] == "dct" and r["strategy"] in r["refused"], r
        else:
            assert finite(r["auc"]) and r["within_bound"] == (
                r["auc"] >= lossy["oracle_auc"] - lossy["bound"])
    assert lossy["lossy_averaging_ok"] == all("refused" in r or r["within_bound"]
                                              for r in lossy["rows"])
    assert finite(result["oracle_auc"]) and 0.5 < result["oracle_auc"] < 1
    assert [s["name"] for s in result["strategies"]] == SMOKE_STRATEGIES
    assert set(SMOKE_STRATEGIES) <= set(STRATEGY_SETTINGS)
    for s in result["strategies"]:
        assert all(finite(s[k]) for k in ("samples_per_s", "bytes_per_step", "auc")), s
        assert s["samples_per_s"] > 0 and s["bytes_per_step"] > 0 and 0 < s["auc"] < 1
    cross = {s["name"]: s["cross_node_bytes_per_step"] for s in result["strategies"]}
    assert cross["gossip"] is None and 0 <= cross["hierarchical"] < cross["allreduce"]
    lamb = result["lamb_large_batch"]                 # 2048 rows, 2 workers: 8 and 4 steps
    assert (lamb["small"]["steps"], lamb["large"]["steps"]) == (8, 4)
    assert lamb["large"]["batch_size"] == 256 and lamb["steps_ratio"] == 0.5
    assert finite(lamb["auc_delta"]) and 0 < lamb["large"]["auc"] < 1


def test_bench_staleness_reports_every_bound(tmp_path: Path) -> None:
    result = bench(tmp_path, "staleness", "--staleness", "0,2,unbounded", "--hot-staleness", "1,2",
                   "--slow-worker", "2x")
    assert result["slow_worker"] == 2.0 and result["sync"] == "allreduce"
    assert finite(result["oracle_auc"])
    runs = result["runs"]
    assert [r["staleness"] for r in runs] == [0, 2, None, "global_sync", "8+hot", "8+hot2"]
    assert [r["mode"] for r in runs] == ["sync", "hybrid", "async", "global_sync", "hybrid",
                                         "hybrid"]
    assert runs[1]["head_ids"] == 0 and runs[4]["head_ids"] > 0  # the default: head ids
    assert runs[5]["head_ids"] > 0
    assert all(r["hot_tables"] == [] for r in runs)  # none by default
    assert runs[3]["staleness_max"] == 0
    for r in runs:
        assert finite(r["samples_per_s"]) and r["samples_per_s"] > 0
        assert finite(r["auc"]) and 0 < r["auc"] < 1
    assert runs[0]["auc_gap"] == 0.0 and runs[0]["staleness_max"] == 0
    assert runs[1]["staleness_max"] <= 2
    # the PS's count: with a slowed worker no lookup misses more than its bound of any
    # worker's pushes (the step gate), global_sync misses none, and async has no bound
    assert [r["window"] for r in runs] == [1, 2, None, 1, 8, 8]
    assert [r["bound"] for r in runs] == [1, 2, None, 0, 8, 8]
    for r in runs:
        assert 0 <= r["global_staleness_max"] <= r["total_staleness_max"], r
        if r["bound"] is not None:
            assert r["global_staleness_max"] <= r["bound"], r
            assert r["total_staleness_max"] <= max(result["workers"] * r["bound"] - 1, 0), r
    assert runs[3]["total_staleness_max"] == 0
    assert result["global_bound_holds"] is True


def test_staleness_bounds_map_to_trainer_modes() -> None:
    assert STALENESS == (0, 1, 2, 4, 8, 16, 32, None)
    assert (staleness_config(0).mode, staleness_config(0).window) == ("sync", 1)
    assert (staleness_config(16).mode, staleness_config(16).window) == ("hybrid", 16)
    assert (staleness_config("global_sync").mode,
            staleness_config("global_sync").window) == ("global_sync", 1)
    assert staleness_config(None).mode == "async" and staleness_config(None).window is None
    assert staleness_config(16).head_rate == 0  # the S rows bound every row
    default = staleness_config("8+hot")
    assert (default.staleness, default.hot_staleness) == (8, 1) and default.head_rate > 0
    assert default_row(1) == "8+hot" and default_row(2) == "8+hot2"
    one_behind = staleness_config(default_row(2))
    assert (one_behind.staleness, one_behind.hot_staleness) == (8, 2)
    assert one_behind.head_rate == default.head_rate and one_behind.global_hot
    assert staleness_list("0, 4,unbounded") == (0, 4, None)
    with pytest.raises(argparse.ArgumentTypeError, match="bad staleness '-1'"):
        staleness_list("-1")


def test_benches_reject_unknown_choices_before_starting_anything() -> None:
    with pytest.raises(ConfigError, match="unknown strategies \\['allgather'\\]"):
        sync_bench.run(strategies=["allreduce", "allgather"])
    with pytest.raises(ConfigError, match="unknown data 'avazu'"):
        staleness_bench.run(data="avazu")
    with pytest.raises(ConfigError, match="hot_staleness must be ints >= 1"):
        staleness_bench.run(hot_staleness=(1, 0))
    with pytest.raises(SystemExit) as exit_info:  # a usage error, before any training
        main(["bench", "staleness", "--hot-staleness", "1,0"])
    assert exit_info.value.code == 2
