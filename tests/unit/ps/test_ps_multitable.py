"""Several plain tables' lookups and pushes in one kernel call each (services.ps.multitable):
the same rows, optimizer state, counters and results as the tables' own, or None with nothing
changed where a table is not plain or an id has no row."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.common.messages import TableCounters
from services.ps import multitable, optimizers
from services.ps.multitable import lookup_plain, push_plain
from services.ps.store import EmbeddingTable
from services.ps.tables import OptimizerConfig, TableConfig
from tests.numba_signatures import signatures

DIM = 4
KINDS = ("adagrad", "rowwise_adagrad", "adam", "sgd")


def tables(**extra: object) -> list[EmbeddingTable]:
    return [EmbeddingTable(TableConfig(name=f"t{k}", dim=DIM, **extra,  # type: ignore[arg-type]
                                       optimizer=OptimizerConfig(kind=kind, lr=0.1)))
            for k, kind in enumerate(KINDS)]


def held_ids(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Per table, ``n`` ids of 0..29 (duplicates among them)."""
    return [rng.integers(0, 30, n).astype(np.uint64) for _ in KINDS]


def state(ts: list[EmbeddingTable]) -> list[tuple[str, TableCounters]]:
    return [(t.content_digest(), t.stats()) for t in ts]


def test_plain_lookups_and_pushes_equal_the_tables_own() -> None:
    """Tables of four optimizers: the same pushes (duplicate ids, NaN and Inf gradients)
    through push_plain and through each table's push leave the same rows, state and counters
    and give the same results; lookups the same rows (summing duplicates in another order,
    or applying a non-finite sum, fails)."""
    fused, own = tables(), tables()
    rng = np.random.default_rng(11)
    every = [np.arange(30, dtype=np.uint64)] * len(KINDS)
    for t, ids in zip(fused + own, every + every, strict=True):
        t.lookup(ids)  # every row created
    for step in range(6):
        ids = held_ids(rng, 40)
        grads = [rng.normal(size=(40, DIM)).astype(np.float32) for _ in KINDS]
        grads[step % len(KINDS)][3] = np.nan
        grads[(step + 1) % len(KINDS)][5, 1] = np.inf
        results = push_plain(fused, ids, grads)
        assert results is not None
        assert results == [t.push(i, g) for t, i, g in zip(own, ids, grads, strict=True)]
        assert sum(r.dropped_nonfinite for r in results) >= 2
        reads = held_ids(rng, 25)
        rows = lookup_plain(fused, reads, DIM)
        assert rows is not None
        np.testing.assert_array_equal(
            rows, np.concatenate([t.lookup(i) for t, i in zip(own, reads, strict=True)]))
    assert state(fused) == state(own)


@pytest.mark.parametrize("kind", ["adagrad", "rowwise_adagrad"])
def test_tables_of_one_adagrad_config_update_in_one_call_as_their_own(kind: str) -> None:
    """Tables sharing an Adagrad config (one optimizer call for all of them): the same rows,
    state, counters and results as each table's own push, and the same rows changed in an
    incremental snapshot (the pushed ones only: a flag set on the wrong table or slot, or
    not at all, shows). Weight decay and a weight bound are in the config (a kernel that
    dropped them differs)."""
    def five() -> list[EmbeddingTable]:
        return [EmbeddingTable(TableConfig(name=f"t{k}", dim=DIM, optimizer=OptimizerConfig(
            kind=kind, lr=0.2, weight_decay=0.01, weight_bound=0.3))) for k in range(5)]
    fused, own = five(), five()
    rng = np.random.default_rng(5)
    for t in fused + own:
        t.lookup(np.arange(60, dtype=np.uint64))
        t.snapshot(incremental=True)  # every flag clear
    for _ in range(3):
        ids = [rng.integers(0, 60, int(rng.integers(1, 30))).astype(np.uint64) for _ in range(5)]
        grads = [rng.normal(size=(i.size, DIM)).astype(np.float32) for i in ids]
        grads[1][0] = np.inf
        results = push_plain(fused, ids, grads)
        assert results == [t.push(i, g) for t, i, g in zip(own, ids, grads, strict=True)]
    assert state(fused) == state(own)
    for a, b in zip(fused, own, strict=True):
        delta, expected = a.snapshot(incremental=True), b.snapshot(incremental=True)
        assert 0 < delta.ids.size < 60
        np.testing.assert_array_equal(delta.ids, expected.ids)
        np.testing.assert_array_equal(delta.rows, expected.rows)


