"""Smoke run of the store benchmark on a tiny size: it runs and checks its own arithmetic."""

from __future__ import annotations

from bench.store import bench_store, main


def test_bench_store_smoke(capsys):
    r = bench_store(num_ids=2000, dim=4, repeats=1)
    assert r["num_ids"] == 2000 and r["dim"] == 4
    assert r["store_s"] > 0 and r["dict_s"] > 0
    assert r["store_vs_dict"] == r["dict_s"] / r["store_s"]
    assert r["max_abs_err"] < 1e-6  # the store's Adagrad push follows the formula
    main(["1000", "4"])
    out = capsys.readouterr().out
    assert "EmbeddingTable" in out and "python dict" in out and "store_vs_dict" in out


def test_bench_push_dedup_smoke(capsys):
    from bench.push_dedup import bench_push_dedup

    r = bench_push_dedup(batch=64, seconds=0.0)
    assert r["rounds"] >= 3 and r["batch_ids"] == 64
    assert r["rows_per_s_with_check"] > 0 and r["rows_per_s_without"] > 0
    assert r["ratio"] > 0 and r["retry_answer_ms"] > 0
