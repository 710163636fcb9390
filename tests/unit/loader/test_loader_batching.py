"""Batch wire form, jagged row operations, the batcher's shuffle, and ack accounting."""

from __future__ import annotations

import numpy as np
import pytest

from services.common import messages as m
from services.common.batch import Batch, Jagged
from services.common.errors import MalformedMessage
from services.loader.batching import Batcher, ChunkTracker, Rows, take_jagged


def make_rows(n: int, start: int = 0, chunk: int = 0) -> Rows:
    """Row i has label i, dense [i, -i], and feature 'f' with i % 3 ids all equal to i."""
    idx = np.arange(start, start + n)
    lengths = (idx % 3).astype(np.int32)
    return Rows(labels=idx.astype(np.float32),
                dense=np.stack([idx, -idx], axis=1).astype(np.float32),
                sparse={"f": Jagged(np.repeat(idx, lengths).astype(np.uint64), lengths),
                        "g": Jagged(idx.astype(np.uint64), np.ones(n, np.int32))},
                positions=idx.astype(np.int64), chunks=np.full(n, chunk, np.int64))


def check_consistent(rows: Rows) -> None:
    """Every row's ids are its own label (so any mix-up of jagged data shows)."""
    for name in ("f", "g"):
        f = rows.sparse[name]
        owner = np.repeat(rows.labels, f.lengths)
        np.testing.assert_array_equal(f.values.astype(np.float32), owner)
    np.testing.assert_array_equal(rows.dense[:, 0], rows.labels)
    np.testing.assert_array_equal(rows.positions, rows.labels)


def sample_batch() -> Batch:
    rows = make_rows(5)
    return rows.to_batch(7, lambda _: "file:e0:a.txt")


def test_batch_round_trips_through_the_wire():
    batch = sample_batch()
    item = m.decode(m.BatchesReply, m.encode(m.BatchItem(batch=m.BatchBody.of(batch))))
    back = item.batch.to_batch()
    assert back.batch_id == 7 and back.size == 5 and back.num_dense == 2
    assert back.feature_names == ["f", "g"]
    np.testing.assert_array_equal(back.labels, batch.labels)
    np.testing.assert_array_equal(back.dense, batch.dense)
    for name in batch.sparse:
        np.testing.assert_array_equal(back.sparse[name].values, batch.sparse[name].values)
        np.testing.assert_array_equal(back.sparse[name].lengths, batch.sparse[name].lengths)
    assert back.positions == {"file:e0:a.txt": (0, 4)}
    assert back.sparse["f"].offsets().tolist() == [0, 0, 1, 3, 3, 4]


@pytest.mark.parametrize("mutate,match", [
    (lambda w: w["sparse"]["f"].update(lengths=w["sparse"]["g"]["lengths"]), "lengths sum"),
    (lambda w: w.update(batch_id=-1), "batch_id"),
    (lambda w: w.update(batch_id=True), "batch_id"),
    (lambda w: w.update(labels=w["dense"]), "labels must be float32 with 1"),
    (lambda w: w["sparse"]["g"].update(values=w["sparse"]["g"]["lengths"]), "uint64"),
    (lambda w: w.update(sparse=[1, 2]), "batch.sparse must be a map"),
    (lambda w: w.update(positions={"p": [1]}), "batch.positions"),
    (lambda w: w["sparse"].update({"h": 3}), "batch.sparse\\[...\\] must be a map"),
    (lambda w: w["labels"].update(data=b"\x00" * 3), "needs 20 bytes"),
])
def test_malformed_batches_are_rejected(mutate, match):
    wire = m.BatchItem(batch=m.BatchBody.of(sample_batch())).to_wire()["batch"]
    mutate(wire)
    with pytest.raises(MalformedMessage, match=match):
        m.BatchItem.from_wire({"kind": "batch", "batch": wire}).batch.to_batch()
    with pytest.raises(MalformedMessage):
        m.BatchItem.from_wire({"kind": "batch", "batch": "not a map"})


def test_take_slice_concat_keep_rows_whole():
    rows = make_rows(10)
    check_consistent(rows.take(np.array([9, 0, 4, 4, 2])))
    check_consistent(rows.slice(3, 8))
    check_consistent(Rows.concat([rows.slice(0, 2), make_rows(4, start=50), rows.slice(9, 10)]))
    empty = take_jagged(rows.sparse["f"], np.array([], dtype=np.int64))
    assert empty.values.shape == (0,) and empty.lengths.shape == (0,)


def test_batcher_fixed_size_and_last_partial_batch():
    batcher = Batcher(4)
    out = batcher.push(make_rows(3)) + batcher.push(make_rows(6, start=3))
    assert [b.size for b in out] == [4, 4] and batcher.held == 1
    rest, dropped = batcher.flush()
    assert [b.size for b in rest] == [1] and dropped is None
    assert np.concatenate([b.labels for b in out + rest]).tolist() == list(range(9))
    dropping = Batcher(4, drop_last=True)
    dropping.push(make_rows(6))
    rest, dropped = dropping.flush()
    assert rest == [] and dropped is not None and dropped.labels.tolist() == [4.0, 5.0]


def test_shuffle_buffer_permutes_deterministically_and_keeps_every_row():
    def run(seed):
        b = Batcher(8, shuffle_buffer=32, seed=seed)
        out = []
        for k in range(10):
            out += b.push(make_rows(10, start=10 * k))
        out += b.flush()[0]
        for batch in out:
            check_consistent(batch)
        return np.concatenate([x.labels for x in out])

    first, again, other = run(1), run(1), run(2)
    assert sorted(first.tolist()) == list(range(100))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert not np.array_equal(first, np.arange(100))


def test_batcher_rejects_bad_sizes():
    with pytest.raises(ValueError):
        Batcher(0)
    with pytest.raises(ValueError):
        Batcher(4, shuffle_buffer=-1)


def test_tracker_commits_only_complete_prefixes():
    t = ChunkTracker()
    a = t.open("p", 0, 9, rows=10, meta="a")
    b = t.open("p", 10, 19, rows=10, meta="b")
    c = t.open("q", 0, 4, rows=5)
    t.settle(np.array([b.chunk_id]), np.array([10]))
    settled = t.take_settled()
    assert [ch.meta for ch in settled.done] == ["b"] and settled.advanced == {}
    t.settle(np.array([a.chunk_id, c.chunk_id]), np.array([6, 5]))
    settled = t.take_settled()
    assert [ch.partition for ch in settled.done] == ["q"]
    assert settled.advanced["q"].last == 4 and "p" not in settled.advanced
    t.settle(np.array([a.chunk_id]), np.array([4]))
    settled = t.take_settled()
    assert settled.advanced["p"].meta == "b" and settled.advanced["p"].last + 1 == 20
    assert t.open_chunks == 0 and not t.take_settled()


def test_tracker_empty_chunk_completes_at_once_and_duplicates_are_ignored():
    t = ChunkTracker()
    a = t.open("p", 0, 4, rows=5)
    empty = t.open("p", 5, 7, rows=0)  # all three records were malformed
    settled = t.take_settled()
    assert settled.done == [empty] and not settled.advanced
    t.settle(np.array([a.chunk_id]), np.array([5]))
    t.settle(np.array([a.chunk_id]), np.array([5]))  # a duplicate ack changes nothing
    settled = t.take_settled()
    assert settled.advanced["p"].last == 7 and settled.done == [a]
