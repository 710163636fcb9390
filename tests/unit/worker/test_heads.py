"""Head ids (:mod:`services.worker.embedding.heads`): which ids are head, and how a batch is split.

Batches are built so that each id's rate per batch is known: in table ``a`` id 1 occurs 3 times
in every batch and id 2 once every other batch; in table ``b`` id 1 once in every batch and id 2
(the same value as ``a``'s id 2) 3 times in every batch; every batch also has ids no other
batch has.
"""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import ConfigError
from services.worker.embedding.heads import HeadIds
from services.worker.pooling import BatchPlan, plan_batch

SHARDS = 2


def plan(b: int) -> BatchPlan:
    fresh = [1000 + 10 * b + k for k in range(4)]
    a = [1, 1, 1, *([2] if b % 2 == 0 else []), *fresh]
    bb = [1, 2, 2, 2, *fresh]
    features = {name: (np.array(ids, np.uint64), np.ones(len(ids), np.int32))
                for name, ids in (("a", a), ("b", bb))}
    # one sample per id: both features need the same count
    size = max(len(a), len(bb))
    for name in features:
        values, _ = features[name]
        values = np.concatenate([values, np.full(size - values.size, 5000 + b, np.uint64)])
        features[name] = (values, np.ones(size, np.int32))
    return plan_batch(features, num_shards=SHARDS, groups=[["a", "b"]])


def heads_of(heads: HeadIds, p: BatchPlan) -> set[tuple[str, int]]:
    """The (table, id) pairs of ``p`` that ``heads`` splits off as head ids."""
    split = heads.split(p)
    head_at, _ = split.groups[0]
    layout = split.head.groups[0].layout
    tables = p.groups[0].layout.table_index()[head_at]
    full = p.groups[0].layout
    assert np.array_equal(layout.ids, full.ids[head_at])
    return {(full.tables[t], int(i)) for t, i in zip(tables, layout.ids, strict=True)}


@pytest.mark.parametrize(("rate", "expected"), [
    (1.0, {("a", 1), ("b", 1), ("b", 2)}),    # a's id 2 is seen 0.5 times per batch
    (2.0, {("a", 1), ("b", 2)}),              # b's id 1 once per batch: not head at 2
    (0.5, {("a", 1), ("a", 2), ("b", 1), ("b", 2)}),
])
def test_head_ids_are_the_ids_seen_at_least_rate_times_per_batch(rate, expected) -> None:
    """Per table: a's id 2 and b's id 2 share a value but not a rate (a key that ignores the
    table fails the first case); fresh ids are never head (seen once)."""
    heads = HeadIds([0], rate, memory=8)
    got = [heads_of(heads, plan(b)) for b in range(24)]
    assert got[0] == {("a", 1), ("b", 2)}  # one batch: ids seen at least twice in it
    for b in range(8, 24):  # a's id 2 is only in the even batches
        assert got[b] == (expected if b % 2 == 0 else expected - {("a", 2)}), b


