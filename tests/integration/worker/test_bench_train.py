"""``persimmon bench train`` at tiny size: every figure is there and sane."""

from __future__ import annotations

import math

from bench.peers import torchrec_available
from bench.train import RUNS, hybrid_ceiling, median_run, paired_ratios, run


def test_bench_train_reports_both_ratios_from_its_own_runs() -> None:
    result = run(rows=4096, batch_size=512, repeats=1)
    runs = result["runs"]
    assert set(runs) == set(RUNS) - (set() if torchrec_available() else {"torchrec"})
    for r in runs.values():
        assert r["samples_per_s"] > 0 and 0.5 < r["auc"] <= 1.0
        assert r["samples_per_s_runs"] == [r["samples_per_s"]]
        assert math.isclose(r["ms_per_step"], 1e3 * 512 / r["samples_per_s"])
    assert math.isclose(result["vs_local"],
                        runs["hybrid"]["samples_per_s"] / runs["local"]["samples_per_s"])
    assert math.isclose(result["hybrid_vs_sync"],
                        runs["hybrid"]["samples_per_s"] / runs["sync"]["samples_per_s"])
    assert math.isclose(result["hybrid_vs_fastest_sync"], runs["hybrid"]["samples_per_s"] / max(
        runs["sync"]["samples_per_s"], runs["sync_in_process"]["samples_per_s"]))
    for key in ("hybrid", "sync", "hybrid_in_process", "sync_in_process"):
        assert 0 < runs[key]["step_cpu_ms"] <= 1.2 * runs[key]["step_wall_ms"]
        assert runs[key]["batch_wait_ms"] >= 0
        cpu = runs[key]["cpu_ms_per_step"]  # this process and the PS processes did work
        assert cpu["worker"] >= runs[key]["step_cpu_ms"] * 0.9 and cpu["ps"] > 0
    floor = max(sum(runs["hybrid"]["cpu_ms_per_step"].values()) / result["cores"],
                runs["hybrid"]["step_cpu_ms"])
    assert math.isclose(result["hybrid_vs_sync_ceiling"], runs["sync"]["ms_per_step"] / floor)
    assert {k: len(v) for k, v in result["ratios_per_repeat"].items()} == {
        "vs_local": 1, "vs_torch": 1, "vs_torchrec": int(torchrec_available()),
        "hybrid_vs_sync": 1, "hot_vs_sync": 1, "hybrid_vs_fastest_sync": 1,
        "hybrid_vs_sync_ceiling": 1}
    fastest = max(runs[k]["samples_per_s"] for k in ("hybrid", "hybrid_hot", "sync",
                                                     "hybrid_in_process", "sync_in_process"))
    assert math.isclose(result["vs_torch"], fastest / runs["torch"]["samples_per_s"])
    assert math.isclose(result["hot_vs_sync"],
                        runs["hybrid_hot"]["samples_per_s"] / runs["sync"]["samples_per_s"])
    assert runs["hybrid_hot"]["staleness_max"] == 0  # the toy tables are all hot
    assert runs["sync"]["staleness_max"] == 0 and runs["hybrid"]["staleness_max"] <= 8
    assert runs["sync_in_process"]["staleness_max"] == 0


def test_median_run_is_the_middle_by_samples_per_s() -> None:
    runs = [{"samples_per_s": v, "tag": t} for v, t in ((3.0, "a"), (1.0, "b"), (2.0, "c"))]
    assert median_run(runs) == {"samples_per_s": 2.0, "tag": "c",
                                 "samples_per_s_runs": [3.0, 1.0, 2.0]}
    assert median_run(runs[:2])["tag"] == "b"  # the lower middle of two


def test_ceiling_is_sync_step_over_the_larger_floor() -> None:
    hybrid = {"cpu_ms_per_step": {"worker": 10.0, "ps": 4.0}, "step_cpu_ms": 6.0}
    assert math.isclose(hybrid_ceiling(hybrid, 12.0, cores=2), 12.0 / 7.0)  # CPU-bound
    assert math.isclose(hybrid_ceiling(hybrid, 12.0, cores=4), 12.0 / 6.0)  # compute-bound
    assert hybrid_ceiling({**hybrid, "cpu_ms_per_step": {"worker": 10.0, "ps": None}},
                          12.0, cores=2) is None


def test_ratios_pair_the_runs_of_each_repeat() -> None:
    """Each ratio divides runs of the same repeat; the drift between repeats cancels out."""
    def runs(*speeds: float) -> list[dict]:
        return [{"samples_per_s": v, "step_cpu_ms": 1.0,
                 "cpu_ms_per_step": {"worker": 2.0, "ps": 2.0}} for v in speeds]

    every = {"local": runs(100, 50), "hybrid": runs(150, 75), "sync": runs(100, 50),
             "sync_in_process": runs(120, 40), "hybrid_in_process": runs(1, 1),
             "hybrid_hot": runs(110, 60), "torch": runs(300, 50)}
    ratios = paired_ratios(every, batch_size=1000, cores=2)
    assert ratios["vs_local"] == [1.5, 1.5] and ratios["hybrid_vs_sync"] == [1.5, 1.5]
    assert ratios["hybrid_vs_fastest_sync"] == [1.25, 1.5]
    assert ratios["vs_torch"] == [0.5, 1.5] and ratios["vs_torchrec"] == []  # not run
    assert ratios["hot_vs_sync"] == [1.1, 1.2]
    assert ratios["hybrid_vs_sync_ceiling"] == [10_000 / 2, 20_000 / 2]  # sync ms / CPU floor
