"""The disk tier of an embedding table: cold rows in a memory-mapped, slot-addressed arena file.

A tiered :class:`~services.ps.store.EmbeddingTable` (``storage.tier: disk``) keeps its hot rows
in its RAM arena (:class:`~services.ps.ram.RamArena`); past ``storage.ram_rows`` rows there,
:meth:`DiskTier.spill` moves the least recently used ones here with their state and
bookkeeping (demotion, after each batch, down to 7/8 of ``ram_rows``), and
:meth:`DiskTier.promote` moves a row read or pushed again back (promotion), so every update
runs on the RAM arena, bit-identically. A row lives in exactly one tier. Each disk slot is one record of
:func:`record_dtype` — id, eviction bookkeeping, the row in its storage dtype and its
optimizer state — so a row's move touches one place of the file. The id → slot index
(:class:`~services.ps.slotindex.SlotIndex`: 4 bytes a bucket, the ids read from the records)
and the live/dirty flags of the slots stay in RAM. A row that leaves keeps its entry, dead
(its slot not live), until the slot is reclaimed: a removal from the index would read the
records of the entries it shifts, random reads of the file. Demoted rows are appended
(whole pages, in order); freed slots are reclaimed by compacting the file when it is full
and a quarter of it is free, which builds the index anew; the file grows by doubling and is
sparse.

The file is scratch, not a durable copy: it is unlinked as soon as it is open (the process's
descriptor keeps it), so nothing is left behind by a crash; checkpoints are the durable copy
and read both tiers.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
from numba import njit

from services.common.errors import ConfigError
from services.ps.arena import smallest_keys
from services.ps.hashtable import unique_inverse
from services.ps.prefetch import PREFETCH_DISTANCE, prefetch_row
from services.ps.ram import RamArena
from services.ps.slotindex import SlotIndex

__all__ = ["DiskTier", "record_dtype"]

_COMPACT_CHUNK = 1 << 20


def record_dtype(dim: int, storage_dtype: np.dtype,
                 state: dict[str, tuple[tuple[int, ...], np.dtype]]) -> np.dtype:
    """The record of one disk slot: ``id``, ``tick``, ``uses``, ``last_used``, ``row`` and
    ``state:<name>`` per optimizer state array (``state`` as from ``state_layout``)."""
    fields: list[tuple] = [("id", np.uint64), ("tick", np.int64), ("uses", np.int64),
                           ("last_used", np.float64), ("row", storage_dtype, (dim,))]
    fields += [(f"state:{name}", dt, shape) for name, (shape, dt) in sorted(state.items())]
    return np.dtype(fields)


def _record_fields(dtype: np.dtype) -> list[tuple[str, np.dtype, int]]:
    """``(name, dtype, byte offset)`` of each field of a record dtype, in order."""
    fields: Mapping[str, tuple] = dtype.fields or {}
    return [(name, fields[name][0], fields[name][1]) for name in dtype.names or ()]


def _copy_unit(dtype: np.dtype) -> np.dtype:
    """The widest unsigned integer dividing the record's size and each field's offset and size:
    records and the RAM arena's columns are copied in words of it."""
    sizes = [dtype.itemsize] + [v for _, field, offset in _record_fields(dtype)
                                for v in (offset, field.itemsize)]
    return next(np.dtype(u) for u in (np.uint64, np.uint32, np.uint16, np.uint8)
                if all(v % np.dtype(u).itemsize == 0 for v in sizes))


@njit(cache=True, nogil=True)
def _move_records(records, slots, columns, offsets, at, to_records):  # pragma: no cover
    """Between ``records[slots[i]]`` (one row of words a record) and ``columns[f][at[i]]``
    (field ``f`` at word ``offsets[f]``), into the records (a demotion's write) if
    ``to_records``, else out of them (a promotion's read); the next rows prefetched."""
    n = slots.shape[0]
    for i in range(n):
        ahead = min(i + PREFETCH_DISTANCE, n - 1)
        prefetch_row(records, slots[ahead])
        for f in range(len(columns)):
            prefetch_row(columns[f], at[ahead])
        s, a = slots[i], at[i]
        for f in range(len(columns)):
            column, o = columns[f], offsets[f]
            if to_records:
                for w in range(column.shape[1]):
                    records[s, o + w] = column[a, w]
            else:
                for w in range(column.shape[1]):
                    column[a, w] = records[s, o + w]