def test_a_split_sends_the_rest_and_puts_rows_back_in_place() -> None:
    heads = HeadIds([0], 1.0)
    for b in range(4):
        p = plan(b)
        split = heads.split(p)
    assert split.groups[0][0].size  # a's id 1 and b's id 2 at least
    head_at, rest_at = split.groups[0]
    full = p.groups[0].layout
    remote, head_layout = split.remote.groups[0].layout, split.head.groups[0].layout
    assert sorted([*head_at, *rest_at]) == list(range(full.ids.size))
    assert np.array_equal(remote.ids, full.ids[rest_at])
    # each (shard, table) cell keeps its ids: the counts add up to the full layout's
    assert np.array_equal(remote.counts + head_layout.counts, full.counts)
    assert remote.tag == full.tag and split.remote.groups[0].inverse is p.groups[0].inverse
    # rows come back in the full layout's order; gradients go out as the rest's
    rows = np.arange(full.ids.size, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    assert np.array_equal(split.rows(0, rows[rest_at], rows[head_at]), rows)
    with pytest.raises(ValueError, match="others"):  # a row short: refused, not read past
        split.rows(0, rows[rest_at][1:], rows[head_at])
    with pytest.raises(ValueError, match="head ids"):
        split.rows(0, rows[rest_at], rows[head_at][1:])
    spread = split.spread(0, rows[rest_at], 3)  # the rest first, the head ids' rows later
    split.place_head(0, spread, rows[head_at])
    assert np.array_equal(spread, rows)
    with pytest.raises(ValueError, match="rows for"):
        split.place_head(0, spread[1:], rows[head_at])
    (sent,) = split.pushed_grads([rows])
    assert np.array_equal(sent, rows[rest_at])
    (sent,) = split.head_grads([rows])
    assert np.array_equal(sent, rows[head_at])


def test_no_head_ids_all_rest_and_bad_settings_are_clear() -> None:
    heads = HeadIds([0], 100.0)
    for b in range(4):
        p = plan(b)
        split = heads.split(p)
        assert split.head.groups[0].layout.ids.size == 0
        assert np.array_equal(split.remote.groups[0].layout.ids, p.groups[0].layout.ids)
    assert heads.head_count() == 0
    for bad in (0.0, -1.0):
        with pytest.raises(ConfigError, match="rate"):
            HeadIds([0], bad)
    with pytest.raises(ConfigError, match="memory and every"):
        HeadIds([0], 1.0, memory=0)


def test_thousands_of_head_ids_are_found_among_fresh_ones() -> None:
    """5,000 ids twice in every batch (head) among 5,000 ids no other batch has: the hash set
    of head keys answers exactly (a probe that stops early, or a slot index that ignores the
    set's size, misses some or finds fresh ones)."""
    heads = HeadIds([0], 1.0)
    rng = np.random.default_rng(0)
    frequent = rng.choice(2**40, 5000, replace=False).astype(np.uint64)
    for b in range(3):
        fresh = (np.arange(5000, dtype=np.uint64) + np.uint64(2**41 + 5000 * b))
        ids = np.concatenate([frequent, frequent, fresh])
        p = plan_batch({"a": (ids, np.ones(ids.size, np.int32))}, num_shards=SHARDS)
        split = heads.split(p)
    head_ids = split.head.groups[0].layout.ids
    assert heads.head_count() == 5000
    assert np.array_equal(np.sort(head_ids), np.sort(frequent))
    assert np.array_equal(np.sort(split.remote.groups[0].layout.ids), np.sort(fresh))


def test_sticky_head_ids_stay_head_for_the_rest_of_the_run() -> None:
    """Id 7 is frequent in the first batches only, id 9 after them. Without ``sticky`` 7 stops
    being head once the memory forgets it; with it (a replica of the head rows) 7 stays head
    (else the replica would hold a row that the PS has updated since), and 9 joins."""
    def batch(b: int) -> BatchPlan:
        ids = [7, 7, 7] if b < 6 else [9, 9, 9, *([7] if b == 20 else [])]
        ids += [1000 + 10 * b + k for k in range(4 - (b == 20))]
        return plan_batch({"a": (np.array(ids, np.uint64), np.ones(len(ids), np.int32))},
                          num_shards=SHARDS, groups=[["a"]])

    for sticky, late in ((False, {("a", 9)}), (True, {("a", 7), ("a", 9)})):
        heads = HeadIds([0], 1.0, memory=4, every=4, sticky=sticky)
        got, fresh = [], []  # sticky: each head id is new once, when first decided
        for b in range(21):
            got.append(heads_of(heads, batch(b)))
            fresh += [(t, int(i)) for layout in heads.take_fresh().values()
                      for t in layout.tables for i in layout.table_ids(t)]
        assert fresh == ([("a", 7), ("a", 9)] if sticky else [])
        assert got[0] == {("a", 7)} and got[20] >= {("a", 9)}, sticky
        assert (("a", 7) in got[20]) is sticky
        assert heads.head_count() == len(late)


def test_deferred_head_ids_are_held_back_until_their_switch() -> None:
    """With ``defer`` 3, id 9 (frequent from batch 2 on) is decided head after batch 4
    (``memory``), but batches 4-6 still read it with the rest and hold its gradient back
    (neither pushed nor head); batch 7 switches it to head. The first batch's decision is
    not deferred (nothing is in flight before it)."""
    def batch(b: int) -> BatchPlan:
        ids = [7, 7, 7, *([9, 9, 9] if b >= 2 else []), *[1000 + 10 * b + k for k in range(3)]]
        return plan_batch({"a": (np.array(ids, np.uint64), np.ones(len(ids), np.int32))},
                          num_shards=SHARDS, groups=[["a"]])

    heads = HeadIds([0], 1.0, memory=4, every=64, sticky=True, defer=3)
    for b in range(9):
        p = batch(b)
        split = heads.split(p)
        head = {int(i) for i in split.head.groups[0].layout.ids}
        pushed = {int(i) for i in split.pushed.groups[0].layout.ids}
        held = {int(i) for i in split.held[0][0].ids} if 0 in split.held else set()
        looked_up = {int(i) for i in split.remote.groups[0].layout.ids}
        assert head | looked_up == {int(i) for i in p.groups[0].layout.ids}
        assert 7 in head, b  # decided at the first batch: head at once
        if b < 3:
            assert 9 not in head | held and heads.deferring is False, b
        elif b < 6:  # decided after batch 4 (b = 3), switched at batch 7 (b = 6)
            assert 9 in held and 9 in looked_up and 9 not in pushed | head, b
            assert heads.deferring and split.switched is False, b
        else:
            assert 9 in head and not held and split.switched is (b == 6), b
        assert pushed == looked_up - held
