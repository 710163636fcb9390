"""The write-ahead log without sockets (services/ps/wal.py): a Shard with counting tables (rows
= occurrences applied) logs its pushes, a fresh Shard recovers them; torn and corrupt tails;
bad WAL settings."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from services.common.config import from_dict
from services.common.errors import ConfigError, FailedPrecondition, InvalidArgument, NotFound
from services.ps.config import PSConfig
from services.ps.dedup import PushOrigin
from services.ps.shard import Shard
from services.ps.wal import WalFsync, WriteAheadLog
from services.ps.wal_records import DropRecord
from tests.unit.ps.counting import applied_counts, count_grads, counting_table

IDS = np.arange(10, dtype=np.uint64)
_OPEN: list[Shard] = []


@pytest.fixture(autouse=True)
def _close_shards() -> Iterator[None]:
    """Every shard a test made stops its log's sync thread at the end."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def make_shard(tmp_path, **kw) -> Shard:
    shard = Shard(PSConfig(tables=[counting_table("count"), counting_table("other")],
                           checkpoint_dir=str(tmp_path / "ckpt"),
                           wal_dir=str(tmp_path / "wal"), **kw))
    _OPEN.append(shard)
    return shard


def recovered(tmp_path, **kw) -> tuple[Shard, dict[str, int]]:
    """A fresh shard (a restarted process) brought back from the log."""
    shard = make_shard(tmp_path, **kw)
    return shard, asyncio.run(shard.recover())


def counts(shard: Shard, table: str = "count", ids: np.ndarray = IDS) -> list[int]:
    rows, present = shard.table(table).peek(ids)
    return applied_counts(np.where(present[:, None], rows, 0)).astype(int).tolist()


def push(shard: Shard, seq: int, ids: np.ndarray = IDS, client: int = 7) -> None:
    shard.push_many_sync(["count"], [ids.size], ids, count_grads(ids.size),
                         origin=PushOrigin(client, seq))


def logged(shard: Shard) -> tuple[str | None, list[dict]]:
    """The base and records of the shard's log, read whole."""
    assert shard.wal is not None
    base, records = shard.wal.read()
    return base, list(records)


def segment(tmp_path):
    (path,) = (tmp_path / "wal" / "shard-0-of-1").glob("*.wal")
    return path


def test_a_fresh_shard_recovers_every_logged_push_exactly(tmp_path):
    """Pushes after a checkpoint come back on top of it, once each; without the log (or with
    the ack before the append) the fresh shard would hold the checkpoint's counts only."""
    shard = make_shard(tmp_path)
    asyncio.run(shard.recover())  # nothing yet: starts the log
    push(shard, 1)
    asyncio.run(shard.checkpoint("c1"))
    push(shard, 2)
    push(shard, 3, IDS[:4])
    shard.pooled_push_sync("other", IDS[:3], np.array([1, 2]), count_grads(2),
                           origin=PushOrigin(7, 4))
    shard.push_sync("other", IDS[5:6], count_grads(1))  # in-process: no origin, logged too
    again, got = recovered(tmp_path)
    assert counts(again) == [3] * 4 + [2] * 6
    assert counts(again, "other", IDS[:6]) == [1, 1, 1, 0, 0, 1]
    assert got == {"pushes": 4, "skipped": 0, "changes": 0, "dropped_bytes": 0}
    assert again.wal is not None and again.wal.base == "c1"


def test_replaying_the_log_twice_applies_each_push_once(tmp_path):
    """The dedup window makes replay idempotent: a replay without it would count 2x."""
    shard = make_shard(tmp_path)
    asyncio.run(shard.recover())
    for seq in (1, 2, 3):
        push(shard, seq)
    again, _ = recovered(tmp_path)
    assert counts(again) == [3] * 10
    assert asyncio.run(again.recover()) == {"pushes": 0, "skipped": 3, "changes": 0,
                                            "dropped_bytes": 0}  # the same log again
    assert counts(again) == [3] * 10


