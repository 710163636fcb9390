"""The write-ahead log fails stop (services/ps/wal.py): a real Shard whose log writes through a
real file that fails on purpose (a write that runs out of space part-way, an fsync that
fails). A failed append or fsync acknowledges nothing, applies nothing, and leaves no half
record in front of later pushes; a fresh shard then recovers exactly the acked pushes."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from services.common.errors import Unavailable
from services.ps.config import PSConfig
from services.ps.dedup import PushOrigin
from services.ps.segments import OsSegmentFile
from services.ps.shard import Shard
from services.ps.wal import WalFsync
from tests.unit.ps.counting import applied_counts, count_grads, counting_table

IDS = np.arange(10, dtype=np.uint64)
_OPEN: list[Shard] = []


@dataclass
class Faults:
    """What the segment files do wrong: ``space`` bytes left (None: plenty), fsync fails."""

    space: int | None = None
    fsync_fails: bool = False


class FaultyFile(OsSegmentFile):
    """A real segment file on disk that runs out of space and fails fsyncs when told."""

    def __init__(self, path: Path, faults: Faults) -> None:
        super().__init__(path)
        self.faults = faults

    def write(self, data: memoryview) -> int:
        space = self.faults.space
        if space is None:
            return super().write(data)
        if space == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        written = super().write(data[:space])  # a short write: part of the record lands
        self.faults.space = space - written
        return written

    def fsync(self) -> None:
        if self.faults.fsync_fails:
            raise OSError(errno.EIO, "Input/output error")
        super().fsync()


@pytest.fixture(autouse=True)
def _close_shards() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def make_shard(tmp_path, faults: Faults | None = None, **kw) -> Shard:
    config = PSConfig(tables=[counting_table("count")], wal_dir=str(tmp_path / "wal"), **kw)
    shard = Shard(config) if faults is None else Shard(
        config, open_segment=lambda path: FaultyFile(path, faults))
    _OPEN.append(shard)
    return shard


def counts(shard: Shard) -> list[int]:
    rows, present = shard.table("count").peek(IDS)
    return applied_counts(np.where(present[:, None], rows, 0)).astype(int).tolist()


def push(shard: Shard, seq: int) -> None:
    shard.push_many_sync(["count"], [IDS.size], IDS, count_grads(IDS.size),
                         origin=PushOrigin(7, seq))


def recovered(tmp_path) -> tuple[Shard, dict[str, int]]:
    shard = make_shard(tmp_path)
    return shard, asyncio.run(shard.recover())


def test_a_half_written_append_is_not_acked_and_later_pushes_survive(tmp_path):
    """Disk full part-way through a record: that push is refused (UNAVAILABLE) and not
    applied; so is the next while there is no space; once there is, the log is cut back to
    its last good record and takes pushes again. Recovery then holds every acked push (the
    half record used to stay in the log, and recovery cut every later push off with it)."""
    faults = Faults()
    shard = make_shard(tmp_path, faults)
    asyncio.run(shard.recover())
    push(shard, 1)
    faults.space = 20
    with pytest.raises(Unavailable, match="No space left"):
        push(shard, 2)
    with pytest.raises(Unavailable, match="cut back"):
        push(shard, 3)
    assert counts(shard) == [1] * 10 and shard.wal is not None and shard.wal.failed
    faults.space = None  # space freed
    push(shard, 3)
    push(shard, 2)  # the refused push, retried: applied now (it never was)
    push(shard, 4)
    assert counts(shard) == [4] * 10 and shard.wal.failed is None
    again, got = recovered(tmp_path)
    assert counts(again) == [4] * 10
    assert got == {"pushes": 4, "skipped": 0, "changes": 0, "dropped_bytes": 0}


def test_an_fsync_error_before_an_ack_refuses_the_push(tmp_path):
    """Under wal_fsync=always a failed fsync is a refused push, and its written record is cut
    back before the next append: recovery never applies a push that was not acked."""
    faults = Faults()
    shard = make_shard(tmp_path, faults, wal_fsync=WalFsync.ALWAYS)
    asyncio.run(shard.recover())
    push(shard, 1)
    faults.fsync_fails = True
    with pytest.raises(Unavailable, match="Input/output error"):
        push(shard, 2)
    assert counts(shard) == [1] * 10
    faults.fsync_fails = False
    push(shard, 3)
    again, got = recovered(tmp_path)
    assert counts(again) == [2] * 10 and got["pushes"] == 2


def test_a_failed_background_fsync_stops_acks_until_the_log_syncs(tmp_path):
    """Under wal_fsync=batch a failed fsync is no longer swallowed: the shard acks nothing
    (UNAVAILABLE) until an fsync succeeds again."""
    faults = Faults()
    shard = make_shard(tmp_path, faults, wal_fsync=WalFsync.BATCH,
                       wal_fsync_interval_ms=3_600_000)
    asyncio.run(shard.recover())
    push(shard, 1)
    assert shard.wal is not None
    faults.fsync_fails = True
    shard.wal.sync()  # what the background thread does every interval
    assert shard.wal.failed is not None and "Input/output error" in shard.wal.failed
    with pytest.raises(Unavailable, match="Input/output error"):
        push(shard, 2)
    assert counts(shard) == [1] * 10
    faults.fsync_fails = False
    push(shard, 2)
    assert counts(shard) == [2] * 10 and shard.wal.failed is None
    again, _ = recovered(tmp_path)
    assert counts(again) == [2] * 10


def test_a_failed_create_record_creates_no_table(tmp_path):
    """A create whose record cannot be written is refused and leaves no table."""
    faults = Faults()
    shard = make_shard(tmp_path, faults)
    asyncio.run(shard.recover())
    faults.space = 0
    with pytest.raises(Unavailable):
        shard.create_table(counting_table("new"))
    assert "new" not in shard.tables
    faults.space = None
    shard.create_table(counting_table("new"))
    again, got = recovered(tmp_path)
    assert "new" in again.tables and got["changes"] == 1
