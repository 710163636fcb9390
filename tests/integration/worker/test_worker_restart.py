"""A worker process killed mid-run and started again rejoins: the loader re-sends the batches
it never acknowledged, training finishes, and the PS holds only sane rows."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from clients.ps_client import PSClient
from services.common.ports import free_port
from services.loader.planted import SyntheticConfig
from services.local.processes import LocalLoader, LocalPS
from services.worker.config import ps_table_configs

ROWS, BATCH = 16384, 256
FEATURES = SyntheticConfig().sparse_names


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def _worker(cluster: LocalPS, loader: LocalLoader, out: Path, admin_port: int
            ) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "worker",
         "--ps", ",".join(cluster.addresses), "--loader", loader.address, "--mode", "hybrid",
         "--staleness", "8", "--pooling", "mean", "--admin-port", str(admin_port),
         "--summary-json", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _steps(admin_port: int) -> int:
    try:
        return int(_get(f"http://127.0.0.1:{admin_port}/v1/progress")["step"])
    except OSError:  # not serving yet
        return 0


async def test_killed_worker_restarts_and_finishes_without_corrupting_the_ps(tmp_path):
    tables = ps_table_configs(dict.fromkeys(FEATURES, 8))
    with LocalPS(2, tables) as cluster, \
            LocalLoader(f"synthetic:{ROWS}", batch_size=BATCH, world_size=1) as loader:
        port = free_port()
        first = _worker(cluster, loader, tmp_path / "first.json", port)
        deadline = time.monotonic() + 120
        while _steps(port) < 20:
            assert first.poll() is None, first.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the first worker made no progress"
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)
        first.wait()
        acked_before = _get(f"{loader.admin_url}/v1/workers")
        second = _worker(cluster, loader, tmp_path / "second.json", free_port())
        _, err = second.communicate(timeout=180)
        assert second.returncode == 0, err.decode()[-3000:]
        summary = json.loads((tmp_path / "second.json").read_text())
        # the restarted worker trained on exactly the batches the killed one left unacked
        acked = acked_before["ranks"]["0"]["acked"]
        assert 20 - 8 <= acked < ROWS // BATCH  # 20 steps seen, at most S = 8 pushes unacked
        assert summary["steps"] == ROWS // BATCH - acked
        after = _get(f"{loader.admin_url}/v1/workers")["ranks"]["0"]
        assert after["acked"] == ROWS // BATCH and after["redelivered"] >= 1
        assert not (tmp_path / "first.json").exists()
        async with PSClient(cluster.addresses) as ps:
            stats = await ps.stats()
            for shard in stats:
                for name, table in shard.tables.items():
                    assert table.dropped_nonfinite == 0, name
            ids = np.random.default_rng(0).integers(0, 2**63, 50, dtype=np.uint64)
            assert np.isfinite(await ps.lookup("C1", ids)).all()
