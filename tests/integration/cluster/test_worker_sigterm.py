"""``persimmon worker --checkpoint-dir`` as a real process: periodic job checkpoints found
through the registry, SIGTERM ends it cleanly after a final complete checkpoint, and
``--resume`` carries on from that checkpoint's step."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid

from services.common.checkpoints import latest_complete, list_job_checkpoints
from services.local.processes import LocalPS
from services.worker.config import ps_table_configs

FEATURES = [f"C{i}" for i in range(1, 9)]


def worker(registry: str, root, rows: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "worker",
            "--registry", registry, "--train-data", f"synthetic:{rows}", "--batch-size", "64",
            "--eval-rows", "512", "--checkpoint-dir", str(root), *extra]


def test_sigterm_writes_a_final_checkpoint_then_resume(tmp_path, redis_url) -> None:
    root = tmp_path / "ckpt"
    registry = f"{redis_url}?job={uuid.uuid4().hex[:8]}"
    tables = ps_table_configs({f: 4 for f in FEATURES})
    with LocalPS(2, tables, checkpoint_dir=str(root), registry=registry):
        proc = subprocess.Popen(worker(registry, root, 30000, "--checkpoint-every-steps", "20"),
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
        stopped_at = latest_complete(root)["step"]
        resumed = subprocess.run(worker(registry, root, (stopped_at + 5) * 64, "--resume"),
                                 capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert latest_complete(root)["step"] == stopped_at + 5   # 5 more steps, not from 0
    assert proc.returncode == 0, out
    final = json.loads(next(line for line in out.splitlines() if "job_checkpoint" in line))
    latest = next(m for m in list_job_checkpoints(root) if m["step"] == stopped_at)
    assert latest["checkpoint_id"] == final["job_checkpoint"]
    assert 20 <= latest["step"] < 30000 // 64         # stopped early, at a step boundary
    assert [m["step"] for m in list_job_checkpoints(root)][0] == 20
    assert "dense" in latest["parts"] and latest["num_shards"] == 2
