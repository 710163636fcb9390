"""``persimmon bench compression`` at tiny size, through the CLI: the JSON summary keys are
there and numeric, the table rows carry their bytes and AUC, the goals table is printed and
the PNG is written."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from bench.compression import CASES, DCT_MP_KEEPS, DES_DIMS, EMBEDDING_PAIR, GOALS, select

# 4 steps of 64 rows a worker, 8 for DES's one worker: every figure asserted is a ratio of
# bytes per step or a structural one, and DES's runs (dims x seeds x paths) cost per step
ROWS = 512


def test_bench_compression_smoke(tmp_path) -> None:
    """In its own process: the bench forks gloo ranks, which a process holding gRPC threads
    (this test session's in-process servers) must not do."""
    out, png = tmp_path / "compression.json", tmp_path / "compression.png"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "compression", "--rows", str(ROWS),
         "--batch-size", "64", "--eval-rows", "1024", "--warmup", "0.5",
         "--cases", "grads qsgd,grads adaquant,dense dct,1-bit adam,embedding pair,des:,"
                     "same positions",
         "--seeds", "2",
         "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png.stat().st_size > 0 and "dense_dct_ratio" in proc.stdout
    result = json.loads(out.read_text())
    for key in [*GOALS, "embedding_best_ps_msg_ratio", "noise_delta_auc", "baseline_auc"]:
        assert isinstance(result[key], float) and math.isfinite(result[key]), key
    names = [r["name"] for r in result["rows_table"]]
    assert names[:2] == ["fp32 (baseline)", "fp32 (repeat: noise)"]
    # no rows codec alone: no max-ratio pair; the declared pair ran over two seeds; DES and
    # its rows path last (their own data, one worker), at each embedding dim
    assert names[2:] == ["grads qsgd s=15", "grads adaquant", EMBEDDING_PAIR.name,
                         "dense dct 0.5%", "1-bit Adam",
                         *(f"{name}, dim {dim}" for dim in DES_DIMS for name in (
                             "rows path (multi-hot data)",
                             *(c.name for c in CASES[-1 - len(DCT_MP_KEEPS):])))]
    assert result["embedding_best"] == EMBEDDING_PAIR.name and result["seeds"] == 2
    seeds = result["embedding_best_seeds"]
    assert [s["seed"] for s in seeds] == [0, 1]
    assert math.isclose(result["embedding_best_delta_auc"],
                        (seeds[0]["delta_auc"] + seeds[1]["delta_auc"]) / 2)
    assert math.isfinite(result["embedding_best_delta_auc_std"])
    for row in result["rows_table"]:
        workers = 1 if row["stream"] == "des" else 2
        assert row["steps"] == ROWS // 64 // workers and 0.0 < row["auc"] <= 1.0
        assert row["bytes_per_step"] > 0 and row["ratio"] > 0
    assert result["rows_table"][0]["delta_auc"] == 0.0
    assert result["dense_dct_ratio"] > 50 and result["onebit_adam_ratio"] > 1
    assert result["adaquant_ps_ratio"] > 1  # s of 2-3 levels: 3 bits a code against 5
    # the same rows up to rounding; bags of 20 ids from 1e5: partial sums are fewer than rows
    assert abs(result["des_delta_auc"]) < 1e-4 and result["des_bytes_ratio"] < 0.7
    assert [s["seed"] for s in result["des_seeds"]] == [0, 1]
    # DCT-MP's bytes at the socket: ids and framing are not thresholded, so the wider the
    # activations the larger the cut
    ratios = {(r["dim"], r["settings"]["activation_keep"]): r["ratio"]
              for r in result["rows_table"] if "DCT-MP" in r["name"] and "dim" in r}
    assert sorted(ratios) == [(dim, keep) for dim in DES_DIMS for keep in DCT_MP_KEEPS]
    for keep in DCT_MP_KEEPS:
        assert 1 < ratios[16, keep] < ratios[64, keep]
    for dim in DES_DIMS:  # each dim's figure is one of its rows
        assert (result[f"dct_mp_wire_ratio_d{dim}"]
                == ratios[dim, result[f"dct_mp_keep_d{dim}"]])


def test_case_selection_keeps_the_baselines() -> None:
    chosen = [c.name for c in select("powersgd")]
    assert chosen == ["fp32 (baseline)", "fp32 (repeat: noise)", "dense PowerSGD r=1 (torch)"]
    assert len(select(None)) == len(select(""))
