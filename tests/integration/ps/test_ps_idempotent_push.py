"""Idempotent pushes over real gRPC (shards on port 0) with counting tables: each id's row is
the number of its occurrences the shard applied, so "applied once" is read off the rows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from clients.ps_client import PSClient
from services.common.codecs import raw_array
from services.common.errors import FailedPrecondition, InvalidArgument, StaleEpoch
from services.common.messages import (
    LookupRequest,
    PooledPushRequest,
    PushReply,
    PushRequest,
    PushThenLookupRequest,
    encode,
)
from services.common.wire import decode_message
from services.ps.config import PSConfig
from services.ps.service import PSService
from tests.integration.ps.conftest import shard_stream
from tests.unit.ps.counting import applied_counts, count_grads, counting_table

IDS = np.arange(12, dtype=np.uint64)


async def start(tmp_path, **kw) -> PSService:
    service = PSService(PSConfig(grpc_port=0, admin_port=0, checkpoint_dir=str(tmp_path),
                                 tables=[counting_table("count"), counting_table("other")],
                                 **kw))
    await service.start()
    return service


@pytest.fixture
async def shard(tmp_path) -> AsyncIterator[PSService]:
    service = await start(tmp_path)
    yield service
    await service.close()


def counts(service: PSService, ids: np.ndarray = IDS, table: str = "count") -> list[int]:
    rows, present = service.shard.table(table).peek(ids)
    return applied_counts(np.where(present[:, None], rows, 0)).astype(int).tolist()


def push(client: int = 5, seq: int = 1, ids: np.ndarray = IDS) -> PushRequest:
    return PushRequest(client=client, seq=seq, tables=["count"], counts=[ids.size],
                       ids=raw_array(ids), grads=[raw_array(count_grads(ids.size))])


FRAMES = {
    "Push": lambda seq: encode(push(seq=seq), rid=1),
    "PushThenLookup": lambda seq: encode(PushThenLookupRequest(
        push=push(seq=seq), lookup=LookupRequest(tables=["count"], counts=[IDS.size],
                                                 ids=raw_array(IDS))), rid=1),
    "PooledPush": lambda seq: encode(PooledPushRequest(
        client=5, seq=seq, table="count", ids=raw_array(IDS), lengths=raw_array(np.array([12])),
        grads=raw_array(count_grads(1))), rid=1),
}


async def send_frames(address: str, method: str, frames: list[bytes]) -> list[dict]:
    """Write ``frames`` on one stream, in order, and return the replies."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(f"/persimmon.PS/{method}")()
        replies = []
        for frame in frames:
            await call.write(frame)
            replies.append(decode_message(await call.read()))
        await call.done_writing()
        return replies


@pytest.mark.parametrize("method", sorted(FRAMES))
async def test_the_same_frame_sent_twice_is_applied_once_and_answered_alike(shard, method):
    frame = FRAMES[method](1)
    first, again = await send_frames(shard.address, method, [frame, frame])
    assert "error" not in first and first == again  # the first ack, again
    assert counts(shard) == [1] * IDS.size
    if method == "PushThenLookup":  # the lookup is served each time and sees one push
        rows = [np.frombuffer(r["lookup"]["rows"]["data"], np.float32) for r in (first, again)]
        assert rows[0].tolist() == rows[1].tolist() == [1.0] * (2 * IDS.size)
    (later,) = await send_frames(shard.address, method, [FRAMES[method](2)])  # a new number
    assert "error" not in later
    assert counts(shard) == [2] * IDS.size


async def test_one_number_from_two_clients_is_two_pushes(shard):
    """The window is per client: a shard keyed by the number alone would drop client 6's."""
    replies = await send_frames(shard.address, "Push", [encode(push(client=5), rid=1),
                                                        encode(push(client=6), rid=2)])
    assert [r["applied"] for r in replies] == [IDS.size] * 2
    assert counts(shard) == [2] * IDS.size


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"seq": 7}, FailedPrecondition, "below this shard's window"),
    ({"seq": 5000, "ids": raw_array(IDS[:3]), "counts": [3],
      "grads": [raw_array(count_grads(3))]}, FailedPrecondition, "already used"),
    ({"seq": 0}, InvalidArgument, "seq must be"),
    ({"seq": -3}, InvalidArgument, "PushRequest.seq: Expected `int` >= 0"),
    ({"client": "me"}, InvalidArgument, "PushRequest.client: Expected `int`"),
    ({"client": None}, InvalidArgument, "needs the field 'client'"),
    ({"seq": None}, InvalidArgument, "needs the field 'seq'"),
])
async def test_bad_push_numbers_get_clear_errors_and_change_nothing(shard, change, error, match):
    async with shard_stream(shard.address, "Push") as stream:
        first = await stream.request(push(seq=5000), PushReply)
        before = counts(shard)
        body = {k: v for k, v in (push().to_wire() | change).items() if v is not None}
        with pytest.raises(error, match=match):
            await stream.request(_Raw(body), PushReply)
        assert counts(shard) == before == [1] * IDS.size
        again = await stream.request(push(seq=5000), PushReply)  # the stream goes on
        assert again.applied == first.applied == IDS.size
        assert counts(shard) == before  # (a retry: the first ack again, nothing applied)


