"""The numba hash table against a dict, through growth and backward-shift deletions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.sharding import mix64
from services.ps.hashtable import IdHashTable, PairHashTable, unique_inverse


def _check(table: IdHashTable, ref: dict[int, int], universe: int) -> None:
    found = table.find(np.arange(universe, dtype=np.uint64))
    assert found.tolist() == [ref.get(i, -1) for i in range(universe)]
    assert len(table) == len(ref)
    keys, vals = table.items()
    assert dict(zip(keys.tolist(), vals.tolist(), strict=True)) == ref


def test_random_operations_match_a_dict():
    rng = np.random.default_rng(0)
    table, ref = IdHashTable(2), {}
    for _ in range(400):
        ids = rng.integers(0, 300, size=rng.integers(1, 60)).astype(np.uint64)
        op = rng.integers(3)
        if op == 0:
            uniq = np.unique(ids)
            vals = rng.integers(0, 10_000, size=uniq.size)
            table.insert(uniq, vals)
            ref.update(zip(uniq.tolist(), vals.tolist(), strict=True))
        elif op == 1:
            removed = table.remove(ids)
            assert removed.tolist() == [ref.pop(i, -1) for i in ids.tolist()]
        else:
            uniq = np.unique(ids)
            counts = table.count_up(uniq)
            for i, c in zip(uniq.tolist(), counts.tolist(), strict=True):
                ref[i] = ref.get(i, 0) + 1
                assert c == ref[i]
        _check(table, ref, 300)
    assert table.buckets >= 2 * len(table)


def test_growth_keeps_every_key_and_huge_ids_work():
    ids = np.concatenate([np.arange(5000, dtype=np.uint64),
                          np.array([2**64 - 1, 2**63, 2**32], dtype=np.uint64)])
    table = IdHashTable(4)
    table.insert(ids, np.arange(ids.size))
    assert 4 * ids.size <= 3 * table.buckets  # load factor <= 3/4
    assert np.array_equal(table.find(ids), np.arange(ids.size))
    assert table.find(np.array([5001], dtype=np.uint64)).tolist() == [-1]


@pytest.mark.parametrize("value", [-1, 2**31])
def test_insert_rejects_values_outside_int32_and_changes_nothing(value):
    table = IdHashTable()
    table.insert(np.array([7], dtype=np.uint64), np.array([2**31 - 1]))  # the largest value
    with pytest.raises(ValueError, match=r"value in \[0, 2\*\*31\)"):
        table.insert(np.array([1, 7], dtype=np.uint64), np.array([3, value]))
    assert len(table) == 1
    assert table.find(np.array([1, 7], dtype=np.uint64)).tolist() == [-1, 2**31 - 1]


def test_values_are_stored_in_12_bytes_a_bucket():
    table = IdHashTable(1000)
    assert table.nbytes == 12 * table.buckets


def test_clustered_deletes_keep_probe_chains_intact():
    # ids that all hash to bucket 0 of an 8-bucket table form one probe chain; deleting from
    # its middle must shift the followers back, or later finds would stop early
    candidates = np.arange(10_000, dtype=np.uint64)
    same_home = candidates[(mix64(candidates) & np.uint64(7)) == 0][:4]
    table = IdHashTable(1)
    assert table.buckets == 8
    table.insert(same_home, np.arange(4))
    assert table.remove(same_home[[0, 2]]).tolist() == [0, 2]
    assert table.find(same_home).tolist() == [-1, 1, -1, 3]
    table.insert(same_home[[2]], np.array([7]))
    assert table.find(same_home).tolist() == [-1, 1, 7, 3]
    assert len(table) == 3


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=200), st.integers(1, 5))
def test_unique_inverse_matches_numpy(values, repeat):
    ids = np.array(values * repeat, dtype=np.uint64)
    uniq, inv = unique_inverse(ids)
    assert np.array_equal(uniq[inv], ids)
    assert np.array_equal(np.sort(uniq), np.unique(ids))
    # first-appearance order
    _, first = np.unique(ids, return_index=True)
    assert np.array_equal(uniq, ids[np.sort(first)])


def test_pair_table_matches_a_dict_through_growth_and_keeps_tables_apart():
    """The same id in two tables is two keys (a map keyed by the id alone, or by a mix of id
    and table that can collide, fails); huge ids work; growth keeps every pair."""
    rng = np.random.default_rng(1)
    table, ref = PairHashTable(2), {}
    for _ in range(60):
        tables = rng.integers(0, 4, size=40)
        ids = rng.integers(0, 50, size=40).astype(np.uint64) + np.uint64(2**64 - 64)
        values = rng.integers(0, 1000, size=40)
        for t, i, v in zip(tables.tolist(), ids.tolist(), values.tolist(), strict=True):
            ref[t, i] = v  # the last write of a pair wins, as in the table
        table.insert(tables, ids, values)
        assert len(table) == len(ref)
    every = [(t, i) for t in range(5) for i in range(2**64 - 64, 2**64 - 10)]
    found = table.find(np.array([t for t, _ in every]), np.array([i for _, i in every],
                                                                 dtype=np.uint64))
    assert found.tolist() == [ref.get(pair, -1) for pair in every]