class DiskTier:
    """Rows of one table on disk: whole-batch ``put``/``take``/``read``/``remove`` by id.

    Not thread-safe: the owning table serialises access under its lock.
    """

    def __init__(self, directory: str | Path, name: str, dtype: np.dtype,
                 capacity: int = 1024) -> None:
        directory = Path(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".arena", dir=directory)
        except OSError as exc:
            raise ConfigError(f"table {name}: storage.path {str(directory)!r} cannot hold the "
                              f"disk tier: {exc}") from exc
        os.unlink(path)
        self._file = os.fdopen(fd, "r+b")
        self.dtype = dtype
        self._unit = _copy_unit(dtype)
        self._offsets = np.array([offset // self._unit.itemsize
                                  for _, _, offset in _record_fields(dtype)], dtype=np.int64)
        self._index = SlotIndex(max(1, int(capacity)), slot_ids=np.zeros(0, np.uint64))
        self._live = np.zeros(0, dtype=bool)
        self._dirty = np.zeros(0, dtype=bool)
        self._map = self._remap(max(1, int(capacity)))
        self._high = 0
        self._rows = 0

    def _remap(self, cap: int) -> np.ndarray:
        self._file.truncate(cap * self.dtype.itemsize)
        self._live = np.concatenate([self._live, np.zeros(cap - self._live.shape[0], bool)])
        self._dirty = np.concatenate([self._dirty, np.zeros(cap - self._dirty.shape[0], bool)])
        self._mmap = mmap.mmap(self._file.fileno(), cap * self.dtype.itemsize)
        self._advise("MADV_RANDOM")
        records = np.frombuffer(self._mmap, dtype=self.dtype, count=cap)
        self._index.slot_ids = np.asarray(records["id"])  # the index reads ids from the file
        # whole records move as rows of bytes (memcpy, much faster than numpy's copy of a
        # structured dtype) or of copy-unit words (the kernels)
        self._raw = records.view(np.uint8).reshape(cap, self.dtype.itemsize)
        self._words = self._raw.view(self._unit)
        return records

    def _advise(self, advice: str) -> None:
        """How the map is read: ``MADV_RANDOM``, a batch's scattered records (no readahead: it
        reads 128 KiB or more around each 4 KiB page, and a table past the page cache thrashes),
        or ``MADV_SEQUENTIAL`` for a scan in slot order."""
        if hasattr(mmap, advice):
            self._mmap.madvise(getattr(mmap, advice))

    @contextlib.contextmanager
    def _scan(self) -> Iterator[None]:
        """Reads of the whole tier in slot order, with readahead."""
        self._advise("MADV_SEQUENTIAL")
        try:
            yield
        finally:
            self._advise("MADV_RANDOM")

    def _column_words(self, columns: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        """Each record field's column (``columns[name]``, a row a slot) as rows of words."""
        views = []
        for name, field, _ in _record_fields(self.dtype):
            col = columns[name]
            if (col.dtype != field.base or col.shape[1:] != field.shape
                    or not col.flags.c_contiguous):
                raise TypeError(f"column {name}: {col.dtype}{col.shape[1:]} is not a "
                                f"C-contiguous column of the record's {field.base}{field.shape}")
            views.append(col.reshape(col.shape[0], -1).view(self._unit))
        return tuple(views)

    def _gather(self, slots: np.ndarray) -> np.ndarray:
        return self._raw[slots].view(self.dtype).reshape(slots.shape[0])

    def __len__(self) -> int:
        return self._rows

    # ----------------------------------------------------------------- by id

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The disk slot of each id, -1 where the id has no row here."""
        slots = self._index.find(ids)
        hit = np.flatnonzero(slots >= 0)
        slots[hit[~self._live[slots[hit]]]] = -1  # a dead entry: the row left
        return slots

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(records, found)``: the records of ``ids`` (garbage where not found); no change."""
        slots = self.find(ids)
        found = slots >= 0
        return self._gather(np.where(found, slots, 0)), found

    def put(self, columns: dict[str, np.ndarray], at: np.ndarray, dirty: np.ndarray) -> None:
        """Store the rows ``columns[field][at]`` (C-contiguous arrays of the record fields'
        dtypes, named as the fields) of ids that have no row here; ``dirty``: changed since the
        table's last snapshot."""
        words = self._column_words(columns)
        at = np.ascontiguousarray(at, dtype=np.int64)
        slots = self._allocate(at.shape[0])
        if not self._index.has_room(slots.shape[0]):
            self._rebuild_index(self._high)
        _move_records(self._words, slots, words, self._offsets, at, True)
        # after the records: a probe reads the ids of the entries it passes from them
        self._index.insert(self._map["id"][slots], slots)  # a dead entry moves to its new slot
        self._live[slots] = True
        self._dirty[slots] = dirty
        self._rows += slots.shape[0]

    def take(self, slots: np.ndarray, columns: dict[str, np.ndarray], at: np.ndarray
             ) -> np.ndarray:
        """Move the rows at distinct live ``slots`` (from :meth:`find`) into
        ``columns[field][at]`` (as :meth:`put`'s); returns their dirty flags; the slots are
        freed."""
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        _move_records(self._words, slots, self._column_words(columns), self._offsets,
                      np.ascontiguousarray(at, dtype=np.int64), False)
        dirty = self._dirty[slots].copy()
        self._release(slots)
        return dirty

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Drop the rows of unique ``ids``; returns the ids that had one."""
        slots = self.find(ids)
        hit = slots >= 0
        self._release(slots[hit])
        return ids[hit]

    def mark_dirty(self, ids: np.ndarray) -> None:
        slots = self.find(ids)
        self._dirty[slots[slots >= 0]] = True

    def read_into(self, ids: np.ndarray, present: np.ndarray, out: dict[str, np.ndarray]
                  ) -> None:
        """Fill ``out`` (record field -> array in ``ids`` order) where not ``present`` from the
        rows here, and mark those present; moves nothing."""
        if present.all():
            return
        cold = np.flatnonzero(~present)
        rec, found = self.read(ids[cold])
        for name, arr in out.items():
            arr[cold[found]] = rec[name][found]
        present[cold[found]] = True

    # ----------------------------------------------------------------- moves with RAM

    def promote(self, ram: RamArena, ids: np.ndarray, slots: np.ndarray) -> int:
        """Move the rows here of ``ids`` absent from ``ram`` (``slots`` -1) into it, with
        their dirty flags; fills their ``slots``; returns how many rows moved."""
        if not self._rows:
            return 0
        pos = np.flatnonzero(slots < 0)
        on_disk = self.find(ids[pos])
        hit = pos[on_disk >= 0]
        if not hit.shape[0]:
            return 0
        uids, inv = unique_inverse(ids[hit])
        dslots = np.empty(uids.shape[0], dtype=np.int64)
        dslots[inv] = on_disk[on_disk >= 0]  # the disk slot of each uid
        new = ram.add(uids)
        ram.dirty[new] = self.take(dslots, ram.columns(), new)
        slots[hit] = new[inv]
        return int(uids.shape[0])

    def spill(self, ram: RamArena, ram_rows: int) -> int:
        """Past ``ram_rows`` rows in ``ram``, move the least recently used here (down to 7/8
        of ``ram_rows``); returns how many rows moved."""
        if ram.count <= ram_rows:
            return 0
        live = np.flatnonzero(ram.live[:ram.high])
        k = ram.count - (ram_rows - ram_rows // 8)
        ids = ram.index.slot_ids[live]
        # in slot order: the write-back reads the arena's columns front to back
        victims = np.sort(live[smallest_keys(k, ram.ticks[live], ram.uses[live], ids)])
        self.put(ram.columns(), victims, ram.dirty[victims])
        ram.release(victims)
        return k

    # ----------------------------------------------------------------- whole tier

    def live_slots(self, *, dirty_only: bool = False) -> np.ndarray:
        """Slots holding a row (only rows changed since the last snapshot if ``dirty_only``)."""
        sel = self._live[:self._high]
        if dirty_only:
            sel = sel & self._dirty[:self._high]
        return np.flatnonzero(sel)

    def field(self, name: str, slots: np.ndarray) -> np.ndarray:
        """One field (e.g. ``tick``) of the records at ``slots``."""
        with self._scan():
            return np.asarray(self._map[name][slots])

    def idle_ids(self, now: float, ttl_s: float) -> np.ndarray:
        """Ids of the rows last used more than ``ttl_s`` before ``now``."""
        slots = self.live_slots()
        return self.field("id", slots[now - self.field("last_used", slots) > ttl_s])

    def records(self, slots: np.ndarray) -> np.ndarray:
        """The records at ``slots`` (sorted: a scan of the file)."""
        with self._scan():
            return self._gather(slots)

    def set_clean(self) -> None:
        """Every row counts as saved (the table took a snapshot)."""
        self._dirty[:] = False

    @property
    def nbytes_ram(self) -> int:
        """Bytes this tier holds in RAM: the id index and the per-slot flags."""
        return int(self._index.nbytes + self._live.nbytes + self._dirty.nbytes)

    @property
    def nbytes_disk(self) -> int:
        """Bytes of disk the arena file occupies (it is sparse: slots never written are free)."""
        return int(os.fstat(self._file.fileno()).st_blocks * 512)

    # ----------------------------------------------------------------- slots

    def _allocate(self, n: int) -> np.ndarray:
        """``n`` slots at the end of the used part: a write-back fills whole pages in order
        (a freed slot in the middle would cost a read and a write of its page). When the file
        is full and a quarter of it is freed slots, :meth:`_compact` reclaims them first."""
        cap = self._map.shape[0]
        if self._high + n > cap and 4 * (self._high - self._rows) >= cap:
            self._compact(n)
        if self._high + n > cap:
            while cap < self._high + n:
                cap *= 2
            self._mmap.flush()
            self._map = self._remap(cap)
        slots = np.arange(self._high, self._high + n, dtype=np.int64)
        self._high += n
        return slots

    def _compact(self, more: int) -> None:
        """Move every live record to the front, in order, and give the rest back as holes;
        the index is built anew (without its dead entries, with room for ``more``)."""
        live = np.flatnonzero(self._live[:self._high])
        n = live.shape[0]
        with self._scan():
            for start in range(0, n, _COMPACT_CHUNK):  # destinations never pass their sources
                src = live[start:start + _COMPACT_CHUNK]
                dst = np.arange(start, start + src.shape[0], dtype=np.int64)
                self._raw[dst] = self._raw[src]
        self._dirty[:n] = self._dirty[live]
        self._dirty[n:self._high] = False
        self._live[:n] = True
        self._live[n:self._high] = False
        self._high = n
        self._rebuild_index(n + more)
        size = self._map.shape[0] * self.dtype.itemsize
        self._mmap.flush()
        self._file.truncate(n * self.dtype.itemsize)  # frees the blocks past the live records
        self._file.truncate(size)

    def _rebuild_index(self, slots: int) -> None:
        """A new index of the live rows, for ``slots`` slots (without dead entries), their ids
        read in slot order: growing the index in place would read them in bucket order, a
        random read of the file each once the file outgrows the page cache."""
        live = np.flatnonzero(self._live[:self._high])
        with self._scan():
            ids = self._map["id"][live]
        self._index = SlotIndex(max(1, slots), slot_ids=self._index.slot_ids)
        self._index.insert_new(ids, live)

    def _release(self, slots: np.ndarray) -> None:
        self._live[slots] = False
        self._dirty[slots] = False
        self._rows -= slots.shape[0]
