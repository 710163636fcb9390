"""A PS shard's write-ahead log: the pushes (and table changes) since its last checkpoint.

Layout: ``<wal_dir>/shard-<k>-of-<n>/<serial>.wal``, one segment per checkpoint interval.
A segment starts with a header record naming its *base*, the checkpoint whose state its
records follow (None: the shard's configured tables, empty); then one record per push the
shard applied, in the order it applied them per table. A record is ``u32 length | u32
CRC-32 of the payload | payload`` (a msgpack map, :mod:`services.common.wire`).

- **Append before ack.** The shard appends a push (tables, ids, gradients, its origin
  ``(client, seq)`` and fingerprint, :mod:`services.ps.dedup`) after validating it and
  before applying it, under the pushed tables' locks, with one ``write`` to the file: once
  a push is acknowledged its record is in the operating system's hands, so a killed shard
  process (SIGKILL, OOM) never loses an acknowledged push. What survives a *machine* crash
  (power, kernel) is the fsync policy's promise (:class:`WalFsync`).
- **Rotation.** A checkpoint starts a new segment based on it, under the same table locks
  as it took the rows, then deletes the older segments: a segment holds exactly the pushes
  its base lacks. A restore of a checkpoint does the same (the log then follows it).
- **Recovery** (:meth:`WriteAheadLog.read`): the newest segment's base and records. A torn
  tail (a record cut short, or the file's last record failing its CRC, or zeros to the end:
  a crash mid-write) is dropped and cut off the file, with a warning (never acknowledged,
  unless a machine crash took writes the policy had not synced yet). A bad record followed by more data, or a bad header, is corruption: a
  :class:`FailedPrecondition` that names the file.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from services.common.codecs import decode_array, raw_array
from services.common.errors import ConfigError, FailedPrecondition, PersimmonError
from services.common.files import fsync_dir
from services.common.wire import decode_message, encode_message

__all__ = ["PushPart", "WalFsync", "WriteAheadLog", "push_record", "read_push"]

PushPart = tuple[str, np.ndarray, np.ndarray]  # table, ids, float32 grads (one row per id)

log = logging.getLogger("persimmon.ps.wal")

FORMAT = 1
_FRAME = struct.Struct("<II")  # payload length, CRC-32 of the payload
_SUFFIX = ".wal"


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

    Call :meth:`read` then :meth:`resume` to go on after the last segment, or :meth:`start`
    to begin a new one; :meth:`append` takes records from any thread; :meth:`close` syncs.
    """

    def __init__(self, root: Path | str, *, shard_id: int, num_shards: int,
                 fsync: WalFsync = WalFsync.BATCH, fsync_interval_s: float = 0.1) -> None:
        if fsync_interval_s <= 0:
            raise ConfigError(f"the WAL's fsync interval must be > 0 s, got {fsync_interval_s}")
        self.directory = Path(root) / f"shard-{shard_id}-of-{num_shards}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"wal_dir {root}: cannot create {self.directory}: {exc}") from exc
        if not os.access(self.directory, os.W_OK):
            raise ConfigError(f"wal_dir {root}: {self.directory} is not writable")
        self.fsync = WalFsync(fsync)
        self.fsync_interval_s = fsync_interval_s
        self.base: str | None = None  # the checkpoint the current segment follows
        self.dropped_bytes = 0  # of a torn tail cut off by read()
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._dirty = False
        self._read: tuple[Path, str | None] | None = None  # the segment read() read
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None

    # ---- segments -----------------------------------------------------------------------

    def _segments(self) -> list[Path]:
        return sorted(p for p in self.directory.iterdir()
                      if p.suffix == _SUFFIX and p.stem.isdigit())

    def read(self) -> tuple[str | None, list[dict[str, Any]]]:
        """The newest segment's base and records (none: ``(None, [])``); a torn tail is cut
        off the file (``dropped_bytes``)."""
        self._read = None
        segments = self._segments()
        if not segments:
            return None, []
        path = segments[-1]
        data = path.read_bytes()
        bodies, good = _split(data, path)
        if good < len(data):
            self.dropped_bytes = len(data) - good
            log.warning("WAL %s: dropped a torn tail of %d bytes (a crash mid-write; never "
                        "acknowledged)", path, self.dropped_bytes)
            os.truncate(path, good)
        if not bodies:
            raise FailedPrecondition(f"WAL segment {path} has no header; move it aside")
        header, *records = bodies
        if header.get("op") != "header" or header.get("format") != FORMAT:
            raise FailedPrecondition(f"WAL segment {path} has an unknown header {header}")
        self._read = (path, header.get("base"))
        return header.get("base"), records

    def resume(self) -> None:
        """Go on appending to the segment :meth:`read` read."""
        if self._read is None:
            raise FailedPrecondition(f"no WAL segment read under {self.directory} to resume")
        self._open(*self._read)

    def start(self, base: str | None) -> None:
        """Begin a new segment following checkpoint ``base`` (durably), then delete the older
        ones: the log restarts from that state."""
        old = self._segments()
        serial = int(old[-1].stem) + 1 if old else 1
        path = self.directory / f"{serial:012d}{_SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        try:
            _write(fd, _frame({"op": "header", "format": FORMAT, "base": base}))
            os.fsync(fd)
        except BaseException:  # no headless newest segment: the current one goes on
            path.unlink()
            raise
        finally:
            os.close(fd)
        fsync_dir(self.directory)
        self._open(path, base)
        for p in old:
            p.unlink()
        if old:
            fsync_dir(self.directory)

    def _open(self, path: Path, base: str | None) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
            self._fd, self.base = fd, base
            self._dirty = False
        if self.fsync is WalFsync.BATCH and self._syncer is None:
            self._syncer = threading.Thread(target=self._sync_loop, name="wal-sync", daemon=True)
            self._syncer.start()

    # ---- appending ----------------------------------------------------------------------

    def append(self, record: dict[str, Any]) -> None:
        """Write ``record`` (a map of msgpack values and arrays) to the log before returning;
        fsync it first under the ``always`` policy."""
        frame = _frame(record)
        with self._lock:
            if self._fd is None:
                raise FailedPrecondition("the write-ahead log is not open (read and resume it, "
                                         "or start a segment, first)")
            _write(self._fd, frame)
            if self.fsync is WalFsync.ALWAYS:
                os.fsync(self._fd)
            else:
                self._dirty = True

    def sync(self) -> None:
        """fsync what was appended since the last sync."""
        with self._lock:
            fd, dirty, self._dirty = self._fd, self._dirty, False
        if fd is not None and dirty:
            try:
                os.fsync(fd)
            except OSError:  # closed by a rotation meanwhile: that segment was synced then
                pass

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.fsync_interval_s):
            self.sync()

    def close(self) -> None:
        """Stop the background syncs, sync and close the segment."""
        self._stop.set()
        if self._syncer is not None:
            self._syncer.join()
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            if self.fsync is not WalFsync.NEVER:
                os.fsync(fd)
            os.close(fd)


