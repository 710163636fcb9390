"""Smoke runs of the PS benchmarks (store, push dedup, scale) on tiny sizes: they run and check
their own arithmetic."""

from __future__ import annotations

import pytest

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


def test_bench_scale_smoke(tmp_path, capsys):
    import argparse
    import json

    from bench.scale import register_bench

    parser = argparse.ArgumentParser()
    register_bench(parser.add_subparsers())
    args = parser.parse_args(["scale", "--ram-sizes", "3000", "--disk-sizes", "3000",
                              "--ram-rows", "300", "--batch", "256", "--steps", "2",
                              "--optimizer", "rowwise_adagrad", "--probe-mb", "1", "--repeats", "3",
                              "--path", str(tmp_path), "--json", str(tmp_path / "s.json"),
                              "--plot", str(tmp_path / "s.png")])
    assert args.func(args) == 0
    r = json.loads((tmp_path / "s.json").read_text())
    ram, disk = r["cases"]
    assert (ram["tier"], disk["tier"]) == ("ram", "disk") and ram["hit_ratio"] == 1.0
    assert r["optimizer"] == "rowwise_adagrad"
    assert ram["payload_bytes_per_row"] == 16 * 4 + 4  # dim 16 fp32 row + one accumulator
    assert 0 < disk["hit_ratio"] < 1 and disk["disk_rows"] >= 3000 - 300 - 256
    assert disk["cold_rows_per_s"] > 0 and disk["settle_steps"] >= 1 and "settle_steps" not in ram
    assert r["disk_read_us"] is None or 0 < r["disk_read_us"] < 1e5  # None: no O_DIRECT there
    assert disk["disk_bytes_per_row"] > 0 == ram["disk_bytes_per_row"]
    assert disk["ram_bytes_per_row"] < ram["ram_bytes_per_row"]
    ratios = [a / b for a, b in zip(disk["rounds_rows_per_s"], ram["rounds_rows_per_s"], strict=True)]
    assert len(ratios) == r["repeats"] == 3 and min(ratios) <= r["tiered_vs_ram"] <= max(ratios)
    assert sorted(disk["rounds_rows_per_s"])[1] == disk["rows_per_s"]  # the median round
    assert (tmp_path / "s.png").stat().st_size > 0
    assert "tiered_vs_ram" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("persimmon-scale")] == []
    with pytest.raises(SystemExit):
        parser.parse_args(["scale", "--ram-sizes", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["scale", "--optimizer", "adamw"])
