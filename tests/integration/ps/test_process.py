"""`persimmon ps` as real processes: two shards, a blocking client, resharding, SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import yaml

from clients.sync_ps_client import SyncPSClient


def start_shards(n: int, config_path, ckpt_dir, restore: str | None = None):
    """``n`` shard processes on ports 0, started together: the ports each bound are read
    from its ready file (no race with another process, a parallel test's included, for a
    port picked beforehand)."""
    procs = []
    for k in range(n):
        ready = ckpt_dir.parent / f"shard-{k}-of-{n}.ready"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "services.cli", "ps", "--shard-id", str(k),
               "--num-shards", str(n), "--grpc-port", "0", "--admin-port", "0",
               "--ready-file", str(ready), "--config", str(config_path),
               "--checkpoint-dir", str(ckpt_dir)]
        if restore:
            cmd += ["--restore", restore]
        procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True), ready))
    deadline = time.monotonic() + 60
    shards = []
    for proc, ready in procs:
        while not ready.exists():  # written atomically once the shard serves
            if proc.poll() is not None or time.monotonic() > deadline:
                for p, _ in procs:
                    p.kill()
                raise RuntimeError("shard did not start:\n" + proc.stdout.read())
            time.sleep(0.05)
        ports = json.loads(ready.read_text())
        shards.append((proc, f"127.0.0.1:{ports['grpc_port']}",
                       f"http://127.0.0.1:{ports['admin_port']}"))
    return shards


def stop(proc) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    return out


def test_two_shard_processes_round_trip_checkpoint_and_reshard(tmp_path):
    config = tmp_path / "ps.yaml"
    config.write_text(yaml.safe_dump({"tables": [
        {"name": "user", "dim": 8, "optimizer": {"kind": "adam", "lr": 0.01}}]}))
    ckpt = tmp_path / "ckpt"
    shards = start_shards(2, config, ckpt)
    ids = np.arange(1000, dtype=np.uint64)
    grads = np.random.default_rng(1).normal(size=(1000, 8)).astype(np.float32)
    try:
        with SyncPSClient([s[1] for s in shards], rows_codec="fp16") as ps:
            ps.push("user", ids, grads)
            rows = ps.lookup("user", ids)
        for _, _, admin in shards:
            req = urllib.request.Request(admin + "/v1/checkpoints", method="POST",
                                         data=json.dumps({"id": "ck"}).encode(),
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 201
    finally:
        outputs = [stop(p) for p, _, _ in shards]
    assert "effective ps config" in outputs[0]
    # the same checkpoint served by 3 shards: every row comes back identical
    shards = start_shards(3, config, ckpt, restore="ck")
    try:
        with SyncPSClient([s[1] for s in shards], rows_codec="fp16") as ps:
            np.testing.assert_array_equal(ps.lookup("user", ids), rows)
            stats = ps.stats("user")
        assert sum(s.tables["user"].rows for s in stats) == 1000
    finally:
        for p, _, _ in shards:
            stop(p)


def test_bad_flags_exit_with_a_clear_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "services.cli", "ps", "--shard-id", "3",
                             "--num-shards", "2"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "shard_id must be in [0, 2)" in result.stderr
    bad = tmp_path / "ps.yaml"
    bad.write_text("tables: []\ncolour: red\n")
    result = subprocess.run([sys.executable, "-m", "services.cli", "ps", "--config", str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "unknown keys ['colour']" in result.stderr