def test_a_recovered_shard_answers_a_retry_with_the_first_ack(tmp_path):
    shard = make_shard(tmp_path)
    asyncio.run(shard.recover())
    first = shard.push_many_sync(["count"], [IDS.size], IDS, count_grads(IDS.size),
                                 origin=PushOrigin(7, 1))
    again, _ = recovered(tmp_path)
    retry = again.push_many_sync(["count"], [IDS.size], IDS, count_grads(IDS.size),
                                 origin=PushOrigin(7, 1))
    assert retry == first and counts(again) == [1] * 10


def test_table_changes_are_logged_and_replayed(tmp_path):
    shard = make_shard(tmp_path)
    asyncio.run(shard.recover())
    shard.set_optimizer("count", {"lr": 2.0})
    for bad in ({"kind": "adam"}, {"lr": -1.0}, {"nope": 1}):  # refused: not logged
        with pytest.raises(InvalidArgument):
            shard.set_optimizer("count", bad)
    shard.create_table({"name": "new", "dim": 2, "initializer": "zeros",
                        "optimizer": {"kind": "sgd", "lr": 1.0}})
    shard.drop_table("other")
    push(shard, 1)
    again, got = recovered(tmp_path)
    assert sorted(again.tables) == ["count", "new"] and got["changes"] == 3
    assert counts(again) == [2] * 10  # lr 2: the change came before the push


def test_a_checkpoint_rotates_the_log_and_a_restore_restarts_it(tmp_path):
    shard = make_shard(tmp_path)
    asyncio.run(shard.recover())
    push(shard, 1)
    asyncio.run(shard.checkpoint("c1"))
    assert shard.wal is not None and logged(shard) == ("c1", [])
    push(shard, 2)
    asyncio.run(shard.restore("c1"))  # a rollback: the push after c1 is gone, also later
    assert logged(shard) == ("c1", [])
    again, _ = recovered(tmp_path)
    assert counts(again) == [1] * 10
    assert len(list((tmp_path / "wal" / "shard-0-of-1").glob("*.wal"))) == 1