class _Raw:
    def __init__(self, body):
        self.body = body

    def to_wire(self):
        return self.body


async def test_retries_without_an_epoch_into_a_restored_shard_are_refused(tmp_path):
    """Pushes of a client that never learned an epoch, one the checkpoint holds and one it
    lacks, retried into a fresh shard restored from it (a new epoch): each refused
    (StaleEpoch, FAILED_PRECONDITION), nothing applied; the retry of the one it lacks used to
    be applied to the restored rows (the window itself travels in checkpoints:
    tests/unit/ps/test_ps_dedup.py)."""
    held, lacking = FRAMES["Push"](1), encode(push(seq=2, ids=IDS[:5]), rid=1)
    first = await start(tmp_path)
    try:
        await send_frames(first.address, "Push", [held])
        await first.shard.checkpoint("c1")
        await send_frames(first.address, "Push", [lacking])
    finally:
        await first.close()
    fresh = await start(tmp_path, restore="c1")
    try:
        assert counts(fresh) == [1] * IDS.size
        replies = await send_frames(fresh.address, "Push", [held, lacking, lacking])
        assert [r["error"]["code"] for r in replies] == ["FAILED_PRECONDITION"] * 3
        assert all("carries no epoch" in r["error"]["message"] for r in replies)
        assert counts(fresh) == [1] * IDS.size
    finally:
        await fresh.close()


async def _retry_across_a_restart(tmp_path, checkpoint_after_apply: bool
                                  ) -> tuple[list[int], list[int]]:
    """A PSClient pushes; the shard applies, (checkpoints,) and dies before it answers; a
    new shard restored from the newest checkpoint takes its place (a new epoch) and the
    client retries: refused (StaleEpoch), surfaced, nothing applied. Re-synced, the client's
    next push is applied. Returns the new shard's counts and the old shard's counts before
    it died."""
    old = await start(tmp_path)
    await old.shard.checkpoint("before")
    addresses = [old.address]
    seen: dict[str, object] = {}
    real_push = old.shard.push_many

    async def apply_then_die(*args, **kwargs):
        await real_push(*args, **kwargs)
        seen["old"] = counts(old)
        if checkpoint_after_apply:
            await old.shard.checkpoint("after")
        new = seen["new"] = await start(tmp_path, restore="after" if checkpoint_after_apply
                                        else "before")
        addresses[0] = new.address
        asyncio.get_running_loop().create_task(old.close())  # dies before it answers
        await asyncio.Event().wait()

    async def resolve() -> list[str]:
        return list(addresses)

    old.shard.push_many = apply_then_die  # type: ignore[method-assign]
    new: PSService | None = None
    try:
        async with PSClient([], resolver=resolve, retry_s=30, timeout=10) as ps:
            with pytest.raises(StaleEpoch, match="epoch 1 .* epoch 2"):
                await ps.push("count", IDS, count_grads(IDS.size))
            new = seen["new"]  # type: ignore[assignment]
            assert isinstance(new, PSService) and ps.addresses == [new.address]
            assert await ps.resync() == [2]
            await ps.push("count", IDS[:2], count_grads(2))  # the next number: applied
            return counts(new), seen["old"]  # type: ignore[return-value]
    finally:
        await old.close()
        if new is not None:
            await new.close()


async def test_a_client_retry_across_a_restart_is_refused_by_its_epoch(tmp_path):
    new, old = await _retry_across_a_restart(tmp_path, checkpoint_after_apply=True)
    assert old == [1] * IDS.size
    assert new == [2] * 2 + [1] * 10  # the checkpoint's once, plus the next push


async def test_a_client_retry_after_a_restore_that_lost_the_push_is_refused(tmp_path):
    """The restored state lacks the push, and its retry is refused all the same: the job
    restarts from the checkpoint and replays what it lacks (applying the zombie as well
    would count it twice)."""
    new, old = await _retry_across_a_restart(tmp_path, checkpoint_after_apply=False)
    assert old == [1] * IDS.size
    assert new == [1] * 2 + [0] * 10
