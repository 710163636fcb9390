"""A shard's durability: checkpoints, restores, and recovery from the write-ahead log.

:class:`Durable` is the part of :class:`services.ps.shard.Shard` that writes its tables and its
window of applied pushes to disk and brings them back. A checkpoint holds every table's lock
(taken in name order) while it writes, so it is a consistent cut; a restore swaps the tables
and the window in under the same locks, so a push comes wholly before it (rolled back) or
after it (validated again). With a write-ahead log, a checkpoint or a restore starts a new
segment, and :meth:`Durable.recover` replays the log over its base checkpoint, each push
through the window (a push the state already holds is not applied again).

**Epochs.** A shard's state has an epoch (1 for a fresh shard); each restore moves it past
every epoch the shard, the checkpoint or its checkpoint directory (``.epoch-shard-<k>-of-<n>``,
written before the swap) has known, so a restart from the same checkpoint still gets a new one.
Checkpoints and the log's segment headers hold it, so a recovered shard keeps it. A push carries
the epoch its client learned (Tables, Stats); one received for another epoch, or waiting for its
tables' locks while a restore moved the epoch on, is refused with :class:`StaleEpoch`
(FAILED_PRECONDITION, naming both) and nothing is applied. A push that carries no epoch (epoch
0: its client never learned one) counts as one of the first epoch: refused after any restore.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from services.common.admin_replies import CheckpointManifest, CheckpointSummary
from services.common.errors import FailedPrecondition, NotFound, StaleEpoch, Unavailable
from services.common.files import atomic_write
from services.ps.checkpoint import (
    check_checkpoint_id,
    list_checkpoints,
    read_checkpoint,
    read_epoch,
    read_push_window,
    write_checkpoint,
)
from services.ps.config import PSConfig
from services.ps.dedup import PushOrigin, PushWindow
from services.ps.store import EmbeddingTable, PushResult
from services.ps.tables import OptimizerConfig, TableConfig
from services.ps.wal import LoggedRecord, PushPart, WriteAheadLog
from services.ps.wal_records import CreateRecord, DropRecord, PushRecord

__all__ = ["Durable"]


class Durable:
    """Checkpoint, restore and recover the tables of a shard (mixed into ``Shard``)."""

    # What the shard owns and this part reads and swaps (set by Shard.__init__).
    config: PSConfig
    tables: dict[str, EmbeddingTable]
    pushes: PushWindow
    epoch: int
    wal: WriteAheadLog | None
    _locks: dict[str, threading.RLock]
    _layout: threading.Lock
    _ckpt_lock: asyncio.Lock
    _last_checkpoint: str | None

    if TYPE_CHECKING:  # what the shard provides
        def holding(self, names: Sequence[str]) -> contextlib.AbstractContextManager[bool]: ...
        def _once(self, origin: PushOrigin | None, content: Callable[[], int],
                  parts: Sequence[PushPart], fence: int | None) -> PushResult: ...
        def create_table(self, table_config: TableConfig | dict[str, Any]
                         ) -> EmbeddingTable: ...
        def drop_table(self, name: str) -> None: ...
        def set_optimizer(self, name: str, changes: dict[str, Any]) -> OptimizerConfig: ...

    def _checkpoint_root(self) -> Path:
        if not self.config.checkpoint_dir:
            raise FailedPrecondition("no checkpoint directory configured (--checkpoint-dir)")
        return Path(self.config.checkpoint_dir)

    async def checkpoint(self, checkpoint_id: str | None = None, *,
                         incremental: bool = False, epoch: int | None = None
                         ) -> CheckpointManifest:
        """Write all tables atomically; incremental checkpoints chain to the last one.
        ``epoch``: only while the shard is in that epoch (a job's cut names the epochs its
        pushes were in: a shard restored since holds none of them, StaleEpoch)."""
        root = self._checkpoint_root()
        checkpoint_id = checkpoint_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        check_checkpoint_id(checkpoint_id)
        async with self._ckpt_lock:
            if incremental and self._last_checkpoint is None:
                raise FailedPrecondition("an incremental checkpoint needs an earlier checkpoint "
                                         "of this process as its parent")
            parent = self._last_checkpoint if incremental else None
            manifest = await asyncio.to_thread(self._write_checkpoint, root, checkpoint_id,
                                               incremental, parent, epoch)
            self._last_checkpoint = checkpoint_id
        return manifest

    def _write_checkpoint(self, root: Path, checkpoint_id: str, incremental: bool,
                          parent: str | None, epoch: int | None) -> CheckpointManifest:
        with self._layout, self.holding(list(self.tables)):
            self.check_epoch(epoch, "checkpoint")  # a restore holds the same locks
            manifest = write_checkpoint(root, checkpoint_id, self.config.shard_id,
                                        self.config.num_shards, self.tables,
                                        incremental=incremental, parent=parent,
                                        pushes=self.pushes.snapshot(), epoch=self.epoch)
            if self.wal is not None:  # the log restarts from this state
                try:
                    self.wal.start(checkpoint_id, self.epoch)
                except OSError as exc:  # e.g. its disk full: the log goes on where it was
                    raise Unavailable(
                        f"shard {self.config.shard_id} wrote checkpoint {checkpoint_id} but "
                        f"its write-ahead log cannot start a segment after it ({exc}); ask "
                        "again once the log's disk has room (the part counts as written)"
                    ) from exc
            return manifest

    def checkpoints(self) -> list[CheckpointSummary]:
        if not self.config.checkpoint_dir:
            return []
        return list_checkpoints(self._checkpoint_root())

    async def restore(self, checkpoint_id: str) -> dict[str, int]:
        """Replace every table and the window of applied pushes by the checkpoint's
        (resharding when the shard count differs; the window then starts empty, as the
        clients' sequence numbers were per old shard) in a new epoch; the write-ahead log
        restarts from it (the pushes it held after its base are dropped: a rollback)."""
        await self._restore(checkpoint_id, restart_log=True)
        return {name: table.num_rows for name, table in self.tables.items()}

    def check_epoch(self, epoch: int | None, what: str = "push") -> None:
        """Refuse a ``what`` (push, checkpoint) of ``epoch`` unless it is this shard's (None:
        not fenced). Called under the tables' locks, which a restore takes all of to move the
        epoch. Epoch 0 (a push that carries none: its client never learned one) is taken for
        the first epoch, so it is refused once a restore moved the shard past it."""
        if epoch == 0 and self.epoch != 1:
            raise StaleEpoch(
                f"{what} that carries no epoch refused by shard {self.config.shard_id}, now in "
                f"epoch {self.epoch}: a client that never learned the shard's epoch may push "
                "only until its first restore; nothing applied (reconnect or re-sync the "
                "client, e.g. PSClient.resync(), to learn the epoch)")
        if epoch and epoch != self.epoch:
            when = "before" if epoch < self.epoch else "after"
            raise StaleEpoch(
                f"{what} of epoch {epoch} refused by shard {self.config.shard_id}, now in epoch "
                f"{self.epoch}: it was sent {when} the shard's last restore; nothing "
                f"{'written' if what == 'checkpoint' else 'applied'} (re-sync the client with "
                "PSClient.resync(), or restart the job from its checkpoint)")

    def start_log(self) -> None:
        """Begin the write-ahead log afresh from the shard's configured (empty) tables."""
        if self.wal is not None:
            self.wal.start(None, self.epoch)

    def _epoch_file(self) -> Path:
        cfg = self.config
        return self._checkpoint_root() / f".epoch-shard-{cfg.shard_id}-of-{cfg.num_shards}"

    def _next_epoch(self, checkpoint_epoch: int) -> int:
        """An epoch past every one this shard may have served: written durably first."""
        path = self._epoch_file()
        try:
            stored = int(path.read_text()) if path.exists() else 0
        except (OSError, ValueError) as exc:
            raise FailedPrecondition(f"the shard's epoch file {path} is unreadable ({exc}); "
                                     "write the highest epoch it served into it") from exc
        epoch = max(self.epoch, checkpoint_epoch, stored) + 1
        atomic_write(path, str(epoch).encode())
        return epoch

    async def recover(self) -> dict[str, int]:
        """Come back from the write-ahead log: restore its base checkpoint (none: the
        configured tables), then apply its records in order, each push through the window
        of applied pushes; go on appending to it. Returns counts: ``pushes`` applied,
        ``skipped`` (already held), ``changes`` (table changes), ``dropped_bytes`` (a torn
        tail)."""
        if self.wal is None:
            raise FailedPrecondition("no write-ahead log configured (--wal-dir)")
        wal = self.wal
        base, records = await asyncio.to_thread(wal.read)
        if base is not None:
            await self._restore(base, restart_log=False)
        self.wal = None  # the records replayed are in the log already
        try:
            counts = await asyncio.to_thread(self._replay, records)  # streamed
        finally:
            self.wal = wal
        if wal.segments():
            self.epoch = max(wal.epoch, 1)
            await asyncio.to_thread(wal.resume)
        else:
            await asyncio.to_thread(wal.start, None, self.epoch)
        return {**counts, "dropped_bytes": wal.dropped_bytes}

    def _replay(self, records: Iterable[LoggedRecord]) -> dict[str, int]:
        counts = {"pushes": 0, "skipped": 0, "changes": 0}
        for record in records:
            if isinstance(record, PushRecord):
                counts["pushes" if self._replay_push(record) else "skipped"] += 1
                continue
            if isinstance(record, CreateRecord):
                self.create_table(msgspec.to_builtins(record.config))
            elif isinstance(record, DropRecord):
                self.drop_table(record.table)
            else:
                self.set_optimizer(record.table, record.changes)
            counts["changes"] += 1
        return counts

    def _replay_push(self, record: PushRecord) -> bool:
        """Apply a logged push unless the window says it is held already (False)."""
        origin, fp, parts = record.origin, record.fp, record.arrays()
        retries = self.pushes.retries
        try:
            with self.holding([name for name, _, _ in parts]):
                self._once(None if origin is None else PushOrigin(*origin), lambda: fp, parts,
                           None)
        except FailedPrecondition:  # below the window: older than pushes the state holds
            return False
        return self.pushes.retries == retries

    async def _restore(self, checkpoint_id: str, *, restart_log: bool) -> None:
        """Swap in the checkpoint's state; ``restart_log``: a restore (a new epoch, the log
        restarts from it), else a recovery's base (the log's epoch, set after)."""
        root = self._checkpoint_root()
        if checkpoint_id == "latest":
            known = self.checkpoints()
            if not known:
                raise NotFound(f"no checkpoints under {root}")
            checkpoint_id = known[-1].checkpoint_id
        check_checkpoint_id(checkpoint_id)
        async with self._ckpt_lock:
            snapshots = await asyncio.to_thread(
                read_checkpoint, root, checkpoint_id,
                shard_id=self.config.shard_id, num_shards=self.config.num_shards)
            pushes = PushWindow(self.pushes.window, self.pushes.max_clients)
            pushes.restore(await asyncio.to_thread(
                read_push_window, root, checkpoint_id,
                shard_id=self.config.shard_id, num_shards=self.config.num_shards))
            fresh: dict[str, EmbeddingTable] = {}
            for name, chain in snapshots.items():
                table = EmbeddingTable(chain[0].config)
                for snap in chain:
                    table.restore(snap)
                fresh[name] = table
            epoch = self.epoch
            if restart_log:
                epoch = await asyncio.to_thread(self._next_epoch, await asyncio.to_thread(
                    read_epoch, root, checkpoint_id))
            await asyncio.to_thread(self._replace, fresh, pushes,
                                    checkpoint_id if restart_log else None, epoch)
            self._last_checkpoint = checkpoint_id

    def _replace(self, tables: dict[str, EmbeddingTable], pushes: PushWindow,
                 base: str | None, epoch: int) -> None:
        """Swap in restored ``tables``, window and ``epoch`` holding every table's lock, so
        that no push comes between (one that waited is refused for its old epoch); the log
        restarts from checkpoint ``base`` first (None: goes on)."""
        with self._layout, self.holding(list(self._locks)):
            if base is not None and self.wal is not None:
                self.wal.start(base, epoch)
            self.epoch = epoch
            self.pushes = pushes  # before the tables: a push that sees them uses it
            self._locks = {name: self._locks.get(name) or threading.RLock() for name in tables}
            self.tables = tables