def test_pushes_racing_a_restore_are_rolled_back_or_logged_after_it(tmp_path):
    """A restore is exclusive with pushes: a push racing it is applied either before it (then
    rolled back with the rest) or after it, logged in the new segment; so a crash then loses
    no acked push and doubles none. (A push applied between the swap of the tables and the
    start of the new segment went to the old one, which the rotation deletes.)"""
    shard = make_shard(tmp_path, wal_fsync=WalFsync.NEVER)
    asyncio.run(shard.recover())
    push(shard, 1)
    asyncio.run(shard.checkpoint("c1"))
    restored, stop = threading.Event(), threading.Event()
    acked: list[list[tuple[int, bool]]] = [[], []]  # per pusher: (id, sent after the restores)
    errors: list[BaseException] = []

    def pusher(k: int) -> None:
        try:
            while not stop.is_set():
                late, seq = restored.is_set(), len(acked[k]) + 1
                row_id = np.array([1_000 + 2 * seq + k], dtype=np.uint64)
                push(shard, seq, row_id, client=100 + k)
                acked[k].append((int(row_id[0]), late))
        except BaseException as exc:  # noqa: BLE001 - the test fails on it below
            errors.append(exc)

    def until(done) -> None:
        deadline = time.monotonic() + 30
        while not done() and not errors:
            assert time.monotonic() < deadline, "the pushers stalled"
            time.sleep(0.001)

    threads = [threading.Thread(target=pusher, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    try:
        until(lambda: min(map(len, acked)) >= 20)
        for _ in range(5):
            asyncio.run(shard.restore("c1"))
        restored.set()
        until(lambda: min(sum(late for _, late in a) for a in acked) >= 20)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not errors, errors
    ids = np.array([i for a in acked for i, _ in a], dtype=np.uint64)
    late = np.array([late for a in acked for _, late in a])
    again, _ = recovered(tmp_path)  # the crash: the live shard is never closed
    live = counts(shard, ids=ids)
    assert counts(again, ids=ids) == live and counts(again) == [1] * 10
    assert set(live) <= {0, 1} and all(np.array(live)[late] == 1)


def test_pushes_racing_a_drop_leave_a_log_that_replays(tmp_path):
    """A push that was validated before its table was dropped is checked again once it holds
    the lock: NotFound, and nothing logged after the drop (such a record would make every
    replay of the log fail with NotFound)."""
    shard = make_shard(tmp_path, wal_fsync=WalFsync.NEVER)
    asyncio.run(shard.recover())
    stop, errors = threading.Event(), []

    def pusher(k: int) -> None:
        seq = 0
        while not stop.is_set():
            seq += 1
            try:
                shard.push_many_sync(["other"], [1], IDS[k:k + 1], count_grads(1),
                                     origin=PushOrigin(100 + k, seq))
            except NotFound:
                pass
            except BaseException as exc:  # noqa: BLE001 - the test fails on it below
                errors.append(exc)

    threads = [threading.Thread(target=pusher, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(200):
            shard.drop_table("other")
            shard.create_table(counting_table("other"))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not errors, errors
    live = counts(shard, "other", IDS[:2])
    again, got = recovered(tmp_path)
    assert got["changes"] == 400 and counts(again, "other", IDS[:2]) == live


def test_a_torn_tail_is_dropped_and_the_log_goes_on(tmp_path):
    """A record cut short by a crash mid-write was never acked: dropped, not an error."""
    shard = make_shard(tmp_path)
    asyncio.run(shard.recover())
    push(shard, 1)
    push(shard, 2)
    path = segment(tmp_path)
    size = path.stat().st_size
    os.truncate(path, size - 7)  # the second push's record, cut short
    again, got = recovered(tmp_path)
    assert counts(again) == [1] * 10 and got["dropped_bytes"] > 0
    push(again, 2)  # the unacked push, retried, goes after the good records
    third, _ = recovered(tmp_path)
    assert counts(third) == [2] * 10


@pytest.mark.parametrize("damage", ["crc", "zeros"])
def test_a_bad_last_record_is_a_torn_tail(tmp_path, damage):
    shard = make_shard(tmp_path)
    asyncio.run(shard.recover())
    push(shard, 1)
    path = segment(tmp_path)
    good = path.stat().st_size
    push(shard, 2)
    data = bytearray(path.read_bytes())
    if damage == "crc":
        data[-1] ^= 0xFF
    else:  # the file grew but the record's blocks never came: zeros to the end
        data[good:] = bytes(len(data) - good)
    path.write_bytes(bytes(data))
    again, got = recovered(tmp_path)
    assert counts(again) == [1] * 10 and got["dropped_bytes"] == len(data) - good
    assert path.stat().st_size == good


def test_a_bad_record_followed_by_more_is_corruption(tmp_path):
    """Not a torn tail: refusing to start beats silently dropping acked pushes after it."""
    shard = make_shard(tmp_path)
    asyncio.run(shard.recover())
    push(shard, 1)
    push(shard, 2)
    path = segment(tmp_path)
    data = bytearray(path.read_bytes())
    data[60] ^= 0xFF  # inside the first push's record
    path.write_bytes(bytes(data))
    with pytest.raises(FailedPrecondition, match="corrupt at byte"):
        recovered(tmp_path)


def test_a_log_whose_base_checkpoint_is_gone_is_a_clear_error(tmp_path):
    shard = make_shard(tmp_path)
    asyncio.run(shard.recover())
    asyncio.run(shard.checkpoint("c1"))
    (tmp_path / "ckpt" / "c1").rename(tmp_path / "moved")
    with pytest.raises(Exception, match="c1"):
        recovered(tmp_path)


def test_appending_before_the_log_is_open_fails_and_applies_nothing(tmp_path):
    shard = make_shard(tmp_path)
    with pytest.raises(FailedPrecondition, match="not open"):
        push(shard, 1)
    assert counts(shard) == [0] * 10
    asyncio.run(shard.recover())
    push(shard, 1)  # the refused number was not taken
    assert counts(shard) == [1] * 10


@pytest.mark.parametrize("settings, message", [
    ({"wal_fsync": "sometimes"}, "not one of"),
    ({"wal_fsync_interval_ms": 0}, "wal_fsync_interval_ms must be > 0"),
    ({"wal_fsync_interval_ms": "soon"}, "expected float"),
    ({"wal_dirr": "x"}, "unknown keys"),
    ({"wal_segment_bytes": 100}, "wal_segment_bytes must be >= 4096"),
])
def test_bad_wal_settings_are_clear_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(PSConfig, settings)


def test_a_wal_dir_that_is_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="wal_dir"):
        WriteAheadLog(tmp_path / "file", shard_id=0, num_shards=1)


@pytest.mark.parametrize("policy", list(WalFsync))
def test_every_policy_writes_before_append_returns(tmp_path, policy):
    """What a SIGKILL right after the ack leaves: the record is in the file under every
    policy (a buffered writer would hold it in the process)."""
    wal = WriteAheadLog(tmp_path, shard_id=0, num_shards=1, fsync=policy,
                        fsync_interval_s=60.0)
    wal.start(None)
    wal.append(DropRecord.of("x"))
    try:
        base, records = WriteAheadLog(tmp_path, shard_id=0, num_shards=1).read()
        assert (base, list(records)) == (None, [DropRecord.of("x")])
    finally:
        wal.close()


@pytest.mark.parametrize("bit", [0, 13, 20, 30])
def test_a_flipped_bit_in_a_length_is_corruption_naming_the_offset(tmp_path, bit):
    """The CRC covers the length: a length bit flip in the middle of the log is an error at
    that record's offset, never a 'torn tail' that silently cuts the acked pushes after it
    (the old frame took a length pointing past the end for a torn tail: bits 13 and up)."""
    shard = make_shard(tmp_path)
    asyncio.run(shard.recover())
    path = segment(tmp_path)
    first = path.stat().st_size  # the first push's record starts here
    for seq in (1, 2, 3):
        push(shard, seq)
    data = bytearray(path.read_bytes())
    data[first + bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))
    with pytest.raises(FailedPrecondition, match=f"corrupt at byte {first} "):
        recovered(tmp_path)
    assert path.read_bytes() == bytes(data)  # nothing cut


def test_a_create_that_fails_is_not_logged_and_the_log_replays(tmp_path):
    """A table create that fails (here its disk tier cannot be made) leaves no record: the
    next start replays cleanly (it used to be logged first, then fail at every restart)."""
    shard = make_shard(tmp_path)
    asyncio.run(shard.recover())
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="storage.path"):
        shard.create_table({"name": "cold", "dim": 2, "storage": {
            "tier": "disk", "path": str(tmp_path / "afile" / "rows"), "ram_rows": 4}})
    assert "cold" not in shard.tables
    push(shard, 1)
    again, got = recovered(tmp_path)
    assert "cold" not in again.tables and got["changes"] == 0
    assert counts(again) == [1] * 10


def test_the_log_rotates_by_size_and_recovery_reads_every_segment(tmp_path):
    """Past wal_segment_bytes a new segment starts (no checkpoint needed); recovery reads them
    all in order; a checkpoint then leaves one."""
    shard = make_shard(tmp_path, wal_segment_bytes=4096)
    asyncio.run(shard.recover())
    for seq in range(1, 61):
        push(shard, seq)
    directory = tmp_path / "wal" / "shard-0-of-1"
    assert len(list(directory.glob("*.wal"))) >= 3
    assert all(p.stat().st_size <= 4096 for p in directory.glob("*.wal"))
    again, got = recovered(tmp_path, wal_segment_bytes=4096)
    assert counts(again) == [60] * 10 and got["pushes"] == 60
    push(again, 61)  # goes on in the newest segment
    asyncio.run(again.checkpoint("c1"))
    assert len(list(directory.glob("*.wal"))) == 1
    third, got = recovered(tmp_path, wal_segment_bytes=4096)
    assert counts(third) == [61] * 10 and got["pushes"] == 0


def test_a_bad_record_in_an_older_segment_is_corruption(tmp_path):
    """Only the newest segment may end in a torn tail: a short older one is an error."""
    shard = make_shard(tmp_path, wal_segment_bytes=4096)
    asyncio.run(shard.recover())
    for seq in range(1, 41):
        push(shard, seq)
    oldest = sorted((tmp_path / "wal" / "shard-0-of-1").glob("*.wal"))[0]
    os.truncate(oldest, oldest.stat().st_size - 5)
    with pytest.raises(FailedPrecondition, match=f"{oldest.name} is corrupt at byte"):
        recovered(tmp_path, wal_segment_bytes=4096)
