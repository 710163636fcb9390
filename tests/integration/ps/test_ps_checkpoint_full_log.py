"""A job cut that meets a shard whose log's disk is full (a real tmpfs, filled): the shard
answers UNAVAILABLE naming its log (it was an unhandled 500), and a checkpointer with ``retry_s`` asks it again until the disk
has room, instead of failing the job. It used to fail the cut, so the worker holding the
checkpointer exited and ``bench chaos --wal`` restarted the job unplanned (its smoke test
tolerated one such restart). Needs root (it mounts the tmpfs)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import subprocess
import time

import pytest

from services.common.errors import Unavailable
from services.ps.config import PSConfig
from services.ps.service import PSService
from services.ps.tables import TableConfig
from services.worker.job_checkpoints import JobCheckpointer


def fill(path: str) -> None:
    """Write ``path`` until its file system has no room left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 16, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\xff" * size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)


@pytest.fixture
def full_log_dir(tmp_path):
    if os.geteuid() != 0:  # must run, never skip
        pytest.fail("this test mounts a tmpfs for the shard's log: run the suite as root")
    wal = tmp_path / "wal"
    wal.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(wal)], check=True)
    try:
        yield wal
    finally:
        subprocess.run(["umount", "-l", str(wal)], check=True)


async def test_a_cut_waits_for_a_shard_whose_log_is_full(tmp_path, full_log_dir, caplog):
    root = tmp_path / "ckpt"
    service = PSService(PSConfig(grpc_port=0, admin_port=0, checkpoint_dir=str(root),
                                 wal_dir=str(full_log_dir), tables=[TableConfig(name="t", dim=1)]))
    await service.start()
    filler = full_log_dir / "filler"
    try:
        fill(str(filler))
        with pytest.raises(Unavailable, match="cannot start a segment") as refused:
            await JobCheckpointer(root, admin_urls=[service.admin_url]).checkpoint(0, "c0")
        assert "did not take checkpoint c0" in str(refused.value)  # no retry_s: refused
        caplog.set_level(logging.WARNING, logger="services.common.retry")
        cut = asyncio.create_task(JobCheckpointer(
            root, admin_urls=[service.admin_url], retry_s=60.0).checkpoint(1, "c1"))
        deadline = time.monotonic() + 60
        while not any("checkpoint c1" in r.getMessage() for r in caplog.records):
            assert not cut.done(), cut  # refused while full: it must wait, not fail
            assert time.monotonic() < deadline, "the full log never refused the cut"
            await asyncio.sleep(0.01)
        filler.unlink()
        assert (await cut)["checkpoint_id"] == "c1"
        await JobCheckpointer(root, admin_urls=[service.admin_url]).checkpoint(2, "c2")
        assert service.shard.wal is not None and service.shard.wal.base == "c2"  # log back
    finally:
        await service.close()
