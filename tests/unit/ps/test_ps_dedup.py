"""Idempotent pushes without sockets: the window of applied pushes (services/ps/dedup.py), the
push fields of the messages, and a Shard with counting tables (rows = occurrences applied)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.common import messages as m
from services.common.codecs import raw_array
from services.common.errors import FailedPrecondition, InvalidArgument, MalformedMessage
from services.ps.config import PSConfig
from services.ps.dedup import SAMPLED_BYTES, PushOrigin, PushWindow, WindowCounters, fingerprint
from services.ps.shard import INLINE_IDS, Shard
from services.ps.store import PushResult
from tests.unit.ps.counting import applied_counts, count_grads, counting_table

ACK = PushResult(applied=3, dropped_nonfinite=1, not_admitted=0)


def applied(window: PushWindow, client: int, seq: int, fp: int = 1,
            ack: PushResult = ACK) -> PushResult | None:
    """Claim and (when new) commit one push; returns what claim returned."""
    done = window.claim(PushOrigin(client, seq), fp)
    if done is None:
        window.commit(PushOrigin(client, seq), ack)
    return done


# ---- the window ---------------------------------------------------------------------------

def test_a_retry_gets_the_first_ack_and_is_not_applied_again():
    window = PushWindow(window=8)
    assert applied(window, 1, 1) is None
    assert applied(window, 1, 1, ack=PushResult()) == ACK  # the first ack, not a new one
    assert window.stats().retries == 1


def test_numbers_are_per_client():
    """A window keyed by seq alone would take client 2's push 1 for client 1's retry."""
    window = PushWindow(window=8)
    assert applied(window, 1, 1) is None
    assert applied(window, 2, 1) is None


def test_a_number_reused_for_other_content_is_refused():
    window = PushWindow(window=8)
    applied(window, 1, 5, fp=111)
    with pytest.raises(FailedPrecondition, match="already used for a different push"):
        window.claim(PushOrigin(1, 5), 222)


def test_out_of_order_pushes_inside_the_window_are_applied_once_each():
    window = PushWindow(window=8)
    for seq in (10, 4, 7, 3):  # 3 = 10 - 7: inside a window of 8 below 10
        assert applied(window, 1, seq) is None
    for seq in (10, 4, 7, 3):
        assert applied(window, 1, seq) == ACK


def test_a_number_below_the_window_is_refused_at_the_exact_edge():
    window = PushWindow(window=8)
    applied(window, 1, 20)
    assert applied(window, 1, 13) is None  # 20 - 8 + 1: the lowest the window still knows
    with pytest.raises(FailedPrecondition, match=r"below this shard's window \(13\.\.20\)"):
        window.claim(PushOrigin(1, 12), 1)
    assert window.claim(PushOrigin(1, 13), 1) == ACK  # refusing changed nothing


def test_the_window_stays_bounded_and_keeps_what_it_promises():
    window = PushWindow(window=16)
    for seq in range(1, 1001):
        applied(window, 1, seq)
    assert window.stats().entries <= 16 + 16 // 4 + 1
    for seq in range(985, 1001):  # the last window: all known
        assert window.claim(PushOrigin(1, seq), 1) == ACK


def test_a_push_in_flight_under_other_tables_is_refused():
    """Retries share their tables' locks, so a claim seen in flight is another message."""
    window = PushWindow(window=8)
    assert window.claim(PushOrigin(1, 1), 1) is None
    with pytest.raises(FailedPrecondition, match="being applied"):
        window.claim(PushOrigin(1, 1), 1)
    window.abandon(PushOrigin(1, 1))  # the first failed: the number is free again
    assert window.claim(PushOrigin(1, 1), 1) is None


