"""EmbeddingTable: lookups, pushes, bad input, admission, eviction, TTL, growth, fp16."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.ps.store import EmbeddingTable
from services.ps.tables import OptimizerConfig, TableConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def u64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def make(**kw) -> EmbeddingTable:
    clock = kw.pop("clock", None)
    cfg = TableConfig(name="t", **{"dim": 4, **kw})
    return EmbeddingTable(cfg) if clock is None else EmbeddingTable(cfg, clock=clock)


def test_lookup_of_never_pushed_ids_is_the_initial_rows_in_request_order():
    table = make(dim=8, initializer="normal", seed=5)
    ids = u64(9, 3, 9, 2**64 - 1, 0, 3)
    rows = table.lookup(ids)
    assert rows.dtype == np.float32 and rows.shape == (6, 8)
    assert np.array_equal(rows, table.initial_rows(ids))
    assert np.array_equal(rows[0], rows[2]) and np.array_equal(rows[1], rows[5])
    assert table.num_rows == 4
    s = table.stats()
    assert (s.lookups, s.ids_looked_up, s.misses) == (1, 6, 4)
    assert np.array_equal(table.lookup(ids), rows)  # second time: same rows, no new ones
    assert table.stats().misses == 4


def test_peek_creates_and_touches_nothing():
    table = make()
    rows, present = table.peek(u64(1, 2))
    assert not present.any() and np.array_equal(rows, table.initial_rows(u64(1, 2)))
    assert table.num_rows == 0 and table.stats().lookups == 0
    table.lookup(u64(2))
    assert table.peek(u64(1, 2))[1].tolist() == [False, True]


def test_push_creates_unknown_rows_then_updates_them():
    table = make(optimizer=OptimizerConfig(kind="sgd", lr=1.0))
    ids = u64(4, 5, 4)
    grads = np.ones((3, 4), dtype=np.float32)
    result = table.push(ids, grads)
    assert (result.applied, result.dropped_nonfinite, result.not_admitted) == (2, 0, 0)
    expected = table.initial_rows(u64(4, 5)) - np.array([[2.0], [1.0]], dtype=np.float32)
    np.testing.assert_allclose(table.peek(u64(4, 5))[0], expected, rtol=1e-6)


def test_nonfinite_gradients_are_dropped_counted_and_change_nothing():
    table = make(optimizer=OptimizerConfig(kind="adagrad", lr=0.5))
    table.lookup(u64(1, 2, 3))
    before = table.content_digest()
    grads = np.ones((4, 4), dtype=np.float32)
    grads[0, 1] = np.nan  # id 1 (existing)
    grads[2, 3] = np.inf  # id 9 (unknown): must not be created either
    grads[3, 0] = -np.inf  # second occurrence of id 2 poisons its sum
    result = table.push(u64(1, 3, 9, 2), grads)
    assert (result.applied, result.dropped_nonfinite) == (1, 3)
    assert table.stats().dropped_nonfinite == 3
    assert table.peek(u64(9))[1].tolist() == [False]
    rows, _ = table.peek(u64(1, 2))
    assert np.array_equal(rows, table.initial_rows(u64(1, 2)))
    assert not np.array_equal(table.peek(u64(3))[0], table.initial_rows(u64(3)))
    # only id 3 moved: a push of nothing but NaN leaves the table byte-identical
    after = table.content_digest()
    table.push(u64(1, 2), np.full((2, 4), np.nan, dtype=np.float32))
    assert table.content_digest() == after != before
    # a finite sum that overflows float32 is non-finite too
    big = np.full((2, 4), 3e38, dtype=np.float32)
    assert table.push(u64(1, 1), big).dropped_nonfinite == 1
    assert table.content_digest() == after


@pytest.mark.parametrize("call, args, message", [
    ("lookup", (np.array([1.0, 2.0]),), "uint64"),
    ("lookup", (np.array([[1, 2]], dtype=np.uint64),), "1-D"),
    ("lookup", (np.array([-1, 2]),), "non-negative"),
    ("lookup", ([1, 2],), "numpy array"),
    ("push", (u64(1, 2), np.ones((2, 5), dtype=np.float32)), "dim 5"),
    ("push", (u64(1, 2), np.ones((3, 4), dtype=np.float32)), "2 ids but 3"),
    ("push", (u64(1, 2), np.ones((2, 4), dtype=np.int32)), "grads must be floats"),
    ("push", (u64(1, 2), np.ones(8, dtype=np.float32)), "2-D"),
    ("push", (np.array([1.5, 2.5]), np.ones((2, 4), dtype=np.float32)), "uint64"),
])
def test_bad_input_is_rejected_and_leaves_the_table_byte_identical(call, args, message):
    table = make(optimizer=OptimizerConfig(kind="adam"))
    table.push(u64(1, 2, 3), np.ones((3, 4), dtype=np.float32))
    digest, stats = table.content_digest(), table.stats()
    with pytest.raises(InvalidArgument, match=message):
        getattr(table, call)(*args)
    with pytest.raises(InvalidArgument, match=message):
        getattr(table, "validate_" + call)(*args)
    assert table.content_digest() == digest
    assert table.stats() == stats


def test_admission_by_min_count_counts_lookups_and_pushes():
    table = make(admit_min_count=3, optimizer=OptimizerConfig(kind="sgd", lr=1.0))
    ids = u64(7)
    assert np.array_equal(table.lookup(ids), table.initial_rows(ids))  # sighting 1
    result = table.push(ids, np.ones((1, 4), dtype=np.float32))  # sighting 2
    assert (result.applied, result.not_admitted) == (0, 1)
    assert table.num_rows == 0 and table.stats().pending_admission == 1
    assert np.array_equal(table.lookup(u64(7, 7)), table.initial_rows(u64(7, 7)))  # sighting 3
    assert table.num_rows == 1 and table.stats().pending_admission == 0
    assert table.push(ids, np.ones((1, 4), dtype=np.float32)).applied == 1
    np.testing.assert_allclose(table.peek(ids)[0], table.initial_rows(ids) - 1.0, rtol=1e-6)
    assert table.stats().not_admitted == 1


def test_admission_by_probability_is_seeded_and_eventually_admits():
    ids = np.arange(2000, dtype=np.uint64)
    a = make(admit_probability=0.25, seed=1)
    b = make(admit_probability=0.25, seed=1)
    a.lookup(ids)
    b.lookup(ids[::-1])
    assert 400 < a.num_rows < 600  # ~ Binomial(2000, 0.25)
    assert np.array_equal(a.peek(ids)[1], b.peek(ids)[1])  # same decisions, any batch order
    c = make(admit_probability=0.25, seed=2)
    c.lookup(ids)
    assert not np.array_equal(c.peek(ids)[1], a.peek(ids)[1])
    for _ in range(40):  # a new draw at every sighting: all ids get in eventually
        a.lookup(ids)
    assert a.num_rows == 2000


def test_lru_eviction_drops_the_least_recently_used_rows():
    table = make(max_rows=4)
    for i in (1, 2, 3, 4):
        table.lookup(u64(i))
    table.push(u64(1), np.ones((1, 4), dtype=np.float32))  # 1 is now the most recent
    table.lookup(u64(5, 6))
    assert table.ids().tolist() == [1, 4, 5, 6]
    assert table.stats().evictions == 2
    assert table.snapshot(incremental=True).tombstones.tolist() == [2, 3]


def test_eviction_never_drops_ids_of_the_current_batch():
    table = make(max_rows=3)
    for i in (1, 2, 3):
        table.lookup(u64(i))
    table.lookup(u64(1, 10))  # 1 is the LRU row but is in the batch: 2 goes
    assert table.ids().tolist() == [1, 3, 10]
    rows = table.lookup(u64(1, 3, 10, 20, 21))  # no room for 20, 21: served, not stored
    assert table.ids().tolist() == [1, 3, 10]
    assert np.array_equal(rows, table.initial_rows(u64(1, 3, 10, 20, 21)))
    result = table.push(u64(1, 30), np.ones((2, 4), dtype=np.float32))
    assert (result.applied, result.not_admitted) == (2, 0)
    assert table.ids().tolist() == [1, 10, 30]


def test_lfu_eviction_drops_the_least_frequently_used_rows():
    table = make(max_rows=3, eviction="lfu")
    table.lookup(u64(1, 1, 1, 2, 3, 3))
    table.lookup(u64(2, 3))  # uses: 1 -> 3, 2 -> 2, 3 -> 3
    table.lookup(u64(4))
    assert table.ids().tolist() == [1, 3, 4]
    assert table.stats().evictions == 1


def test_evicted_then_recreated_row_is_its_initial_row():
    table = make(max_rows=1, optimizer=OptimizerConfig(kind="sgd", lr=1.0))
    table.push(u64(1), np.ones((1, 4), dtype=np.float32))
    table.lookup(u64(2))  # evicts 1
    assert np.array_equal(table.lookup(u64(1)), table.initial_rows(u64(1)))


def test_ttl_expiry_uses_the_injected_clock():
    clock = FakeClock()
    table = make(ttl_s=10.0, clock=clock)
    table.lookup(u64(1))
    clock.now = 5.0
    table.lookup(u64(2))
    clock.now = 12.0
    assert table.expire() == 1 and table.ids().tolist() == [2]
    table.push(u64(2), np.zeros((1, 4), dtype=np.float32))  # a push refreshes the row
    clock.now = 20.0
    assert table.expire() == 0
    clock.now = 22.5
    assert table.expire() == 1 and table.num_rows == 0
    assert table.stats().expired == 2
    assert make().expire() == 0  # no ttl: nothing to do


def test_growth_past_initial_capacity_keeps_every_row():
    table = make(initial_capacity=4, optimizer=OptimizerConfig(kind="adagrad", lr=0.1))
    first = np.arange(100, 110, dtype=np.uint64)
    table.push(first, np.ones((10, 4), dtype=np.float32))
    pushed = table.peek(first)[0]
    for start in range(0, 3000, 700):
        table.lookup(np.arange(start, start + 700, dtype=np.uint64))
    assert table.num_rows == 3500  # ids 0..3499; 100..109 among them
    assert table.stats().capacity >= table.num_rows
    assert np.array_equal(table.peek(first)[0], pushed)
    others = np.arange(0, 3500, 7, dtype=np.uint64)
    others = others[(others < 100) | (others >= 110)]
    assert np.array_equal(table.peek(others)[0], table.initial_rows(others))
    table.push(first, np.ones((10, 4), dtype=np.float32))  # state survived the growth
    np.testing.assert_allclose(table.peek(first)[0], pushed - 0.1 / np.sqrt(2), rtol=1e-5)


def test_delete_drops_rows_and_reuses_slots():
    table = make(optimizer=OptimizerConfig(kind="sgd", lr=1.0))
    table.push(u64(1, 2, 3), np.ones((3, 4), dtype=np.float32))
    assert table.delete(u64(2, 3, 3, 99)) == 2
    assert table.ids().tolist() == [1]
    assert table.stats().deleted == 2
    assert np.array_equal(table.lookup(u64(2)), table.initial_rows(u64(2)))
    capacity = table.stats().capacity
    table.lookup(u64(4))
    assert table.num_rows == 3 and table.stats().capacity == capacity
    assert table.snapshot(incremental=True).tombstones.tolist() == [2, 3]


def test_fp16_storage_rounds_rows_and_does_float32_math():
    table = make(dtype="float16", dim=8, optimizer=OptimizerConfig(kind="adagrad", lr=0.01))
    wide = make(dim=8, optimizer=OptimizerConfig(kind="adagrad", lr=0.01))
    ids = np.arange(200, dtype=np.uint64)
    rows = table.lookup(ids)
    assert rows.dtype == np.float32
    assert np.array_equal(rows, rows.astype(np.float16).astype(np.float32))
    grads = np.random.default_rng(0).normal(size=(200, 8)).astype(np.float32)
    table.push(ids, grads)
    # expected: the float32 update applied to the float16 row, rounded back to float16
    acc = grads * grads
    expected = (rows - np.float32(0.01) * grads / (np.sqrt(acc) + np.float32(1e-8)))
    got = table.lookup(ids)
    assert np.array_equal(got, expected.astype(np.float16).astype(np.float32))
    wide.lookup(ids)
    assert table.stats().bytes < wide.stats().bytes


def test_stats_report_sizes_and_counters():
    table = make(dim=16)
    table.lookup(np.arange(100, dtype=np.uint64))
    table.push(np.arange(50, dtype=np.uint64), np.ones((50, 16), dtype=np.float32))
    s = table.stats()
    assert s.rows == 100 and s.capacity >= 100
    assert s.bytes >= s.capacity * 16 * 4 * 2  # rows + adagrad accumulator at least
    assert (s.lookups, s.pushes, s.ids_pushed) == (1, 1, 50)


def test_use_bookkeeping_is_kept_only_where_eviction_or_ttl_reads_it():
    """A table without ``max_rows`` or ``ttl_s`` holds no last-use tick, time or use count
    (24 bytes a slot); its snapshot restores into an LRU table, which then evicts by its
    own use from there on."""
    ids = np.arange(1, 201, dtype=np.uint64)
    plain, tracked = make(dim=16), make(dim=16, max_rows=1000)
    for table in (plain, tracked):
        table.push(ids, np.ones((200, 16), dtype=np.float32))
    assert plain.stats().capacity == tracked.stats().capacity
    assert tracked.nbytes() - plain.nbytes() == 24 * plain.stats().capacity
    snap = plain.snapshot()
    assert snap.meta == {} and set(tracked.snapshot().meta) == {"tick", "uses"}
    assert plain.content_digest() == tracked.content_digest()  # same rows and state

    lru = make(dim=16, max_rows=200)
    lru.restore(snap)
    assert lru.content_digest() == plain.content_digest()
    lru.lookup(ids[100:])  # the restored rows 101..200 are now the recent ones
    lru.lookup(np.arange(1001, 1051, dtype=np.uint64))
    assert lru.stats().evictions == 50
    assert lru.ids().tolist() == [*range(51, 201), *range(1001, 1051)]


def test_concurrent_calls_from_threads_are_serialised():
    from concurrent.futures import ThreadPoolExecutor

    def work(table: EmbeddingTable, part: int) -> None:
        rng = np.random.default_rng(part)
        for _ in range(20):  # disjoint id ranges per thread, growth included
            ids = (rng.integers(0, 3000, size=300) * 4 + part).astype(np.uint64)
            table.lookup(ids)
            table.push(ids, rng.normal(size=(300, 4)).astype(np.float32))

    threaded, sequential = make(initial_capacity=8), make(initial_capacity=8)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: work(threaded, p), range(4)))
    for part in range(4):
        work(sequential, part)
    assert threaded.num_rows == sequential.num_rows
    ids = sequential.ids()
    assert np.array_equal(threaded.ids(), ids)
    assert np.array_equal(threaded.peek(ids)[0], sequential.peek(ids)[0])


# each key by counting (narrow range) or introselect (wide)
@pytest.mark.parametrize("span,span2", [(3, 3), (10**12, 3), (3, 10**12), (1, 1)])
def test_smallest_matches_a_full_sort_with_ties(span, span2):
    from services.ps.arena import smallest_keys

    rng = np.random.default_rng(span + span2)
    primary = rng.integers(0, span, 5000)
    secondary = rng.integers(0, span2, 5000)
    ids = rng.permutation(5000).astype(np.uint64)
    want = np.lexsort((ids, secondary, primary))
    for k in (1, 17, 2500, 4999):
        assert sorted(smallest_keys(k, primary, secondary, ids).tolist()) == sorted(want[:k].tolist())
