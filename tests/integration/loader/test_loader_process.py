"""The ``persimmon synth`` / ``loader`` / ``loader produce`` commands as real processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from confluent_kafka import Consumer, TopicPartition

from clients.loader_client import SyncLoaderClient
from tests.conftest import free_port
from tests.integration.loader.loader_support import MOCK_PARTITIONS

CLI = [sys.executable, "-m", "services.loader"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def wait_ready(proc: subprocess.Popen, admin_port: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("loader did not start:\n" + proc.stdout.read())
        time.sleep(0.1)


def test_synth_then_a_loader_process_serves_the_files(tmp_path):
    out = run("synth", "--rows", "3000", "--out", str(tmp_path), "--seed", "1",
              "--test-rows", "2000")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert 0.7 < summary["oracle"]["auc"] < 0.9 and summary["train_rows"] == 3000
    assert (tmp_path / "train.txt").read_bytes().count(b"\n") == 3000
    assert json.loads((tmp_path / "synthetic.json").read_text())["seed"] == 1

    grpc_port, admin_port = free_port(), free_port()
    proc = subprocess.Popen([*CLI, "loader", "--source", summary["source"], "--grpc-port",
                             str(grpc_port), "--admin-port", str(admin_port), "--batch-size",
                             "512"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(proc, admin_port)
        with SyncLoaderClient(f"127.0.0.1:{grpc_port}", credits=2) as client:
            sizes = []
            for batch in client.batches():
                sizes.append(batch.size)
                client.ack(batch)
            info = client.describe()
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert sum(sizes) == 3000 and sizes[0] == 512
    assert info.sparse_features == [f"C{i}" for i in range(1, 9)] and info.num_dense == 4
    assert "effective loader config" in output


@pytest.mark.parametrize("args,message", [
    (["loader", "--source", "hdfs:/x", "--check-config"], "unknown source kind 'hdfs'"),
    (["loader", "--batch-size", "0", "--check-config"], "batch_size must be >= 1"),
    (["synth", "--rows", "0", "--out", "x"], "argument --rows: must be >= 1, got 0"),
])
def test_bad_arguments_exit_with_a_clear_error(args, message):
    out = run(*args)
    assert out.returncode == 2 and message in out.stderr


def test_check_config_prints_the_effective_config(tmp_path):
    config = tmp_path / "loader.yaml"
    config.write_text("batch_size: 77\nsource: synthetic:10\n")
    out = run("loader", "--config", str(config), "--seed", "4", "--check-config")
    assert out.returncode == 0, out.stderr
    assert "batch_size: 77" in out.stdout and "seed: 4" in out.stdout


@pytest.mark.service
def test_loader_produce_fills_a_topic(kafka, tmp_path):
    topic = kafka.create_topic()
    path = tmp_path / "rows.txt"
    path.write_text("".join(f"{i % 2}\t{i}\tc{i}\n" for i in range(250)))
    out = run("loader", "produce", "--topic", topic, "--bootstrap", kafka.bootstrap, str(path))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"topic": topic, "records": 250}
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "ends"})
    try:
        ends = [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in range(MOCK_PARTITIONS)]
    finally:
        consumer.close()
    assert sorted(ends) == [62, 62, 63, 63]  # round-robin over the partitions
