"""``python -m bench e2e`` at tiny size: ``persimmon train`` on files, every figure sane."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_e2e_times_persimmon_train_and_its_peer_on_the_same_files(tmp_path: Path
                                                                         ) -> None:
    out = tmp_path / "e2e.json"
    subprocess.run([sys.executable, "-m", "bench", "e2e", "--rows", "8192", "--test-rows",
                    "2048", "--max-vocab", "1000", "--repeats", "1", "--ways", "default,sync",
                    "--peers", "torch", "--data-dir", str(tmp_path / "data"),
                    "--json", str(out)],
                   cwd=ROOT, check=True, timeout=280, env={**os.environ, "COLUMNS": "160"})
    result = json.loads(out.read_text())
    assert result["rows"] == 8192 and result["test_rows"] == 2048
    assert 0.5 < result["synth"]["oracle"]["auc"] <= 1.0
    assert result["machine"]["cpu"] and result["batch_size"] > 0
    assert list(result["runs"]) == ["default", "torch", "sync"]  # the peer between the ways
    for key, r in result["runs"].items():
        assert r["samples_per_s"] > 0 and 0.5 < r["auc"] <= 1.0, key
    for key in ("default", "sync"):
        r = result["runs"][key]
        assert r["wall_s"] > 0 and r["cpu_s"] > 0 and r["batch_wait_ms"] >= 0
        # the command's wall clock holds start-up and evaluation as well as the loop
        assert 0 < r["wall_samples_per_s"] < r["samples_per_s"]
        assert math.isclose(r["wall_samples_per_s"], 8192 / r["wall_s"])
    default, sync, torch = (result["per_repeat"][0][k] for k in ("default", "sync", "torch"))
    assert math.isclose(result["e2e_vs_torch"], default["samples_per_s"] / torch["samples_per_s"])
    assert math.isclose(result["e2e_default_auc_gap"], sync["auc"] - default["auc"])
    assert result["ratios_per_repeat"]["e2e_default_auc_gap"] == [result["e2e_default_auc_gap"]]
    for absent in ("e2e_vs_torchrec", "e2e_wall_vs_torchrec", "e2e_cold_vs_warm",
                   "e2e_epochs3_vs_torchrec", "e2e_2w_default_auc_gap"):
        assert result[absent] is None and result["ratios_per_repeat"][absent] == []
