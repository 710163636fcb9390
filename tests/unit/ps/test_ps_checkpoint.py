"""Snapshots and checkpoints: identical restore, incremental chains, resharding, corruption."""

from __future__ import annotations

import json
import os
import re

import msgspec
import numpy as np
import pytest

from services.common.admin_replies import CheckpointManifest
from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.common.sharding import shard_of
from services.ps.checkpoint import (
    list_checkpoints,
    read_checkpoint,
    read_epoch,
    restore_tables,
    write_checkpoint,
)
from services.ps.store import EmbeddingTable
from services.ps.tables import OptimizerConfig, TableConfig

DIM = 6
UNIVERSE = np.arange(0, 3000, dtype=np.uint64)


def make(name: str = "emb", kind: str = "adam", **kw) -> EmbeddingTable:
    return EmbeddingTable(TableConfig(name=name, dim=DIM, seed=4,
                                      optimizer=OptimizerConfig(kind=kind, lr=0.05), **kw))


def train(table: EmbeddingTable, ids: np.ndarray, seed: int, steps: int = 3) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        batch = rng.choice(ids, size=min(ids.size, 400)).astype(np.uint64)
        table.lookup(batch)
        table.push(batch, rng.normal(size=(batch.size, DIM)).astype(np.float32))


def answers(table: EmbeddingTable, ids: np.ndarray = UNIVERSE) -> tuple[bytes, bytes]:
    rows, present = table.peek(ids)
    return rows.tobytes(), present.tobytes()


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_snapshot_restore_is_identical_and_continues_identically(kind, dtype):
    table = make(kind=kind, dtype=dtype)
    train(table, UNIVERSE[:1000], seed=1)
    fresh = make(kind=kind, dtype=dtype)
    fresh.restore(table.snapshot())
    assert answers(fresh) == answers(table)
    assert fresh.content_digest() == table.content_digest()
    assert fresh.num_rows == table.num_rows
    train(table, UNIVERSE[:1200], seed=2)  # same future on both: optimizer state carried over
    train(fresh, UNIVERSE[:1200], seed=2)
    assert fresh.content_digest() == table.content_digest()


def test_restore_rejects_an_incompatible_snapshot():
    snap = make(kind="adam").snapshot()
    with pytest.raises(FailedPrecondition, match="optimizer"):
        make(kind="sgd").restore(snap)
    other_dim = EmbeddingTable(TableConfig(name="emb", dim=DIM + 1))
    with pytest.raises(FailedPrecondition, match="dim"):
        other_dim.restore(make(kind="adagrad").snapshot())


def test_incremental_snapshots_hold_changed_rows_and_tombstones():
    table = make()
    table.lookup(UNIVERSE[:100])
    assert table.snapshot(incremental=True).ids.size == 100  # created rows are changes
    assert table.snapshot(incremental=True).ids.size == 0  # the dirty set was reset
    table.lookup(UNIVERSE[:100])  # reading changes nothing
    table.push(UNIVERSE[10:15], np.ones((5, DIM), dtype=np.float32))
    table.delete(UNIVERSE[50:53])
    snap = table.snapshot(incremental=True)
    assert snap.incremental
    assert snap.ids.tolist() == list(range(10, 15))
    assert snap.tombstones.tolist() == [50, 51, 52]
    assert set(snap.state) == {"m", "v", "step"} and snap.state["step"].tolist() == [1] * 5


def test_checkpoint_chain_with_tombstones_restores_exactly(tmp_path):
    table = make(max_rows=900)
    train(table, UNIVERSE[:800], seed=1)
    m1 = write_checkpoint(tmp_path, "c1", 0, 1, {"emb": table})
    assert not m1.incremental and m1.tables["emb"].rows == table.num_rows
    train(table, UNIVERSE[400:1400], seed=2)  # evicts (max_rows) and creates rows
    table.delete(UNIVERSE[400:420])
    m2 = write_checkpoint(tmp_path, "c2", 0, 1, {"emb": table}, incremental=True, parent="c1")
    assert m2.tables["emb"].tombstones > 20 and m2.parent == "c1"
    train(table, UNIVERSE[:300], seed=3)
    write_checkpoint(tmp_path, "c3", 0, 1, {"emb": table}, incremental=True, parent="c2")
    chain = read_checkpoint(tmp_path, "c3", shard_id=0, num_shards=1)["emb"]
    assert [s.incremental for s in chain] == [False, True, True]
    restored = restore_tables(tmp_path, "c3", shard_id=0, num_shards=1)["emb"]
    assert restored.content_digest() == table.content_digest()
    assert answers(restored) == answers(table)
    assert table.stats().evictions > 0
    # an intermediate checkpoint restores the state of its own time
    mid = restore_tables(tmp_path, "c1", shard_id=0, num_shards=1)["emb"]
    assert mid.num_rows == m1.tables["emb"].rows
    assert [c.checkpoint_id for c in list_checkpoints(tmp_path)] == ["c1", "c2", "c3"]


