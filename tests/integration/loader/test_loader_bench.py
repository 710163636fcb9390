"""A smoke run of ``persimmon bench loader`` on a tiny file (figures are not asserted)."""

from __future__ import annotations

import json

from bench.loader import csv_module_pipeline, persimmon_pipeline, write_criteo_file
from services.cli import main


def test_bench_loader_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "loader", "--rows", "2000", "--repeat", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rows"] == 2000 and result["goal"] == 2.0
    assert result["vs_csv_module"] > 0 and result["persimmon_rows_per_s"] > 0
    assert f"vs_{result['headline_baseline']}" in result
    assert "persimmon bench loader" in capsys.readouterr().out


def test_bench_pipelines_batch_every_row(tmp_path):
    path = tmp_path / "c.txt"
    write_criteo_file(path, 5000, seed=3)
    assert persimmon_pipeline(str(path)) == csv_module_pipeline(str(path)) == 5000
