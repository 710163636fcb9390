"""Epochs fence restores (services/ps/durability.py): a real Shard whose restore moves its
epoch on, refusing every push received before it, also one already validated and waiting in
the shard's threads; the epoch survives in checkpoints, the epoch file and the WAL."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from services.common.errors import FailedPrecondition
from services.ps.config import PSConfig
from services.ps.dedup import PushOrigin, PushWindow
from services.ps.shard import INLINE_IDS, Shard
from services.ps.store import PushResult
from tests.unit.ps.counting import applied_counts, count_grads, counting_table

IDS = np.arange(INLINE_IDS + 1, dtype=np.uint64)  # more than a push served inline
_OPEN: list[Shard] = []


@pytest.fixture(autouse=True)
def _close_shards() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def make_shard(tmp_path, **kw) -> Shard:
    shard = Shard(PSConfig(tables=[counting_table("count")],
                           checkpoint_dir=str(tmp_path / "ckpt"), **kw))
    _OPEN.append(shard)
    return shard


def counts(shard: Shard) -> np.ndarray:
    rows, present = shard.table("count").peek(IDS[:10])
    return applied_counts(np.where(present[:, None], rows, 0))


@pytest.mark.parametrize("epoch", [1, None])
def test_a_push_queued_before_a_restore_is_refused_after_it(tmp_path, epoch):
    """A push received in epoch 1 (carrying it, or none: taken for the first epoch),
    waiting in the shard's threads while a restore runs, is refused once it runs (it used to
    be applied to the rolled-back tables)."""
    origin = PushOrigin(7, 1) if epoch is None else PushOrigin(7, 1, epoch)
    shard = make_shard(tmp_path)
    asyncio.run(shard.checkpoint("c1"))
    release = threading.Event()

    async def scenario() -> BaseException | PushResult:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(1))
        busy = loop.run_in_executor(None, release.wait)  # the shard's threads are busy
        try:
            queued = asyncio.ensure_future(shard.push_many(
                ["count"], [IDS.size], IDS, count_grads(IDS.size), origin=origin))
            await asyncio.sleep(0)  # the push is received and waits for a thread behind `busy`
            restore = threading.Thread(target=lambda: asyncio.run(shard.restore("c1")))
            restore.start()
            restore.join()
        finally:
            release.set()
        await busy
        try:
            return await queued
        except BaseException as exc:  # noqa: BLE001 - checked below
            return exc

    outcome = asyncio.run(scenario())
    assert isinstance(outcome, FailedPrecondition), outcome
    assert type(outcome).__name__ == "StaleEpoch"
    assert ("epoch 1" if epoch else "carries no epoch") in outcome.message
    assert "epoch 2" in outcome.message
    assert shard.epoch == 2 and counts(shard).tolist() == [0] * 10


def test_a_push_without_an_epoch_is_refused_once_a_restore_bumped_the_epoch(tmp_path):
    """An older client sends no epoch (0): it is taken for the first epoch, so its push is
    applied by a shard never restored, and refused (queued before the restore, or sent, or
    retried, after it) once a restore moved the shard on; it used to be fenced by the epoch
    it arrived in, so a retry after the restore was applied to the rolled-back tables."""
    shard = make_shard(tmp_path)
    asyncio.run(shard.push_many(["count"], [IDS.size], IDS, count_grads(IDS.size),
                                origin=PushOrigin(7, 1)))  # never restored: applied
    assert counts(shard).tolist() == [1] * 10
    asyncio.run(shard.checkpoint("c1"))
    fence = PushOrigin(7, 2).epoch  # the fence the shard's async entry points take: 0
    asyncio.run(shard.restore("c1"))
    with pytest.raises(FailedPrecondition, match="carries no epoch .* now in epoch 2"):
        shard.push_many_sync(["count"], [IDS.size], IDS, count_grads(IDS.size),
                             origin=PushOrigin(7, 2), fence=fence)  # queued before it
    for seq in (2, 3):  # the old client's retry, and a new push of it, after the restore
        with pytest.raises(FailedPrecondition, match="carries no epoch") as refused:
            asyncio.run(shard.push_many(["count"], [IDS.size], IDS, count_grads(IDS.size),
                                        origin=PushOrigin(7, seq)))
        assert type(refused.value).__name__ == "StaleEpoch"
    assert counts(shard).tolist() == [1] * 10  # nothing applied
    asyncio.run(shard.push_many(["count"], [IDS.size], IDS, count_grads(IDS.size),
                                origin=PushOrigin(7, 2, 2)))  # one that learned epoch 2
    asyncio.run(shard.push_many(["count"], [IDS.size], IDS, count_grads(IDS.size)))  # in-process
    assert counts(shard).tolist() == [3] * 10


def test_the_epoch_survives_restarts_and_rises_past_every_one_served(tmp_path):
    """Checkpoints, the epoch file and the WAL keep the epoch: a restarted shard restoring
    the same checkpoint again gets a newer one; one recovering from its WAL keeps its own."""
    shard = make_shard(tmp_path, wal_dir=str(tmp_path / "wal"))
    asyncio.run(shard.recover())
    assert shard.epoch == 1 and shard.stats().epoch == 1
    asyncio.run(shard.checkpoint("c1"))
    asyncio.run(shard.restore("c1"))
    assert shard.epoch == 2 and shard.describe("count").epoch == 2
    asyncio.run(shard.checkpoint("c2"))  # written in epoch 2
    again = make_shard(tmp_path, wal_dir=str(tmp_path / "wal"))
    asyncio.run(again.recover())
    assert again.epoch == 2  # back to the state at the crash: same epoch
    fresh = make_shard(tmp_path)  # a restart with --restore c1 (no WAL)
    asyncio.run(fresh.restore("c1"))
    assert fresh.epoch == 3  # past the epoch file's 2, though c1 was written in epoch 1
    (tmp_path / "ckpt" / ".epoch-shard-0-of-1").write_text("many")
    with pytest.raises(FailedPrecondition, match="epoch file .* unreadable"):
        asyncio.run(make_shard(tmp_path).restore("c1"))


def test_the_push_window_is_per_epoch_and_client():
    """The same (client, seq) in a new epoch is a new push; the window's snapshot keeps the
    epochs; a bad epoch is an InvalidArgument naming it."""
    window = PushWindow()
    ack = PushResult(applied=3, dropped_nonfinite=0, not_admitted=0)
    assert window.claim(PushOrigin(7, 1, 1), 11) is None
    window.commit(PushOrigin(7, 1, 1), ack)
    assert window.claim(PushOrigin(7, 1, 1), 11) == ack  # a retry
    assert window.claim(PushOrigin(7, 1, 2), 11) is None  # another epoch: new
    window.abandon(PushOrigin(7, 1, 2))
    copy = PushWindow()
    copy.restore(window.snapshot())
    assert copy.claim(PushOrigin(7, 1, 1), 11) == ack
    assert copy.claim(PushOrigin(7, 1, 2), 11) is None
    with pytest.raises(Exception, match="push epoch must be an int"):
        window.claim(PushOrigin(7, 2, -1), 11)
