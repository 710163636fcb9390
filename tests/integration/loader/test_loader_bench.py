"""Smoke runs of ``persimmon bench loader`` on a tiny file and a tiny Kafka topic (figures are
not asserted)."""

from __future__ import annotations

import json

import pytest

from bench import loader_kafka
from bench.loader import csv_module_pipeline, persimmon_pipeline, write_criteo_file
from services.cli import main
from services.common.errors import ConfigError


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


@pytest.mark.service
def test_bench_loader_kafka_smoke(tmp_path, capsys):
    """Both clients read every record of a mock broker's topic (figures are not asserted)."""
    out = tmp_path / "kafka.json"
    assert main(["bench", "loader", "--source", "kafka", "--rows", "600", "--repeat", "1",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["records"] == 600 and result["goal"] == 1.5
    assert result["vs_aiokafka"] > 0 and result["persimmon_records_per_s"] > 0
    assert "bench loader --source kafka" in capsys.readouterr().out


def test_bench_loader_kafka_refuses_more_than_the_mock_keeps():
    with pytest.raises(ConfigError, match="give at most 60,000 rows"):
        loader_kafka.run(records=200_000, repeat=1)