def _two_shards() -> list[dict[str, EmbeddingTable]]:
    shards = []
    for k in range(2):
        ids = UNIVERSE[shard_of(UNIVERSE, 2) == k]
        tables = {"emb": make(), "other": make("other", kind="sgd", dtype="float16")}
        for i, table in enumerate(tables.values()):
            train(table, ids, seed=10 * k + i)
        shards.append(tables)
    return shards


def test_reshard_two_shards_into_three(tmp_path):
    old = _two_shards()
    for k, tables in enumerate(old):
        write_checkpoint(tmp_path, "base", k, 2, tables)
    for k, tables in enumerate(old):  # an incremental on top, with deletions
        tables["emb"].delete(tables["emb"].ids()[:25])
        train(tables["emb"], UNIVERSE[shard_of(UNIVERSE, 2) == k], seed=99 + k, steps=1)
        write_checkpoint(tmp_path, "inc", k, 2, tables, incremental=True, parent="base")
    summary = list_checkpoints(tmp_path)[-1]
    assert summary.complete and summary.num_shards == 2 and summary.shards == [0, 1]
    for name in ("emb", "other"):
        everything = np.concatenate([s[name].ids() for s in old])
        rows_by_id = {}
        for s in old:
            ids = s[name].ids()
            rows_by_id.update(zip(ids.tolist(), s[name].peek(ids)[0], strict=True))
        total = 0
        for k in range(3):
            new = restore_tables(tmp_path, "inc", shard_id=k, num_shards=3)[name]
            ids = new.ids()
            expected_ids = np.sort(everything[shard_of(everything, 3) == k])
            assert np.array_equal(ids, expected_ids)
            got = new.peek(ids)[0]
            assert np.array_equal(got, np.stack([rows_by_id[i] for i in ids.tolist()]))
            total += ids.size
        assert total == everything.size > 1000


def test_same_shard_count_reads_only_its_own_part(tmp_path):
    old = _two_shards()
    for k, tables in enumerate(old):
        write_checkpoint(tmp_path, "c", k, 2, tables)
    for k in range(2):
        new = restore_tables(tmp_path, "c", shard_id=k, num_shards=2)
        assert new["emb"].content_digest() == old[k]["emb"].content_digest()
        assert new["other"].content_digest() == old[k]["other"].content_digest()


def test_corruption_is_detected(tmp_path):
    table = make()
    train(table, UNIVERSE[:500], seed=1)
    manifest = write_checkpoint(tmp_path, "c", 0, 1, {"emb": table})
    part = tmp_path / "c" / "shard-0-of-1"
    rows_file = part / manifest.tables["emb"].files["rows"].file
    data = bytearray(rows_file.read_bytes())
    data[-3] ^= 0x40
    rows_file.write_bytes(bytes(data))
    with pytest.raises(FailedPrecondition, match="corrupt"):
        read_checkpoint(tmp_path, "c", shard_id=0, num_shards=1)
    (part / "manifest.json").write_text("{not json")
    with pytest.raises(FailedPrecondition, match="manifest"):
        read_checkpoint(tmp_path, "c", shard_id=0, num_shards=1)


def test_missing_and_incomplete_checkpoints_are_clear_errors(tmp_path):
    old = _two_shards()
    write_checkpoint(tmp_path, "half", 0, 2, old[0])
    with pytest.raises(FailedPrecondition, match="shard-1-of-2"):
        read_checkpoint(tmp_path, "half", shard_id=0, num_shards=3)
    assert not list_checkpoints(tmp_path)[0].complete
    with pytest.raises(NotFound):
        read_checkpoint(tmp_path, "nope", shard_id=0, num_shards=1)
    with pytest.raises(NotFound, match="parent"):
        write_checkpoint(tmp_path, "x", 0, 1, old[0], incremental=True, parent="nope")
    with pytest.raises(InvalidArgument):
        write_checkpoint(tmp_path, "../evil", 0, 1, old[0])
    with pytest.raises(InvalidArgument, match="parent"):
        write_checkpoint(tmp_path, "y", 0, 1, old[0], incremental=True)
    with pytest.raises(AlreadyExists):
        write_checkpoint(tmp_path, "half", 0, 2, old[0])


