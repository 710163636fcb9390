"""The id ↔ slot index against a dict, through growth, slot reuse and backward-shift deletions;
the push's duplicate summing without a per-slot mark."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.sharding import mix64
from services.ps.arena import GATHER_AHEAD, SlotBits, dedup_slots, gather_rows, sum_rows_by_inverse
from services.ps.slotindex import SlotIndex


def _check(index: SlotIndex, ref: dict[int, int], universe: int) -> None:
    found = index.find(np.arange(universe, dtype=np.uint64))
    assert found.tolist() == [ref.get(i, -1) for i in range(universe)]
    assert len(index) == len(ref)
    for i, slot in ref.items():
        assert int(index.slot_ids[slot]) == i


def test_random_operations_with_reused_slots_match_a_dict():
    rng = np.random.default_rng(0)
    index, ref, free, high = SlotIndex(2), {}, [], 0
    for _ in range(400):
        ids = np.unique(rng.integers(0, 300, size=rng.integers(1, 60)).astype(np.uint64))
        if rng.integers(2):
            new = ids[[int(i) not in ref for i in ids.tolist()]]
            take = min(len(free), new.size)  # freed slots first, as an arena reuses them
            slots = free[len(free) - take:] + list(range(high, high + new.size - take))
            del free[len(free) - take:]
            high += new.size - take
            index.grow_slots(high)
            index.insert(new, np.array(slots, dtype=np.int64))
            ref.update(zip(new.tolist(), slots, strict=True))
        else:
            removed = index.remove(ids)
            assert removed.tolist() == [ref.pop(i, -1) for i in ids.tolist()]
            free += [s for s in removed.tolist() if s >= 0]
        _check(index, ref, 300)


def test_growth_keeps_every_id_and_buckets_stay_under_three_quarters():
    ids = np.concatenate([np.arange(5000, dtype=np.uint64),
                          np.array([2**64 - 1, 2**63, 2**32], dtype=np.uint64)])
    index = SlotIndex(4)
    index.grow_slots(ids.size)
    index.insert(ids, np.arange(ids.size))
    buckets, slot_ids = index.arrays
    assert 4 * ids.size <= 3 * buckets.size
    assert index.nbytes == 8 * slot_ids.size + 4 * buckets.size
    assert np.array_equal(index.find(ids), np.arange(ids.size))
    assert index.find(np.array([5001], dtype=np.uint64)).tolist() == [-1]


@pytest.mark.parametrize("slot", [-1, 10])
def test_insert_rejects_a_slot_outside_the_arena_and_changes_nothing(slot):
    index = SlotIndex(10)
    index.insert(np.array([7], dtype=np.uint64), np.array([9]))
    with pytest.raises(ValueError, match=r"slot in \[0, slots\)"):
        index.insert(np.array([1, 2], dtype=np.uint64), np.array([3, slot]))
    assert len(index) == 1
    assert index.find(np.array([1, 2, 7], dtype=np.uint64)).tolist() == [-1, -1, 9]


def test_clustered_deletes_keep_probe_chains_intact():
    # ids that all hash to bucket 0 of an 8-bucket index form one probe chain; deleting from
    # its middle must shift the followers back (homes read through slot_ids), or later finds
    # would stop early
    candidates = np.arange(10_000, dtype=np.uint64)
    same_home = candidates[(mix64(candidates) & np.uint64(7)) == 0][:4]
    index = SlotIndex(4)
    assert index.arrays[0].size == 8
    index.insert(same_home, np.array([3, 2, 1, 0]))
    assert index.remove(same_home[[0, 2]]).tolist() == [3, 1]
    assert index.find(same_home).tolist() == [-1, 2, -1, 0]


def test_dedup_sums_repeats_in_request_order_skips_negative_slots_and_leaves_bits_clear():
    seen = np.zeros(2**21 // 8 + 1, dtype=np.uint8)
    slots = np.array([5, -1, 9, 5, 2**20, 9, 5], dtype=np.int64)
    grads = np.arange(7 * 2, dtype=np.float32).reshape(7, 2) + 0.25
    n = slots.size
    uslots, first, inv = (np.empty(n, dtype=np.int64) for _ in range(3))
    k, dups = dedup_slots(slots, seen, uslots, first, inv)
    assert (k, dups) == (3, True)
    assert uslots[:k].tolist() == [5, 9, 2**20] and first[:k].tolist() == [0, 2, 4]
    assert inv.tolist() == [0, -1, 1, 0, 2, 1, 0]
    assert not seen.any()
    out = np.zeros((k, 2), dtype=np.float32)
    sum_rows_by_inverse(inv, grads, out)
    assert out[0].tolist() == (grads[0] + grads[3] + grads[6]).tolist()
    assert out[2].tolist() == grads[4].tolist()
    k, dups = dedup_slots(np.array([4, -1, 12, 1], dtype=np.int64), seen, uslots, first, inv)
    assert (k, dups) == (3, False)
    assert uslots[:k].tolist() == [4, 12, 1] and inv[:4].tolist() == [0, -1, 1, 2]
    assert not seen.any()


@pytest.mark.parametrize("n", [0, 1, GATHER_AHEAD - 1, GATHER_AHEAD, GATHER_AHEAD + 1, 500])
def test_gather_copies_each_slots_row_and_leaves_absent_slots_positions_alone(n):
    rng = np.random.default_rng(n)
    rows = rng.normal(size=(64, 5)).astype(np.float32)
    slots = rng.integers(-1, 64, size=n).astype(np.int64)  # -1: no row, also at the end
    if n:
        slots[-1] = -1
    out = np.full((n, 5), np.nan, dtype=np.float32)
    gather_rows(rows, slots, out)
    has = slots >= 0
    np.testing.assert_array_equal(out[has], rows[slots[has]])
    assert np.isnan(out[~has]).all()  # not rows[-1]: the last row


def test_an_index_over_the_callers_ids_reads_and_writes_them_in_place():
    records = np.zeros(16, dtype=[("id", np.uint64), ("row", np.float32, (2,))])
    index = SlotIndex(16, slot_ids=records["id"])
    ids = np.array([11, 2**63 + 5, 7], dtype=np.uint64)
    index.insert(ids, np.array([4, 0, 9]))
    assert records["id"][[4, 0, 9]].tolist() == ids.tolist()
    assert index.nbytes == index.arrays[0].nbytes  # the ids are not the index's RAM
    records["id"][9] = 8  # the record at slot 9 now holds another id: the index reads it there
    assert index.find(np.array([7, 11, 2**63 + 5], dtype=np.uint64)).tolist() == [-1, 4, 0]


def test_slot_bits_read_and_write_like_a_bool_array():
    bits, ref = SlotBits(20), np.zeros(20, dtype=bool)
    for slots, value in (([3, 9, 17, 8], True), ([9], False), ([0, 19, 3], [True, True, False])):
        bits[np.array(slots)] = value
        ref[slots] = value
    assert bits[:20].tolist() == ref.tolist() and bits[:5].tolist() == ref[:5].tolist()
    assert bits[np.array([17, 9, 0])].tolist() == [True, False, True]
    bits[:16] = False  # two whole bytes
    ref[:16] = False
    bits[:12] = True  # a byte and a half
    ref[:12] = True
    bits[:3] = np.array([False, True, False])
    ref[:3] = [False, True, False]
    assert bits[:20].tolist() == ref.tolist()
    grown = bits.grown(100)
    assert grown[:100].tolist() == ref.tolist() + [False] * 80 and grown.nbytes == 13
    with pytest.raises(IndexError, match=r"\[:n\]"):
        bits[4:8]


def test_insert_new_builds_the_index_an_insert_would_and_refuses_without_room():
    rng = np.random.default_rng(3)
    ids = rng.choice(2**40, 500, replace=False).astype(np.uint64)
    slots = rng.permutation(600)[:500].astype(np.int64)
    built, probed = SlotIndex(600), SlotIndex(600)
    built.insert_new(ids, slots)
    probed.insert(ids, slots)
    universe = np.concatenate([ids, rng.choice(2**40, 300).astype(np.uint64)])
    assert built.find(universe).tolist() == probed.find(universe).tolist()
    assert len(built) == 500 and built.slot_ids[slots].tolist() == ids.tolist()
    removed = built.remove(ids[:100])  # backward shift over entries it placed
    assert removed.tolist() == slots[:100].tolist()
    assert built.find(ids).tolist() == [-1] * 100 + slots[100:].tolist()
    small = SlotIndex(4)
    with pytest.raises(ValueError, match="room"):
        small.insert_new(ids, slots)
    assert len(small) == 0 and (small.find(ids) == -1).all()
