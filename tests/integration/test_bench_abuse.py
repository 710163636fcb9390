"""``python -m bench abuse`` on a few attacks: a live shard, a prober, and rows compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_abuse_answers_each_attack_and_sees_rows_it_changes(tmp_path: Path) -> None:
    out = tmp_path / "abuse.json"
    subprocess.run([sys.executable, "-m", "bench", "abuse", "--only",
                    "declared_ids_2e30,sgd_fp16_1e6,admin_read_no_token", "--json", str(out)],
                   cwd=ROOT, check=True, timeout=240, env={**os.environ, "COLUMNS": "160"})
    result = json.loads(out.read_text())
    rows = {r["attack"]: r for r in result["rows"]}
    assert list(rows) == ["declared_ids_2e30", "sgd_fp16_1e6", "admin_read_no_token"]
    assert rows["declared_ids_2e30"]["answer"] == "INVALID_ARGUMENT"
    assert rows["admin_read_no_token"]["answer"] == "401"
    for row in rows.values():  # every request was answered and the prober kept probing
        assert 0 < row["answer_ms"] < 20_000 and 0 < row["stall_ms"] < 20_000
        assert row["rss_mb"] is not None and row["rss_mb"] >= 0
        assert row["rows_changed"] is not None
    # a refused request changes nothing; the fp16 push saturates every row it names
    assert rows["declared_ids_2e30"]["rows_changed"] == 0 and rows["declared_ids_2e30"]["refused"]
    assert rows["sgd_fp16_1e6"]["rows_changed"] == 64 and not rows["sgd_fp16_1e6"]["refused"]
    assert result["abuse_cases"] == 3
    assert result["abuse_rows_changed"] == 0  # over the refused requests only
    assert result["abuse_rows_nonfinite"] == 0
    assert result["abuse_max_stall_ms"] == max(r["stall_ms"] for r in rows.values())