def test_a_failed_write_leaves_nothing_and_keeps_the_changes(tmp_path, monkeypatch):
    table = make()
    table.lookup(UNIVERSE[:50])
    write_checkpoint(tmp_path, "c1", 0, 1, {"emb": table})
    table.push(UNIVERSE[:5], np.ones((5, DIM), dtype=np.float32))
    table.delete(UNIVERSE[40:42])

    def broken_rename(src, dst):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(os, "rename", broken_rename)
    with pytest.raises(OSError, match="injected"):
        write_checkpoint(tmp_path, "c2", 0, 1, {"emb": table}, incremental=True, parent="c1")
    monkeypatch.undo()
    assert os.listdir(tmp_path / "c2") == []  # no part, no temp directory
    assert [c.checkpoint_id for c in list_checkpoints(tmp_path)] == ["c1"]
    m = write_checkpoint(tmp_path, "c3", 0, 1, {"emb": table}, incremental=True, parent="c1")
    assert m.tables["emb"].rows == 5 and m.tables["emb"].tombstones == 2
    restored = restore_tables(tmp_path, "c3", shard_id=0, num_shards=1)["emb"]
    assert restored.content_digest() == table.content_digest()


def test_manifest_records_configs_counts_and_checksums(tmp_path):
    table = make(dtype="float16", max_rows=10_000)
    train(table, UNIVERSE[:300], seed=1)
    write_checkpoint(tmp_path, "c", 0, 1, {"emb": table})
    manifest = json.loads((tmp_path / "c" / "shard-0-of-1" / "manifest.json").read_text())
    entry = manifest["tables"]["emb"]
    assert (manifest["shard_id"], manifest["num_shards"], manifest["incremental"]) == (0, 1, False)
    assert entry["dtype"] == "float16" and entry["dim"] == DIM
    assert entry["optimizer"]["kind"] == "adam" and entry["config"]["max_rows"] == 10_000
    assert entry["rows"] == table.num_rows
    assert {"ids", "rows", "tombstones", "state:m", "state:v", "state:step"} <= set(entry["files"])
    assert all(len(f["sha256"]) == 64 for f in entry["files"].values())
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".tmp")]


def test_the_manifest_written_is_the_record_returned_and_listed(tmp_path):
    table = make()
    train(table, UNIVERSE[:300], seed=1)
    written = write_checkpoint(tmp_path, "c", 0, 1, {"emb": table}, epoch=3,
                               pushes={"clients": np.arange(4, dtype=np.uint64)})
    on_disk = json.loads((tmp_path / "c" / "shard-0-of-1" / "manifest.json").read_text())
    assert msgspec.convert(on_disk, CheckpointManifest) == written
    [listed] = list_checkpoints(tmp_path)
    assert listed.parts == [written] and listed.tables == {"emb": table.num_rows}
    assert read_epoch(tmp_path, "c") == 3


@pytest.mark.parametrize(("path", "value", "field"), [
    (("tables", "emb", "rows"), "many", "manifest.tables[...].rows: Expected `int`"),
    (("tables", "emb", "files", "ids", "sha256"), None, "manifest.tables[...].files[...].sha256"),
    (("tables", "emb", "config", "dim"), 0, "manifest.tables[...].config.dim"),
    (("epoch",), -1, "manifest.epoch"),
    (("pushes",), ["clients"], "manifest.pushes"),
    (("colour",), "red", "unknown fields ['colour']"),
])
def test_a_malformed_manifest_is_refused_naming_its_field(tmp_path, path, value, field):
    table = make()
    train(table, UNIVERSE[:100], seed=1)
    write_checkpoint(tmp_path, "c", 0, 1, {"emb": table})
    file = tmp_path / "c" / "shard-0-of-1" / "manifest.json"
    manifest = json.loads(file.read_text())
    entry = manifest
    for key in path[:-1]:
        entry = entry[key]
    entry[path[-1]] = value
    file.write_text(json.dumps(manifest))
    for read in (lambda: list_checkpoints(tmp_path),
                 lambda: read_checkpoint(tmp_path, "c", shard_id=0, num_shards=1),
                 lambda: read_epoch(tmp_path, "c")):
        with pytest.raises(FailedPrecondition, match=re.escape(field)):
            read()


def test_restore_keep_filters_rows_and_tombstones():
    table = make()
    train(table, UNIVERSE[:600], seed=5)
    target = make()
    target.lookup(UNIVERSE[:10])  # 0..9 exist in the target
    table.delete(UNIVERSE[:10])
    snap = table.snapshot()
    assert snap.tombstones.tolist() == list(range(10))

    def even(ids: np.ndarray) -> np.ndarray:
        return ids % 2 == 0

    target.restore(snap, keep=even)
    ids = target.ids()
    assert ids.tolist() == [1, 3, 5, 7, 9] + [i for i in snap.ids.tolist() if i % 2 == 0]
    kept = snap.ids[even(snap.ids)]
    assert np.array_equal(target.peek(kept)[0], table.peek(kept)[0])
