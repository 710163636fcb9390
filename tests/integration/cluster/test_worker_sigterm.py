"""``persimmon worker --checkpoint-dir`` as a real process: periodic job checkpoints found
through the registry, and SIGTERM ends it cleanly after a final complete checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid

from services.common.jobs import latest_complete, list_job_checkpoints
from services.demo import LocalPS
from services.worker.config import ps_table_configs

FEATURES = [f"C{i}" for i in range(1, 9)]


def test_sigterm_writes_a_final_checkpoint_and_exits_cleanly(tmp_path, redis_url) -> None:
    root = tmp_path / "ckpt"
    registry = f"{redis_url}?job={uuid.uuid4().hex[:8]}"
    tables = ps_table_configs({f: 4 for f in FEATURES})
    with LocalPS(2, tables, checkpoint_dir=str(root), registry=registry):
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "worker",
             "--registry", registry, "--train-data", "synthetic:100000", "--batch-size", "64",
             "--eval-rows", "512", "--checkpoint-dir", str(root),
             "--checkpoint-every-steps", "20"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 180
            while not list_job_checkpoints(root):      # a periodic one: training is on
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "no periodic checkpoint"
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out
    final = json.loads(next(line for line in out.splitlines() if "job_checkpoint" in line))
    latest = latest_complete(root)
    assert latest["checkpoint_id"] == final["job_checkpoint"]
    assert 20 <= latest["step"] < 100000 // 64        # stopped early, at a step boundary
    assert [m["step"] for m in list_job_checkpoints(root)][0] == 20
    assert "dense" in latest["parts"] and latest["num_shards"] == 2