def test_the_least_recently_seen_client_is_evicted():
    window = PushWindow(window=8, max_clients=2)
    applied(window, 1, 1)
    applied(window, 2, 1)
    applied(window, 1, 2)  # client 1 seen last: client 2 goes first
    applied(window, 3, 1)
    assert window.stats() == WindowCounters(clients=2, entries=3, evicted=1, evicted_kept=1,
                                            forgot=False, retries=0)  # 1: seqs 1, 2; 3: seq 1
    assert window.claim(PushOrigin(1, 1), 1) == ACK  # client 1 was kept
    with pytest.raises(FailedPrecondition, match="too old to tell"):
        window.claim(PushOrigin(2, 1), 1)  # client 2 was evicted: may be a retry
    assert window.claim(PushOrigin(2, 2), 1) is None  # its next push is new


@pytest.mark.parametrize("origin", [(-1, 1), (2**63, 1), (1, 0), (1, -5), (1, 2**63),
                                    (True, 1), (1, 1.0), ("1", 1), (None, 1)])
def test_malformed_origins_are_invalid_argument(origin):
    window = PushWindow()
    with pytest.raises(InvalidArgument, match="client id|sequence number"):
        window.claim(PushOrigin(*origin), 1)
    assert window.stats().clients == 0


def test_snapshot_and_restore_round_trip():
    window = PushWindow(window=8)
    applied(window, 7, 30, fp=5, ack=PushResult(1, 2, 3))
    applied(window, 9, 2, fp=6)
    window.claim(PushOrigin(9, 3), 7)  # in flight: not in the snapshot
    fresh = PushWindow(window=8)
    fresh.restore(window.snapshot())
    assert fresh.claim(PushOrigin(7, 30), 5) == PushResult(1, 2, 3)
    assert fresh.claim(PushOrigin(9, 2), 6) == ACK
    assert fresh.claim(PushOrigin(9, 3), 7) is None
    with pytest.raises(FailedPrecondition, match="below"):
        fresh.claim(PushOrigin(7, 22), 1)  # the highest number was restored too


def test_a_damaged_snapshot_is_refused():
    window = PushWindow()
    applied(window, 1, 1)
    snap = window.snapshot()
    snap["entry_client"] = snap["entry_client"] + 5
    with pytest.raises(FailedPrecondition, match="do not fit"):
        PushWindow().restore(snap)
    with pytest.raises(FailedPrecondition, match="lacks"):
        PushWindow().restore({"clients": snap["clients"]})


def test_fingerprint_tells_content_apart():
    ids, g = np.arange(3, dtype=np.uint64), np.ones((3, 2), np.float32)
    base = fingerprint((("t",), (3,)), [ids], [g])
    assert base == fingerprint((("t",), (3,)), [ids.copy()], [g.copy()])
    assert base != fingerprint((("t",), (3,)), [ids], [2 * g])
    assert base != fingerprint((("t",), (3,)), [ids], [g[:, :1]])  # size
    assert base != fingerprint((("u",), (3,)), [ids], [g])
    assert base != fingerprint((("t",), (3,)), [ids + 1], [g])


