"""The disk tier: a tiered table gives bit-identical rows, optimizer state, eviction, TTL,
snapshots and checkpoints to a RAM-only table fed the same calls."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from services.common.errors import ConfigError
from services.ps.checkpoint import read_checkpoint, restore_tables, write_checkpoint
from services.ps.disk import DiskTier
from services.ps.store import EmbeddingTable
from services.ps.tables import OptimizerConfig, StorageConfig, TableConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pair(tmp_path, ram_rows: int = 8, **kw) -> tuple[EmbeddingTable, EmbeddingTable, FakeClock]:
    """(RAM-only table, tiered table with ``ram_rows``) of the same config and clock."""
    clock = FakeClock()
    cfg = TableConfig(name="t", **{"dim": 4, **kw})
    tiered = replace(cfg, storage=StorageConfig(tier="disk", path=str(tmp_path / "tier"),
                                                ram_rows=ram_rows))
    return EmbeddingTable(cfg, clock=clock), EmbeddingTable(tiered, clock=clock), clock


def zipf_calls(seed: int, steps: int, n: int = 48, dim: int = 4):
    rng = np.random.default_rng(seed)
    for step in range(steps):
        ids = (rng.zipf(1.1, n) % 400).astype(np.uint64)  # with duplicates
        grads = rng.standard_normal((n, dim)).astype(np.float32)
        yield step, ids, grads


def assert_same(ram: EmbeddingTable, tiered: EmbeddingTable) -> None:
    a, b = ram.snapshot(), tiered.snapshot()
    assert np.array_equal(a.ids, b.ids)
    assert a.rows.tobytes() == b.rows.tobytes()
    assert a.state.keys() == b.state.keys()
    for key in a.state:
        assert a.state[key].tobytes() == b.state[key].tobytes(), key
    for key in a.meta:
        assert np.array_equal(a.meta[key], b.meta[key]), key
    assert ram.content_digest() == tiered.content_digest()


# capacity 8: the disk tier's file and id index grow (the index rebuilt) many times
@pytest.mark.parametrize("kind,capacity", [("adagrad", 1024), ("adam", 1024),
                                           ("rowwise_adagrad", 8), ("ftrl", 1024)])
def test_tiered_table_matches_ram_only_bit_for_bit(tmp_path, kind, capacity):
    ram, tiered, _ = pair(tmp_path, optimizer=OptimizerConfig(kind=kind, lr=0.05),
                          initial_capacity=capacity)
    for step, ids, grads in zipf_calls(1, 40):
        assert np.array_equal(ram.lookup(ids), tiered.lookup(ids))
        if step % 3:
            ram.push(ids, grads)
            tiered.push(ids, grads)
    s = tiered.stats()
    assert s.disk_rows > 100 and s.promoted > 0 and s.demoted > 0
    assert s.rows == ram.num_rows and s.rows - s.disk_rows <= 8 + 48
    probe = np.arange(0, 420, dtype=np.uint64)
    for got, want in zip(tiered.peek(probe), ram.peek(probe), strict=True):
        assert np.array_equal(got, want)
    held, state = ram.state_of(probe), tiered.state_of(probe)  # a replica's seed, both tiers
    absent = ~ram.peek(probe)[1]
    assert absent.sum() >= 10
    fresh = EmbeddingTable(ram.config)  # absent ids read a new row's state
    fresh.lookup(probe[absent])
    snap, new = ram.snapshot(), fresh.snapshot()
    for key in held:
        assert held[key].tobytes() == state[key].tobytes(), key
        assert held[key][~absent].tobytes() == snap.state[key][np.searchsorted(
            snap.ids, probe[~absent])].tobytes(), key
        assert held[key][absent].tobytes() == new.state[key].tobytes(), key
    assert np.array_equal(tiered.ids(), ram.ids())
    assert_same(ram, tiered)


@pytest.mark.parametrize("dim", [4, 3])  # records copied in 8-byte words, in 2-byte ones
def test_fp16_rows_and_a_push_only_workload_match(tmp_path, dim):
    ram, tiered, _ = pair(tmp_path, ram_rows=3, dtype="float16", dim=dim)
    for _, ids, grads in zipf_calls(2, 25, dim=dim):
        ram.push(ids, grads)
        tiered.push(ids, grads)
    assert_same(ram, tiered)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_max_rows_evicts_the_same_rows_across_both_tiers(tmp_path, policy):
    ram, tiered, _ = pair(tmp_path, ram_rows=10, max_rows=60, eviction=policy)
    for _, ids, grads in zipf_calls(3, 30):
        ram.lookup(ids)
        tiered.lookup(ids)
        ram.push(ids, grads)
        tiered.push(ids, grads)
    assert ram.stats().evictions == tiered.stats().evictions > 0
    assert tiered.stats().disk_rows > 0
    assert_same(ram, tiered)


def test_ttl_expires_rows_on_disk_too(tmp_path):
    ram, tiered, clock = pair(tmp_path, ram_rows=4, ttl_s=10.0)
    tiered.lookup(np.arange(20, dtype=np.uint64))
    ram.lookup(np.arange(20, dtype=np.uint64))
    clock.now = 8.0
    for table in (ram, tiered):
        table.lookup(np.arange(5, dtype=np.uint64))
    assert tiered.stats().disk_rows >= 15
    clock.now = 15.0
    assert ram.expire() == tiered.expire() == 15
    assert np.array_equal(tiered.ids(), np.arange(5, dtype=np.uint64))
    assert ram.snapshot().tombstones.tolist() == tiered.snapshot().tombstones.tolist()


def test_delete_reaches_rows_on_disk(tmp_path):
    _, tiered, _ = pair(tmp_path, ram_rows=2)
    tiered.lookup(np.arange(10, dtype=np.uint64))
    assert tiered.stats().disk_rows >= 8
    assert tiered.delete(np.array([0, 1, 0, 9, 99], dtype=np.uint64)) == 3
    assert tiered.num_rows == 7 and not tiered.peek(np.array([0, 1, 9], np.uint64))[1].any()


def test_incremental_snapshots_track_dirty_rows_through_demotion(tmp_path):
    ram, tiered, _ = pair(tmp_path, ram_rows=4)
    for _, ids, grads in zipf_calls(4, 10):
        ram.push(ids, grads)
        tiered.push(ids, grads)
    ram.snapshot(), tiered.snapshot()
    for _, ids, grads in zipf_calls(5, 3, n=6):
        ram.push(ids, grads)
        tiered.push(ids, grads)
        tiered.lookup(np.arange(300, 320, dtype=np.uint64))  # pushes the dirty rows to disk
        ram.lookup(np.arange(300, 320, dtype=np.uint64))
    a, b = ram.snapshot(incremental=True), tiered.snapshot(incremental=True)
    assert 20 < a.ids.shape[0] and np.array_equal(a.ids, b.ids)
    assert a.rows.tobytes() == b.rows.tobytes()
    assert tiered.snapshot(incremental=True).ids.shape[0] == 0


@pytest.mark.parametrize("direction", ["tiered_to_ram", "ram_to_tiered"])
def test_checkpoint_restores_across_storage_kinds(tmp_path, direction):
    ram, tiered, _ = pair(tmp_path, ram_rows=5, optimizer=OptimizerConfig(kind="adam"))
    for _, ids, grads in zipf_calls(6, 12):
        ram.push(ids, grads)
        tiered.push(ids, grads)
    ram.delete(np.array([1, 2], np.uint64))
    tiered.delete(np.array([1, 2], np.uint64))
    source = tiered if direction == "tiered_to_ram" else ram
    write_checkpoint(tmp_path / "ck", "c1", 0, 1, {"t": source})
    fresh_ram, fresh_tiered, _ = pair(tmp_path, ram_rows=3, optimizer=OptimizerConfig(kind="adam"))
    target = fresh_ram if direction == "tiered_to_ram" else fresh_tiered
    for snap in read_checkpoint(tmp_path / "ck", "c1", shard_id=0, num_shards=1)["t"]:
        target.restore(snap)
    assert target.content_digest() == source.content_digest()
    for _, ids, grads in zipf_calls(7, 5):  # and they continue identically
        source.push(ids, grads)
        target.push(ids, grads)
    assert target.content_digest() == source.content_digest()


def test_a_shard_restore_rebuilds_a_tiered_table_with_its_rows_on_disk(tmp_path):
    _, tiered, _ = pair(tmp_path, ram_rows=4)
    tiered.lookup(np.arange(50, dtype=np.uint64))
    write_checkpoint(tmp_path / "ck", "c1", 0, 1, {"t": tiered})
    back = restore_tables(tmp_path / "ck", "c1", shard_id=0, num_shards=1)["t"]
    assert back.config.storage == tiered.config.storage
    assert back.stats().disk_rows >= 40 and back.num_rows == 50
    assert back.content_digest() == tiered.content_digest()


def test_crash_during_write_back_then_restore_from_the_checkpoint(tmp_path, monkeypatch):
    ram, tiered, _ = pair(tmp_path, ram_rows=6)
    calls = list(zipf_calls(8, 14))
    for _, ids, grads in calls[:8]:
        ram.push(ids, grads)
        tiered.push(ids, grads)
    write_checkpoint(tmp_path / "ck", "c1", 0, 1, {"t": tiered})

    def crash(self, *args, **kwargs):
        raise OSError("disk died mid write-back")

    monkeypatch.setattr(DiskTier, "put", crash)
    with pytest.raises(OSError, match="mid write-back"):
        for _, ids, grads in calls[8:]:
            tiered.push(ids, grads)
    monkeypatch.undo()
    _, restored, _ = pair(tmp_path, ram_rows=6)
    for snap in read_checkpoint(tmp_path / "ck", "c1", shard_id=0, num_shards=1)["t"]:
        restored.restore(snap)
    assert restored.content_digest() == ram.content_digest()
    for _, ids, grads in calls[8:]:
        ram.push(ids, grads)
        restored.push(ids, grads)
    assert_same(ram, restored)


def test_write_backs_append_and_compaction_keeps_the_file_small(tmp_path):
    ram, tiered, _ = pair(tmp_path, ram_rows=8, initial_capacity=64)
    for _, ids, grads in zipf_calls(9, 120):
        ram.push(ids, grads)
        tiered.push(ids, grads)
    s = tiered.stats()
    assert s.demoted * 64 > 250_000  # appended without reuse, the file would pass 250 kB
    assert s.disk_bytes < 100_000 and s.disk_rows > 300
    assert_same(ram, tiered)


def test_the_arena_file_is_scratch_and_leaves_nothing(tmp_path):
    _, tiered, _ = pair(tmp_path, ram_rows=2)
    tiered.lookup(np.arange(5000, dtype=np.uint64))
    s = tiered.stats()
    assert s.disk_rows >= 4990 and s.disk_bytes > 4990 * 4 * 4 * 2
    assert list((tmp_path / "tier").iterdir()) == []


@pytest.mark.parametrize("storage, message", [
    ({"tier": "disk", "ram_rows": 10}, "storage.path"),
    ({"tier": "disk", "path": "x"}, "storage.ram_rows"),
    ({"tier": "disk", "path": "x", "ram_rows": 0}, "storage.ram_rows"),
    ({"tier": "ssd", "path": "x", "ram_rows": 1}, "storage.tier"),
    ({"path": "x"}, "tier disk only"),
    ({"tier": "disk", "path": "x", "ram_rows": 1, "size": 3}, "size"),
])
def test_bad_storage_config_is_a_clear_error(storage, message):
    with pytest.raises(ConfigError, match=message):
        TableConfig(name="t", dim=4, storage=storage)


def test_an_unusable_path_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    cfg = TableConfig(name="t", dim=4, storage={"tier": "disk", "path": str(tmp_path / "file"),
                                                "ram_rows": 4})
    with pytest.raises(ConfigError, match="cannot hold the disk tier"):
        EmbeddingTable(cfg)