def test_a_table_that_is_not_plain_is_left_to_its_own_lookups_and_pushes() -> None:
    """float16 rows: None, nothing changed."""
    ts = tables()
    ts[2] = EmbeddingTable(TableConfig(name="other", dim=DIM, dtype="float16"))
    ids = [np.arange(8, dtype=np.uint64)] * len(ts)
    for t, i in zip(ts, ids, strict=True):
        t.lookup(i)
    before = state(ts)
    assert lookup_plain(ts, ids, DIM) is None
    assert push_plain(ts, ids, [np.ones((8, DIM), np.float32)] * len(ts)) is None
    assert state(ts) == before


class Clock:
    """A table's clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def capped(clock: Clock) -> list[EmbeddingTable]:
    """Tables that keep use bookkeeping (an LRU and an LFU row cap, a TTL) and one that
    keeps none."""
    kinds: list[dict[str, object]] = [{"max_rows": 40}, {"max_rows": 40, "eviction": "lfu"},
                                      {"ttl_s": 5.0}, {}]
    return [EmbeddingTable(TableConfig(name=f"t{k}", dim=DIM, **kind,  # type: ignore[arg-type]
                                       optimizer=OptimizerConfig(kind="adagrad", lr=0.1)),
                           clock=clock) for k, kind in enumerate(kinds)]


def test_tables_with_a_row_cap_or_ttl_take_the_plain_path_and_track_use_as_their_own() -> None:
    """Row caps (LRU, LFU), a TTL and a table without either: lookups and pushes of held ids in one call each (no
    fallback), leaving the same rows, state, counters and use bookkeeping (tick, uses) as
    the tables' own; then new rows past the cap evict, and the clock expires, the same rows
    (a kernel that marked no use, or marked the wrong slots or ticks, evicts others)."""
    clock_a, clock_b = Clock(), Clock()
    fused, own = capped(clock_a), capped(clock_b)
    rng = np.random.default_rng(3)
    every = [np.arange(30, dtype=np.uint64)] * 4
    for t, ids in zip(fused + own, every + every, strict=True):
        t.lookup(ids)
    for step in range(5):
        for clock in (clock_a, clock_b):
            clock.now += 1.0
        ids = [rng.integers(0, 12 + 4 * step, 20).astype(np.uint64) for _ in range(4)]
        grads = [rng.normal(size=(20, DIM)).astype(np.float32) for _ in range(4)]
        grads[step % 4][2] = np.nan
        results = push_plain(fused, ids, grads)
        assert results is not None  # the plain path served it
        assert results == [t.push(i, g) for t, i, g in zip(own, ids, grads, strict=True)]
        reads = [rng.integers(0, 8 + 3 * step, 15).astype(np.uint64) for _ in range(4)]
        rows = lookup_plain(fused, reads, DIM)
        assert rows is not None
        np.testing.assert_array_equal(
            rows, np.concatenate([t.lookup(i) for t, i in zip(own, reads, strict=True)]))
    assert state(fused) == state(own)
    for a, b in zip(fused, own, strict=True):
        got, want = a.snapshot().meta, b.snapshot().meta
        assert got.keys() == want.keys() and ("tick" in got) == (a is not fused[3])
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    fresh = np.arange(1000, 1025, dtype=np.uint64)  # 25 new rows: 15 evicted in a capped one
    for clock in (clock_a, clock_b):
        clock.now += 3.5  # rows untouched since the first steps pass the TTL
    for a, b in zip(fused, own, strict=True):
        a.lookup(fresh)
        b.lookup(fresh)
        assert a.expire() == b.expire()
        np.testing.assert_array_equal(a.ids(), b.ids())
    assert [t.stats().evictions for t in fused] == [15, 15, 0, 0]
    assert fused[2].stats().expired > 0
    assert state(fused) == state(own)


def test_a_push_of_an_id_without_a_row_changes_nothing_and_the_next_push_is_exact() -> None:
    """One absent id among many held ones: the push is None, no row created, no counter
    moved, and the push scratch is left clean (the next push equals the tables' own)."""
    fused, own = tables(), tables()
    held = [np.arange(10, dtype=np.uint64)] * len(KINDS)
    for t, ids in zip(fused + own, held + held, strict=True):
        t.lookup(ids)
    before = state(fused)
    absent = [*held[:-1], np.array([1, 1, 99], dtype=np.uint64)]
    grads = [np.ones((ids.size, DIM), np.float32) for ids in absent]
    assert push_plain(fused, absent, grads) is None
    assert state(fused) == before
    again = [np.array([3, 3, 4], dtype=np.uint64)] * len(KINDS)
    grads = [np.full((3, DIM), 0.5, np.float32)] * len(KINDS)
    assert push_plain(fused, again, grads) == [
        t.push(i, g) for t, i, g in zip(own, again, grads, strict=True)]
    assert state(fused) == state(own)


def test_a_lookup_of_new_ids_creates_their_rows_as_the_tables_own_lookups_do() -> None:
    """New ids (duplicated, beside held ones, in some tables only): the same rows, optimizer
    state, counters (a miss per new id, a lookup per table) and use marks as the tables' own
    lookups, and the pushes after them agree too."""
    fused, own = tables(max_rows=None), tables(max_rows=None)
    held = [np.arange(10, dtype=np.uint64)] * len(KINDS)
    for t, ids in zip(fused + own, held + held, strict=True):
        t.lookup(ids)
    reads = [held[0], np.array([3, 40, 40, 41, 5], dtype=np.uint64), held[2],
             np.array([77, 2], dtype=np.uint64)]
    rows = lookup_plain(fused, reads, DIM)
    assert rows is not None
    np.testing.assert_array_equal(
        rows, np.concatenate([t.lookup(i) for t, i in zip(own, reads, strict=True)]))
    assert state(fused) == state(own)
    assert [t.stats().misses for t in fused] == [10, 12, 10, 11]
    grads = [np.full((ids.size, DIM), 0.25, np.float32) for ids in reads]
    assert push_plain(fused, reads, grads) == [
        t.push(i, g) for t, i, g in zip(own, reads, grads, strict=True)]
    assert state(fused) == state(own)


@pytest.mark.parametrize("extra", [{"max_rows": 12}, {"admit_min_count": 2}])
def test_a_lookup_of_new_ids_in_a_table_that_admits_or_caps_changes_nothing(extra) -> None:
    """Where a table admits ids or caps its rows, its own lookup decides which rows exist:
    None, nothing created, no counter moved."""
    fused = tables(**extra)
    held = [np.arange(10, dtype=np.uint64)] * len(KINDS)
    for t, ids in zip(fused, held, strict=True):
        t.lookup(ids)
    before = state(fused)
    assert lookup_plain(fused, [*held[:-1], np.array([1, 99], dtype=np.uint64)], DIM) is None
    assert state(fused) == before
    with pytest.raises(InvalidArgument, match="t0"):
        fused[0].create_rows(np.array([50], dtype=np.uint64))
    assert state(fused) == before


def test_ids_gradients_or_dims_that_do_not_fit_are_left_to_the_tables_own_checks() -> None:
    ts = tables()
    ids = [np.arange(4, dtype=np.uint64)] * len(ts)
    for t, i in zip(ts, ids, strict=True):
        t.lookup(i)
    signed = [i.astype(np.int64) for i in ids]
    assert lookup_plain(ts, signed, DIM) is None
    assert push_plain(ts, signed, [np.ones((4, DIM), np.float32)] * len(ts)) is None
    assert push_plain(ts, ids, [np.ones((4, DIM), np.float64)] * len(ts)) is None
    wide = EmbeddingTable(TableConfig(name="wide", dim=2 * DIM))
    wide.lookup(ids[0])
    assert lookup_plain([*ts, wide], [*ids, ids[0]], DIM) is None  # rows wider than asked
    assert push_plain([wide, *ts], [ids[0], *ids],
                      [np.ones((4, 2 * DIM), np.float32)] + [np.ones((4, DIM), np.float32)]
                      * len(ts)) is None  # tables of two dims


def test_requests_naming_the_same_tables_in_other_orders_do_not_deadlock() -> None:
    """Two threads push to the same tables, named in opposite orders (each takes the tables'
    locks in name order: taken in request order, they deadlock)."""
    ts = tables()
    ids = [np.arange(16, dtype=np.uint64)] * len(ts)
    for t, i in zip(ts, ids, strict=True):
        t.lookup(i)
    grads = [np.full((16, DIM), 0.01, np.float32)] * len(ts)

    def push(order: list[EmbeddingTable]) -> None:
        for _ in range(300):
            assert push_plain(order, ids, grads) is not None

    threads = [threading.Thread(target=push, args=(o,), daemon=True) for o in (ts, ts[::-1])]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    assert all(t.stats().pushes == 600 for t in ts)


def test_a_request_of_any_number_of_tables_compiles_no_kernel_of_its_own() -> None:
    """Once requests of three tables ran, requests of one, five and eight add no signature
    to any kernel (compiled or loaded from numba's cache): a kernel that took one array per
    table would be compiled again for each number of tables, seconds each in every cold
    process."""
    def step(count: int) -> None:
        ts = [EmbeddingTable(TableConfig(name=f"n{k}", dim=DIM)) for k in range(count)]
        ids = [np.arange(8, dtype=np.uint64)] * count
        assert lookup_plain(ts, ids, DIM) is not None  # rows created, then one call
        assert push_plain(ts, ids, [np.ones((8, DIM), dtype=np.float32)] * count) is not None
        assert lookup_plain(ts, ids, DIM) is not None

    step(3)
    before = signatures(multitable, optimizers)
    for count in (1, 5, 8):
        step(count)
    assert signatures(multitable, optimizers) == before


def test_tables_whose_arenas_grow_between_and_within_requests_stay_exact() -> None:
    """Tables of 16 rows at first: a request of new ids that makes them grow, their own
    lookups that make them grow again, then pushes and lookups through push_plain and
    lookup_plain leave the same rows as twin tables' own calls (a kernel reading an arena
    from before it grew reads freed memory)."""
    def small() -> list[EmbeddingTable]:
        return [EmbeddingTable(TableConfig(name=f"g{k}", dim=DIM, initial_capacity=16))
                for k in range(3)]

    fused, own = small(), small()
    rng = np.random.default_rng(5)
    first = [np.arange(100, dtype=np.uint64) + np.uint64(k) for k in range(3)]
    held = np.arange(3, 100, dtype=np.uint64)  # in every table
    rows = lookup_plain(fused, first, DIM)
    assert rows is not None
    np.testing.assert_array_equal(
        rows, np.concatenate([t.lookup(i) for t, i in zip(own, first, strict=True)]))
    more = np.arange(1000, 1500, dtype=np.uint64)
    for t in fused + own:
        t.lookup(more)  # grows past 512 rows
    for _ in range(3):
        ids = [rng.choice(np.concatenate([held, more]), 64) for _ in range(3)]
        grads = [rng.normal(size=(64, DIM)).astype(np.float32) for _ in range(3)]
        assert push_plain(fused, ids, grads) == [
            t.push(i, g) for t, i, g in zip(own, ids, grads, strict=True)]
        got = lookup_plain(fused, ids, DIM)
        assert got is not None
        np.testing.assert_array_equal(
            got, np.concatenate([t.lookup(i) for t, i in zip(own, ids, strict=True)]))
    assert state(fused) == state(own)