def push_record(origin: tuple[int, int] | None, fp: int,
                parts: Sequence[PushPart]) -> dict[str, Any]:
    """The record of a push: its origin (None: an in-process push without one), its
    fingerprint and what it applies to each table."""
    return {"op": "push", "origin": None if origin is None else list(origin), "fp": fp,
            "parts": [[name, raw_array(ids), raw_array(grads)] for name, ids, grads in parts]}


def read_push(record: dict[str, Any]) -> tuple[tuple[int, int] | None, int, list[PushPart]]:
    """``(origin, fingerprint, parts)`` of a :func:`push_record`."""
    origin = record["origin"]
    return (None if origin is None else (origin[0], origin[1]), record["fp"],
            [(name, decode_array(ids, "wal ids"), decode_array(grads, "wal grads"))
             for name, ids, grads in record["parts"]])


def _frame(record: dict[str, Any]) -> bytes:
    payload = encode_message(record)
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _split(data: bytes, path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a segment's bytes and the length of their good prefix: a bad record
    at the end (short, failing its CRC, or zeros to the end) is a torn tail; one followed by
    more data is corruption."""
    bodies: list[dict[str, Any]] = []
    offset = 0
    while offset < len(data):
        end = offset + _FRAME.size
        length, crc = _FRAME.unpack_from(data, offset) if end <= len(data) else (0, 0)
        stop = end + length
        ok = length > 0 and stop <= len(data) and zlib.crc32(data[end:stop]) == crc
        if not ok:
            if stop >= len(data) or not any(data[offset:]):
                return bodies, offset
            raise FailedPrecondition(
                f"WAL segment {path} is corrupt at byte {offset} of {len(data)} (a bad record "
                "followed by more records: not a torn tail); move it aside to start without it")
        try:
            bodies.append(decode_message(data[end:stop]))
        except PersimmonError as exc:
            raise FailedPrecondition(f"WAL segment {path}: record at byte {offset} passes its "
                                     f"CRC but does not decode: {exc}") from exc
        offset = stop
    return bodies, offset
