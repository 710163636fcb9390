"""A table's RAM arena on its own (services/ps/ram.py) and the disk tier's moves in and out of
it (DiskTier.spill, DiskTier.promote): slots reused, growth keeps every array, a row that
goes to disk and back comes back whole."""

from __future__ import annotations

import numpy as np

from services.ps.disk import DiskTier, record_dtype
from services.ps.optimizers import state_layout
from services.ps.ram import RamArena
from services.ps.tables import OptimizerConfig

DIM = 3
LAYOUT = state_layout(OptimizerConfig(kind="adagrad"), DIM)


def arena(capacity: int = 2) -> RamArena:
    return RamArena(capacity, DIM, np.dtype(np.float32), LAYOUT, tracks_use=True)


def test_add_finds_release_frees_and_freed_slots_are_reused():
    ram = arena(4)
    slots = ram.add(np.array([10, 11, 12], dtype=np.uint64))
    assert slots.tolist() == [0, 1, 2] and ram.count == 3
    assert ram.index.find(np.array([11, 99], dtype=np.uint64)).tolist() == [1, -1]
    assert ram.release(np.array([1], dtype=np.int64)).tolist() == [11]
    assert ram.count == 2 and not ram.live[np.array([1])][0]
    assert ram.index.find(np.array([11], dtype=np.uint64)).tolist() == [-1]
    assert ram.add(np.array([13, 14], dtype=np.uint64)).tolist() == [1, 3]  # freed one first
    assert ram.high == 4


def test_growth_keeps_rows_state_bits_and_use_bookkeeping():
    ram = arena(2)
    first = ram.add(np.array([1, 2], dtype=np.uint64))
    ram.rows[first] = [[1, 1, 1], [2, 2, 2]]
    ram.state["accum"][first] = 7
    ram.ticks[first], ram.uses[first], ram.last_used[first] = 5, 6, 8.5
    ram.dirty[first] = True
    more = ram.add(np.arange(100, 105, dtype=np.uint64))
    assert ram.capacity == 8 and more.tolist() == [2, 3, 4, 5, 6]
    assert ram.rows[first].tolist() == [[1, 1, 1], [2, 2, 2]]
    assert ram.state["accum"][first].tolist() == [[7] * DIM] * 2
    assert ram.ticks[first].tolist() == [5, 5] and ram.last_used[first].tolist() == [8.5, 8.5]
    assert ram.dirty[first].all() and ram.live[:7].all() and not ram.dirty[more].any()
    assert ram.seen.nbytes == 1 and ram.index.find(np.array([2], np.uint64)).tolist() == [1]


def test_spill_moves_the_least_recently_used_and_promote_brings_them_back_whole(tmp_path):
    ram = arena(8)
    ids = np.arange(1, 9, dtype=np.uint64)
    slots = ram.add(ids)
    ram.rows[slots] = np.arange(8 * DIM, dtype=np.float32).reshape(8, DIM)
    ram.state["accum"][slots] = ram.rows[slots] * 2
    ram.ticks[slots] = np.arange(8)[::-1]  # id 8 used least recently
    ram.dirty[slots[[0, 7]]] = True  # ids 1 and 8
    before = {name: arr[slots].copy() for name, arr in ram.columns().items()}
    disk = DiskTier(tmp_path, "t", record_dtype(DIM, np.dtype(np.float32), LAYOUT), 4)
    assert disk.spill(ram, 8) == 0  # not past ram_rows
    assert disk.spill(ram, 4) == 4  # down to 4 - 4 // 8 rows: the least recently used go
    assert ram.count == 4 and len(disk) == 4
    assert sorted(ram.index.slot_ids[np.flatnonzero(ram.live[:ram.high])]) == [1, 2, 3, 4]
    wanted = np.array([8, 1, 5, 8], dtype=np.uint64)  # on disk, in RAM, on disk, a repeat
    found = ram.index.find(wanted)
    assert disk.promote(ram, wanted, found) == 2 and len(disk) == 2 and ram.count == 6
    assert found[0] == found[3] >= 0
    for name, arr in ram.columns().items():
        np.testing.assert_array_equal(arr[found[:3]], before[name][[7, 0, 4]], err_msg=name)
    assert ram.dirty[found[:3]].tolist() == [True, True, False]  # the flags came back too