def test_fingerprint_samples_the_gradients():
    """Gradients count by shape and their first SAMPLED_BYTES bytes (hashing all would cost
    a tenth of a push): a change past them goes unseen, one inside is seen."""
    ids, g = np.arange(4096, dtype=np.uint64), np.ones((4096, 16), np.float32)
    later, early = g.copy(), g.copy()
    later[-1, -1] = 5
    early.reshape(-1)[SAMPLED_BYTES // 4 - 1] = 5
    base = fingerprint((), [ids], [g])
    assert fingerprint((), [ids], [later]) == base
    assert fingerprint((), [ids], [early]) != base
    assert fingerprint((), [ids], [np.asfortranarray(g)]) == base  # any memory layout


# ---- messages -----------------------------------------------------------------------------

def _push_body() -> dict:
    return m.PushRequest(client=3, seq=1, tables=["count"], counts=[2],
                         ids=raw_array(np.arange(2, dtype=np.uint64)),
                         grads=[raw_array(count_grads(2))]).to_wire()


@pytest.mark.parametrize(("change", "match"), [
    ({"client": None}, "needs the field 'client'"),
    ({"seq": None}, "needs the field 'seq'"),
    ({"seq": 0}, "seq must be a push sequence number >= 1"),
    ({"seq": -1}, r"\.seq: Expected `int` >= 0"),
    ({"client": 2**63}, r"\.client: Expected `int` <= 9223372036854775807"),
    ({"client": "3"}, r"\.client: Expected `int`, got `str`"),
    ({"seq": 1.5}, r"\.seq: Expected `int`, got `float`"),
])
def test_push_messages_need_a_well_formed_origin(change, match):
    body = {k: v for k, v in (_push_body() | change).items() if v is not None}
    with pytest.raises(MalformedMessage, match=match):
        m.PushRequest.from_wire(body)
    pooled = {"table": "count", "ids": body["ids"], "lengths": raw_array(np.array([2])),
              "grads": raw_array(count_grads(1))} | {
        k: v for k, v in body.items() if k in ("client", "seq")}
    with pytest.raises(MalformedMessage, match=match):
        m.PooledPushRequest.from_wire(pooled)


# ---- a shard with counting tables ---------------------------------------------------------

def _shard(**kw) -> Shard:
    return Shard(PSConfig(tables=[counting_table("count"), counting_table("other")], **kw))


def _counts(shard: Shard, ids: np.ndarray, table: str = "count") -> np.ndarray:
    return applied_counts(shard.lookup_sync(table, ids))


IDS = np.arange(10, dtype=np.uint64)


def test_shard_applies_a_retried_push_once_and_answers_its_first_ack():
    shard = _shard()
    first = shard.push_many_sync(["count", "other"], [10, 10], np.r_[IDS, IDS],
                                 count_grads(20), origin=PushOrigin(1, 1))
    again = shard.push_many_sync(["count", "other"], [10, 10], np.r_[IDS, IDS],
                                 count_grads(20), origin=PushOrigin(1, 1))
    assert first == again == PushResult(applied=20)
    assert _counts(shard, IDS).tolist() == [1] * 10
    assert _counts(shard, IDS, "other").tolist() == [1] * 10


def test_shard_without_origin_applies_every_call():
    """In-process callers (no wire, no retries) leave the origin out."""
    shard = _shard()
    for _ in range(3):
        shard.push_sync("count", IDS, count_grads(10))
    assert _counts(shard, IDS).tolist() == [3] * 10


def test_shard_refusals_change_nothing():
    shard = _shard()
    shard.push_sync("count", IDS, count_grads(10), origin=PushOrigin(1, 2000))
    cases = [
        (FailedPrecondition, lambda: shard.push_sync("count", IDS[:5], count_grads(5),
                                                     origin=PushOrigin(1, 2000))),  # reused
        (FailedPrecondition, lambda: shard.push_sync("count", IDS, count_grads(10),
                                                     origin=PushOrigin(1, 900))),  # too old
        (InvalidArgument, lambda: shard.push_sync("count", IDS, count_grads(10),
                                                  origin=PushOrigin(1, 0))),
        (InvalidArgument, lambda: shard.pooled_push_sync("count", IDS, np.array([10]),
                                                         count_grads(1),
                                                         origin=PushOrigin(-1, 5))),
    ]
    for error, call in cases:
        with pytest.raises(error):
            call()
    assert _counts(shard, IDS).tolist() == [1] * 10


def test_a_refused_push_leaves_its_number_free():
    """A push refused for bad content is not remembered: the corrected one is applied."""
    shard = _shard()
    with pytest.raises(InvalidArgument):
        shard.push_sync("count", IDS, count_grads(10, dim=3), origin=PushOrigin(1, 1))
    assert shard.push_sync("count", IDS, count_grads(10), origin=PushOrigin(1, 1)).applied == 10
    assert _counts(shard, IDS).tolist() == [1] * 10


def test_pooled_push_and_push_then_lookup_are_idempotent():
    shard = _shard()
    lengths = np.array([4, 6])
    for _ in range(2):
        shard.pooled_push_sync("count", IDS, lengths, count_grads(2), origin=PushOrigin(1, 1))
    assert _counts(shard, IDS).tolist() == [1] * 10
    for _ in range(2):
        ack, rows = shard.push_then_lookup_sync((["count"], [10], IDS, count_grads(10)),
                                                (["count"], [10], IDS), origin=PushOrigin(1, 2))
        assert ack.applied == 10 and applied_counts(rows).tolist() == [2] * 10


async def test_concurrent_copies_of_one_push_are_applied_once():
    """Copies served in worker threads at once (over INLINE_IDS ids each): the claim and the
    rows change under the same locks, so exactly one copy applies."""
    shard = _shard()
    ids = np.arange(INLINE_IDS + 1000, dtype=np.uint64)
    acks = await asyncio.gather(*(shard.push_many(["count"], [ids.size], ids,
                                                  count_grads(ids.size),
                                                  origin=PushOrigin(4, 1)) for _ in range(6)),
                                return_exceptions=True)
    assert all(a == PushResult(applied=ids.size) for a in acks), acks
    assert np.all(_counts(shard, ids) == 1)


async def test_the_window_is_saved_and_restored_with_the_rows(tmp_path):
    """Push 1 is in the checkpoint, push 2 is not: after a restore a retry of 1 is answered
    from the window, a retry of 2 is applied (the rows lost it) — each exactly once."""
    shard = _shard(checkpoint_dir=str(tmp_path))
    one = shard.push_sync("count", IDS, count_grads(10), origin=PushOrigin(1, 1))
    await shard.checkpoint("c1")
    shard.push_sync("count", IDS[:4], count_grads(4), origin=PushOrigin(1, 2))
    fresh = _shard(checkpoint_dir=str(tmp_path))
    await fresh.restore("c1")
    assert fresh.push_sync("count", IDS, count_grads(10), origin=PushOrigin(1, 1)) == one
    assert fresh.push_sync("count", IDS[:4], count_grads(4),
                           origin=PushOrigin(1, 2)).applied == 4
    assert _counts(fresh, IDS).tolist() == [2] * 4 + [1] * 6
    assert _counts(shard, IDS).tolist() == _counts(fresh, IDS).tolist()


async def test_an_incremental_checkpoint_holds_the_whole_window(tmp_path):
    shard = _shard(checkpoint_dir=str(tmp_path))
    shard.push_sync("count", IDS, count_grads(10), origin=PushOrigin(1, 1))
    await shard.checkpoint("full")
    shard.push_sync("other", IDS, count_grads(10), origin=PushOrigin(1, 2))
    await shard.checkpoint("incr", incremental=True)
    fresh = _shard(checkpoint_dir=str(tmp_path))
    await fresh.restore("incr")
    fresh.push_sync("count", IDS, count_grads(10), origin=PushOrigin(1, 1))
    fresh.push_sync("other", IDS, count_grads(10), origin=PushOrigin(1, 2))
    assert _counts(fresh, IDS).tolist() == [1] * 10
    assert _counts(fresh, IDS, "other").tolist() == [1] * 10


async def test_a_resharded_restore_starts_with_an_empty_window(tmp_path):
    shard = _shard(checkpoint_dir=str(tmp_path))
    shard.push_sync("count", IDS, count_grads(10), origin=PushOrigin(1, 1))
    await shard.checkpoint("c1")
    half = Shard(PSConfig(shard_id=0, num_shards=2, checkpoint_dir=str(tmp_path),
                          tables=[counting_table("count"), counting_table("other")]))
    await half.restore("c1")
    assert half.pushes.stats().clients == 0


def test_with_idempotent_pushes_off_a_retry_is_applied_again():
    """The switch ``bench push_cost`` measures against: it does turn the check off."""
    shard = Shard(PSConfig(tables=[counting_table("count")], idempotent_pushes=False))
    ids = np.arange(4, dtype=np.uint64)
    for _ in range(2):
        shard.push_many_sync(["count"], [4], ids, count_grads(4), origin=PushOrigin(1, 1))
    assert applied_counts(shard.table("count").lookup(ids)).tolist() == [2] * 4
