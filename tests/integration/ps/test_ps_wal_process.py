"""The write-ahead log against a real shard process SIGKILLed between checkpoints: counting
tables (rows = occurrences applied) read after the restart must hold every acknowledged push
exactly once."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import numpy as np
import pytest
import yaml

from clients.admin_client import AdminClient
from clients.ps_client import PSClient
from services.local.processes import start_service, stop_processes, wait_ready

IDS = np.arange(32, dtype=np.uint64)
TABLE = {"name": "count", "dim": 1, "initializer": "zeros",
         "optimizer": {"kind": "sgd", "lr": 1.0}}


class Shard:
    """One ``persimmon ps`` process with a WAL; :meth:`restart` on the same ports."""

    def __init__(self, tmp_path, fsync: str) -> None:
        config = tmp_path / "ps.yaml"
        config.write_text(yaml.safe_dump({"tables": [TABLE]}))
        self.command = [sys.executable, "-m", "services.ps", "--log-level", "ERROR",
                        "--config", str(config), "--checkpoint-dir", str(tmp_path / "ckpt"),
                        "--wal-dir", str(tmp_path / "wal"), "--wal-fsync", fsync]
        self.proc, grpc_port, admin_port = start_service(self.command,
                                                         str(tmp_path / "ready"))
        self.command += ["--grpc-port", str(grpc_port), "--admin-port", str(admin_port)]
        self.address = f"127.0.0.1:{grpc_port}"
        self.admin = f"http://127.0.0.1:{admin_port}"

    def restart(self) -> None:
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL)
        wait_ready(self.proc, self.admin)


async def counts(address: str) -> list[int]:
    async with PSClient([address]) as client:
        return (await client.lookup("count", IDS))[:, 0].astype(int).tolist()


async def test_acked_pushes_survive_a_sigkill_between_checkpoints(tmp_path):
    """Pushes stream on while the shard is killed and restarted (no --restore: from its log):
    every push, acked before the kill or retried after it, is applied exactly once. Without
    the log (or with an ack before the append) the rows would fall back to the checkpoint; a
    push in flight at the kill whose record made it is answered from the recovered window
    when retried (replay without the window: tests/unit/ps/test_ps_wal.py)."""
    shard = Shard(tmp_path, "never")  # a process crash loses nothing even unsynced
    try:
        pushes, acked = 40, asyncio.Event()
        async with PSClient([shard.address], retry_s=60.0) as client:
            async def one() -> None:
                await client.push("count", IDS, np.full((IDS.size, 1), -1.0, np.float32))

            async def stream() -> None:
                for i in range(pushes):
                    await asyncio.gather(one(), one())  # two in flight
                    if i == 10:
                        async with AdminClient(shard.admin) as admin:
                            await admin.checkpoint("c1")
                    if i == 25:
                        acked.set()

            task = asyncio.create_task(stream())
            await acked.wait()
            shard.proc.send_signal(signal.SIGKILL)
            shard.proc.wait()
            await asyncio.to_thread(shard.restart)
            await task
        assert await counts(shard.address) == [2 * pushes] * IDS.size
    finally:
        stop_processes([shard.proc])


async def test_a_job_checkpoint_waits_for_a_shard_that_is_restarting(tmp_path):
    """retry_s: a cut taken while a shard restarts (from its WAL) completes once it is back;
    without it the unreachable shard fails the checkpoint."""
    from services.common.errors import Unavailable
    from services.common.ports import free_port
    from services.ps.config import PSConfig
    from services.ps.service import PSService
    from services.worker.job_checkpoints import JobCheckpointer

    root = tmp_path / "ckpt"
    url = f"http://127.0.0.1:{(port := free_port())}"
    with pytest.raises(Unavailable, match="did not take checkpoint c0"):
        await JobCheckpointer(root, admin_urls=[url]).checkpoint(0, "c0")
    cut = asyncio.create_task(JobCheckpointer(root, admin_urls=[url], retry_s=30.0)
                              .checkpoint(1, "c1"))
    service = PSService(PSConfig(grpc_port=0, admin_port=port, checkpoint_dir=str(root),
                                 wal_dir=str(tmp_path / "wal"), tables=[]))
    await service.start()
    try:
        assert (await cut)["checkpoint_id"] == "c1"
        assert service.shard.wal is not None and service.shard.wal.base == "c1"
    finally:
        await service.close()
