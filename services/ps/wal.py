"""A PS shard's write-ahead log: the pushes (and table changes) since its last checkpoint.

Layout: ``<wal_dir>/shard-<k>-of-<n>/<serial>.wal``, segments in serial order. A segment
starts with a header record: the format, the shard's *epoch* (see :mod:`services.ps.durability`),
and its *base*, the checkpoint whose state the records follow (None: the shard's configured
tables, empty), or ``rotated``: it goes on from the segment before it. Then one record per
push the shard applied, in the order it applied them per table, and per table change. Records
are typed and versioned (:mod:`services.ps.wal_records`), framed and read as
:mod:`services.ps.segments` says (a CRC over length and payload).

- **Append before ack.** The shard appends a push (tables, ids, gradients, its origin
  ``(client, seq, epoch)`` and fingerprint, :mod:`services.ps.dedup`) after validating it and
  before applying it, under the pushed tables' locks, with one ``write`` to the file: once
  a push is acknowledged its record is in the operating system's hands, so a killed shard
  process (SIGKILL, OOM) never loses an acknowledged push. What survives a *machine* crash
  (power, kernel) is the fsync policy's promise (:class:`WalFsync`).
- **Fail stop.** A write or fsync error (disk full, I/O error; also a failed background
  fsync under ``batch``) stops the log: that append raises :class:`Unavailable` (its push is
  not applied, nor acknowledged), and so does every later one until the log is cut back to
  its last good record and synced, which the next append tries first. A half-written record
  never stays in front of later ones.
- **Rotation.** A segment past ``segment_bytes`` is followed by a new (rotated) one. A
  checkpoint starts a new segment based on it, under the same table locks as it took the
  rows, then deletes the older segments: the segments from the newest base on hold exactly
  the pushes their base lacks. A restore of a checkpoint does the same.
- **Recovery** (:meth:`WriteAheadLog.read`): the newest base segment's base, then its
  records and every later segment's, streamed. A torn tail of the newest segment is cut off;
  anything else bad is a :class:`FailedPrecondition` naming the file and offset.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from pathlib import Path

from services.common.errors import ConfigError, FailedPrecondition, Unavailable
from services.common.files import fsync_dir
from services.ps.segments import (
    FORMAT,
    OsSegmentFile,
    SegmentFile,
    SegmentOpener,
    SegmentRecords,
    frame,
)
from services.ps.wal_records import (
    AnyRecord,
    CreateRecord,
    DropRecord,
    OptimizerRecord,
    PushPart,
    PushRecord,
    SegmentHeader,
    WalRecord,
)

__all__ = ["LoggedRecord", "PushPart", "WalFsync", "WriteAheadLog"]

#: what a segment holds after its header
LoggedRecord = PushRecord | CreateRecord | DropRecord | OptimizerRecord

log = logging.getLogger("persimmon.ps.wal")

_SUFFIX = ".wal"
DEFAULT_SEGMENT_BYTES = 64 << 20


class WalFsync(StrEnum):
    """When the log is fsynced. Every policy writes a record before its push is acked.

    - ``always``: fsync before each ack: an acked push survives a machine crash.
    - ``batch``: fsync every ``fsync_interval_s`` by a background thread: a machine crash
      loses at most the pushes acked in the last interval (a process crash: none).
    - ``never``: no fsync (the OS writes back when it likes): a process crash loses
      nothing, a machine crash may lose any push since the last checkpoint.
    """

    ALWAYS = "always"
    BATCH = "batch"
    NEVER = "never"


class WriteAheadLog:
    """The log of shard ``shard_id`` of ``num_shards`` under ``root`` (see the module).

    Call :meth:`read` (and consume its records) then :meth:`resume` to go on after the last
    segment, or :meth:`start` to begin from a checkpoint; :meth:`append` takes records from
    any thread; :meth:`close` syncs. ``open_file`` opens a segment for appending.
    """

    def __init__(self, root: Path | str, *, shard_id: int, num_shards: int,
                 fsync: WalFsync = WalFsync.BATCH, fsync_interval_s: float = 0.1,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 open_file: SegmentOpener = OsSegmentFile) -> None:
        if fsync_interval_s <= 0:
            raise ConfigError(f"the WAL's fsync interval must be > 0 s, got {fsync_interval_s}")
        if segment_bytes < 4096:
            raise ConfigError(f"the WAL's segment size must be >= 4096 bytes, got {segment_bytes}")
        self.directory = Path(root) / f"shard-{shard_id}-of-{num_shards}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"wal_dir {root}: cannot create {self.directory}: {exc}") from exc
        if not os.access(self.directory, os.W_OK):
            raise ConfigError(f"wal_dir {root}: {self.directory} is not writable")
        self.fsync = WalFsync(fsync)
        self.fsync_interval_s = fsync_interval_s
        self.segment_bytes = segment_bytes
        self.base: str | None = None  # the checkpoint the current segments follow
        self.epoch = 0  # the shard's epoch the current segments were written in
        self.dropped_bytes = 0  # of a torn tail cut off by read()
        self._open_file = open_file
        self._lock = threading.Lock()  # the current file, its size, the failure
        self._sync_lock = threading.Lock()  # an fsync outside _lock against a close
        self._file: SegmentFile | None = None
        self._path: Path | None = None
        self._size = 0  # bytes of good records in the current segment
        self._failed: OSError | None = None  # stops appends until cut back and synced
        self._dirty = False
        self._head = 0  # bytes of the current segment's header
        self._read: tuple[Path, str | None, int] | None = None  # what read() found
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None

    # ---- segments -----------------------------------------------------------------------

    def segments(self) -> list[Path]:
        """The segment files, oldest first."""
        return sorted(p for p in self.directory.iterdir()
                      if p.suffix == _SUFFIX and p.stem.isdigit())

    def read(self) -> tuple[str | None, Iterator[LoggedRecord]]:
        """The log's base checkpoint and its records, streamed from the newest base segment
        through every later one (none: ``(None, no records)``); sets ``epoch``; a torn tail
        is cut off the newest segment (``dropped_bytes``) as the records are read."""
        self._read, self.dropped_bytes = None, 0
        segments = self.segments()
        if not segments:
            return None, iter(())
        heads = [(path, _header(path)) for path in segments]
        start = max((i for i, (_, head) in enumerate(heads) if not head.rotated), default=None)
        if start is None:
            raise FailedPrecondition(f"WAL {self.directory} has no base segment (only rotated "
                                     "ones); move it aside")
        head = heads[start][1]
        self.epoch = head.epoch
        self._read = (segments[-1], head.base, self.epoch)
        return head.base, self._records(segments[start:])

    def _records(self, paths: Sequence[Path]) -> Iterator[LoggedRecord]:
        for path in paths:
            reader = SegmentRecords(path, last=path == paths[-1])
            records = iter(reader)
            next(records, None)  # the header, read already
            for record in records:
                if isinstance(record, SegmentHeader):
                    raise FailedPrecondition(f"WAL segment {path} holds a second header after "
                                             "its first record; move the log aside")
                yield record
            self.dropped_bytes += reader.dropped

    def resume(self) -> None:
        """Go on appending to the newest segment :meth:`read` read (its records consumed)."""
        if self._read is None:
            raise FailedPrecondition(f"no WAL segment read under {self.directory} to resume")
        self._open(*self._read)

    def start(self, base: str | None, epoch: int = 0) -> None:
        """Begin a new segment following checkpoint ``base`` in ``epoch`` (durably), then
        delete the older ones: the log restarts from that state."""
        old = self.segments()
        path = self._new_segment(SegmentHeader.of(FORMAT, base, epoch), old)
        self._open(path, base, epoch)
        for p in old:
            p.unlink()
        if old:
            fsync_dir(self.directory)

    def _new_segment(self, header: SegmentHeader, old: list[Path]) -> Path:
        """A new newest segment holding ``header``, written and synced under a temporary name
        and then renamed: a segment file never lacks its header."""
        serial = int(old[-1].stem) + 1 if old else 1
        path = self.directory / f"{serial:012d}{_SUFFIX}"
        tmp = self.directory / f".{serial:012d}{_SUFFIX}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(functools.partial(os.write, fd), frame(header))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.directory)
        return path

    def _open(self, path: Path, base: str | None, epoch: int) -> None:
        file, head = self._open_file(path), _header_size(path)
        with self._lock:
            self._swap(file, path, path.stat().st_size, head)
            self.base, self.epoch = base, epoch
            self._failed = None
        if self.fsync is WalFsync.BATCH and self._syncer is None:
            self._syncer = threading.Thread(target=self._sync_loop, name="wal-sync", daemon=True)
            self._syncer.start()

    def _swap(self, file: SegmentFile | None, path: Path | None, size: int, head: int) -> None:
        """Make ``file`` the current segment (under ``_lock``), closing the old one."""
        with self._sync_lock:
            old, self._file, self._path, self._size = self._file, file, path, size
            self._head = head
            self._dirty = False
            if old is not None:
                old.close()

    # ---- appending ----------------------------------------------------------------------

    def append(self, record: WalRecord) -> None:
        """Write ``record`` to the log before returning; fsync it first under the ``always``
        policy. :class:`Unavailable` when the log has
        failed (this or an earlier write or fsync) and cannot be cut back yet."""
        if not isinstance(record, WalRecord):  # a map would be written, then never read
            raise TypeError(f"the log takes typed records, got {type(record).__name__}")
        data = frame(record)
        with self._lock:
            file = self._writable()
            if self._size + len(data) > self.segment_bytes and self._size > self._head:
                file = self._rotate()
            try:
                _write_all(file.write, data)
                if self.fsync is WalFsync.ALWAYS:
                    file.fsync()
            except OSError as exc:
                raise self._fail(exc, "an append") from exc
            self._size += len(data)
            self._dirty = self.fsync is WalFsync.BATCH

    def _writable(self) -> SegmentFile:
        """The current segment, cut back to its last good record first after a failure."""
        if self._file is None:
            raise FailedPrecondition("the write-ahead log is not open (read and resume it, "
                                     "or start a segment, first)")
        if self._failed is not None:
            try:
                self._file.truncate(self._size)
                self._file.fsync()
            except OSError as exc:
                raise self._fail(exc, "cutting the log back after an earlier failure") from exc
            log.warning("WAL %s: cut back to its last good record (%d bytes) after %s; "
                        "appending again", self._path, self._size, self._failed)
            self._failed = None
        return self._file

    def _rotate(self) -> SegmentFile:
        try:
            assert self._file is not None
            self._file.fsync()  # the records a rotated-away segment holds are durable
            path = self._new_segment(SegmentHeader.of(FORMAT, self.base, self.epoch,
                                                      rotated=True), self.segments())
            file = self._open_file(path)
        except OSError as exc:
            raise self._fail(exc, "a rotation to a new segment") from exc
        size = path.stat().st_size
        self._swap(file, path, size, size)
        return file

    def _fail(self, exc: OSError, what: str) -> Unavailable:
        self._failed = exc
        log.error("WAL %s: %s failed (%s); no push is taken until the log is cut back to its "
                  "last good record", self._path, what, exc)
        return Unavailable(f"write-ahead log {self._path}: {what} failed ({exc}); the push is "
                           "not applied, and the shard takes no push until the log is cut back "
                           "to its last good record (tried on the next push)")

    @property
    def failed(self) -> str | None:
        """Why the log refuses appends now (None: it takes them)."""
        with self._lock:
            return None if self._failed is None else str(self._failed)

    def sync(self) -> None:
        """fsync what was appended since the last sync; a failure stops the log (the next
        append cuts it back and syncs again before it takes a record)."""
        with self._lock:
            file, dirty, self._dirty = self._file, self._dirty, False
        if file is None or not dirty:
            return
        with self._sync_lock:
            if file is not self._file:  # rotated or closed meanwhile: synced then
                return
            try:
                file.fsync()
                return
            except OSError as exc:
                error = exc
        with self._lock:
            if file is self._file and self._failed is None:
                self._fail(error, "a background fsync")

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.fsync_interval_s):
            self.sync()

    def close(self) -> None:
        """Stop the background syncs, sync and close the segment."""
        self._stop.set()
        if self._syncer is not None:
            self._syncer.join()
        with self._lock:
            file = self._file
            try:
                if file is not None and self.fsync is not WalFsync.NEVER:
                    file.fsync()
            except OSError as exc:
                log.error("WAL %s: the last fsync failed: %s", self._path, exc)
            finally:
                self._swap(None, None, 0, 0)


def _header(path: Path) -> SegmentHeader:
    header: AnyRecord | None = next(iter(SegmentRecords(path, last=False)), None)
    if not isinstance(header, SegmentHeader) or header.format != FORMAT:
        got = (f"format {header.format}" if isinstance(header, SegmentHeader) else
               "no record" if header is None else f"a {type(header).__name__}")
        raise FailedPrecondition(f"WAL segment {path} has no header of format {FORMAT}, got "
                                 f"{got}; move it aside")
    return header


def _header_size(path: Path) -> int:
    reader = SegmentRecords(path, last=False)
    next(iter(reader), None)
    return reader.end


def _write_all(write: Callable[[memoryview], int], data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[write(view):]
