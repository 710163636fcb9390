"""An embedding table's snapshots and restores: its rows, state and tombstones, full or
changed since the last snapshot.

:class:`TableSnapshots` is the part of :class:`services.ps.store.EmbeddingTable` that reads
every live row of both tiers out (ids ascending, rows in their storage dtype, the use
bookkeeping where the table keeps it) and loads a snapshot back: its tombstones dropped, its
rows created or overwritten as clean rows, a tiered table spilling as it goes. A snapshot
resets the dirty flags and tombstones; :meth:`TableSnapshots.requeue` undoes that when the
snapshot could not be saved.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from services.ps.disk import DiskTier
from services.ps.ram import RamArena
from services.ps.table_io import TableSnapshot, check_snapshot
from services.ps.tables import TableConfig

__all__ = ["TableSnapshots"]


class TableSnapshots:
    """Snapshot and restore an embedding table (mixed into ``EmbeddingTable``)."""

    # What the table owns and this part reads and changes (set by EmbeddingTable.__init__).
    config: TableConfig
    lock: threading.RLock
    _dtype: np.dtype
    _clock: Callable[[], float]
    _ram: RamArena
    _disk: DiskTier | None
    _tick: int
    _tombstones: list[np.ndarray]

    if TYPE_CHECKING:  # what the table provides
        def _drop(self, slots: np.ndarray, counter: str | None) -> None: ...
        def _drop_disk(self, ids: np.ndarray, counter: str | None) -> int: ...
        def _spill(self) -> None: ...
        def _promote(self, ids: np.ndarray, slots: np.ndarray) -> None: ...

    def snapshot(self, *, incremental: bool = False) -> TableSnapshot:
        """All rows (or those changed since the last snapshot) and tombstones; resets both."""
        with self.lock:
            cols = self._all_rows(dirty_only=incremental)
            tomb = (np.unique(np.concatenate(self._tombstones)) if self._tombstones
                    else np.empty(0, dtype=np.uint64))
            snap = TableSnapshot(config=self.config, ids=cols["id"],
                                 rows=cols["row"].astype(np.float32),
                                 state={k: cols[f"state:{k}"] for k in self._ram.state},
                                 tombstones=tomb, incremental=incremental,
                                 meta={k: cols[k] for k in ("tick", "uses") if k in cols})
            self._ram.dirty[:self._ram.high] = False
            if self._disk is not None:
                self._disk.set_clean()
            self._tombstones = []
            return snap

    def _all_rows(self, *, dirty_only: bool) -> dict[str, np.ndarray]:
        """:meth:`RamArena.columns` of both tiers' rows (only those changed since the last
        snapshot if ``dirty_only``), ids ascending; rows in their storage dtype."""
        ram = self._ram
        high = ram.high
        sel = ram.live[:high] & ram.dirty[:high] if dirty_only else ram.live[:high]
        slots = np.flatnonzero(sel)
        cols = {name: arr[slots] for name, arr in ram.columns().items()}
        if self._disk is not None:
            rec = self._disk.records(self._disk.live_slots(dirty_only=dirty_only))
            cols = {name: np.concatenate([arr, rec[name]]) for name, arr in cols.items()}
        order = np.argsort(cols["id"], kind="stable")
        return {name: arr[order] for name, arr in cols.items()}

    def requeue(self, snap: TableSnapshot) -> None:
        """Undo the reset of a snapshot that could not be saved: its rows and tombstones
        go into the next snapshot again."""
        with self.lock:
            slots = self._ram.index.find(snap.ids)
            self._ram.dirty[slots[slots >= 0]] = True
            if self._disk is not None:
                self._disk.mark_dirty(snap.ids)
            if snap.tombstones.shape[0]:
                self._tombstones.insert(0, snap.tombstones)

    def restore(self, snap: TableSnapshot, *,
                keep: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """Apply a snapshot: drop its tombstones, then load its rows and optimizer state.

        ``keep(ids) -> bool mask`` selects the ids to take (resharding). Restored rows count
        as clean: the next incremental snapshot holds changes made after the restore.
        """
        check_snapshot(self.config, snap)
        ids = np.ascontiguousarray(snap.ids, dtype=np.uint64)
        tomb = np.ascontiguousarray(snap.tombstones, dtype=np.uint64)
        sel = np.ones(ids.shape[0], dtype=bool) if keep is None else np.asarray(keep(ids), bool)
        if keep is not None and tomb.shape[0]:
            tomb = tomb[np.asarray(keep(tomb), dtype=bool)]
        pos = np.flatnonzero(sel)
        with self.lock:
            gone = self._ram.index.find(tomb)
            self._drop(gone[gone >= 0], None)
            self._drop_disk(np.unique(tomb), None)
            step = max(1, pos.shape[0] if self._disk is None else self.config.storage.ram_rows or 1)
            for i in range(0, pos.shape[0], step):  # a tiered table spills as it goes
                self._restore_rows(snap, ids, pos[i:i + step])
                self._spill()

    def _restore_rows(self, snap: TableSnapshot, all_ids: np.ndarray, pos: np.ndarray) -> None:
        """Load the snapshot's rows ``pos`` into RAM (created or overwritten), as clean rows."""
        ram, ids = self._ram, all_ids[pos]
        slots = ram.index.find(ids)
        self._promote(ids, slots)
        new = slots < 0
        if new.any():
            slots[new] = ram.add(ids[new])
        ram.rows[slots] = snap.rows[pos].astype(self._dtype)
        for key, arr in ram.state.items():
            arr[slots] = snap.state[key][pos]
        ram.dirty[slots] = False
        if ram.tracks_use:
            ram.last_used[slots] = self._clock()
            for key, arr, absent in (("tick", ram.ticks, self._tick), ("uses", ram.uses, 0)):
                arr[slots] = snap.meta[key][pos] if key in snap.meta else absent
            if slots.shape[0]:
                self._tick = max(self._tick, int(ram.ticks[slots].max()))

    def content_digest(self) -> str:
        """sha256 of every live id with its stored row and optimizer state (order-free)."""
        with self.lock:
            cols = self._all_rows(dirty_only=False)
            h = hashlib.sha256(cols["id"].tobytes())
            h.update(np.ascontiguousarray(cols["row"]).tobytes())
            for key in sorted(self._ram.state):
                h.update(key.encode() + np.ascontiguousarray(cols[f"state:{key}"]).tobytes())
            return h.hexdigest()
