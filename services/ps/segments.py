"""The files of a PS shard's write-ahead log: how a record is framed, written and read back.

A record is ``u32 length | u32 CRC-32 of the length | u32 CRC-32 of the length and the
payload | payload`` (a typed record, :mod:`services.ps.wal_records`), little-endian: format 2.
Format 1 (``u32 length | u32 CRC-32 of the payload``: a flipped length bit went unseen) is
refused by name; recover such a log with the release that wrote it and take a checkpoint.

:class:`SegmentRecords` streams one segment record by record (never the whole file). Its
end is judged by one rule:

- **torn tail** (a crash or a failed write in the middle of the last append; nothing after
  it was ever acknowledged, as a failed append stops the log until it is cut back): in the
  newest segment only, a frame header cut short, a record whose length checks out but runs
  past the end of the file, a last record that ends at the end of the file but fails its
  CRC, or zeros from the record to the end. It is cut off the file (``dropped``).
- **corruption**, anything else: a length whose own CRC fails (a bit flip: its length
  cannot be trusted, so what follows cannot be found), a record failing its CRC with more
  bytes after it, a record that passes its CRC but is not a well-formed record (naming its
  field), any bad record in an older segment. A :class:`FailedPrecondition` naming the file
  and the byte offset; nothing is cut. So is a record of another version (its field ``v``).
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from services.common.errors import FailedPrecondition, MalformedMessage
from services.ps.wal_records import AnyRecord, WalRecord, decode_record, encode_record_into

__all__ = ["FORMAT", "OsSegmentFile", "SegmentFile", "SegmentOpener", "SegmentRecords", "frame"]

log = logging.getLogger("persimmon.ps.wal")

FORMAT = 2
_FRAME = struct.Struct("<III")  # length, CRC-32 of the length, CRC-32 of length + payload
_LENGTH = struct.Struct("<I")
_FRAME_V1 = struct.Struct("<II")  # length, CRC-32 of the payload
_CHUNK = 1 << 20


class SegmentFile(Protocol):
    """A segment opened for appending (what the log writes through; tests wrap it)."""

    def write(self, data: memoryview) -> int: ...  # may write fewer bytes than given
    def fsync(self) -> None: ...
    def truncate(self, size: int) -> None: ...
    def close(self) -> None: ...


SegmentOpener = Callable[[Path], SegmentFile]


class OsSegmentFile:
    """A segment file opened ``O_APPEND``: every write lands at the end, in one system call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND)

    def write(self, data: memoryview) -> int:
        return os.write(self.fd, data)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)

    def close(self) -> None:
        os.close(self.fd)


def frame(record: WalRecord) -> bytearray:
    """``record`` framed as the log stores it (encoded in place after the frame's head)."""
    data = bytearray(_FRAME.size)
    encode_record_into(record, data, _FRAME.size)
    size = len(data) - _FRAME.size
    head = zlib.crc32(_LENGTH.pack(size))
    _FRAME.pack_into(data, 0, size, head, zlib.crc32(memoryview(data)[_FRAME.size:], head))
    return data


class SegmentRecords:
    """The records of segment ``path``, streamed (the header first). ``last``: the newest
    segment, where a torn tail is cut off (``dropped`` bytes) instead of being corruption.
    ``end``: the byte after the last good record once the records are read."""

    def __init__(self, path: Path, *, last: bool) -> None:
        self.path = path
        self.last = last
        self.dropped = 0
        self.end = 0

    def __iter__(self) -> Iterator[AnyRecord]:
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            offset = 0
            while offset < size:
                record, stop = self._next(f, offset, size)
                if record is None:
                    self._cut(offset, size)
                    return
                offset = self.end = stop
                yield record

    def _next(self, f: BinaryIO, offset: int, size: int) -> tuple[AnyRecord | None, int]:
        """The record at ``offset`` and where it stops; None: a torn tail starts there."""
        head = f.read(_FRAME.size)
        if len(head) < _FRAME.size:
            self._torn(offset, "a record header cut short")
            return None, offset
        length, length_crc, crc = _FRAME.unpack(head)
        if zlib.crc32(head[:4]) != length_crc:
            if self._zeros(f, offset, size):
                self._torn(offset, "zeros to the end")
                return None, offset
            if offset == 0:
                self._check_v1(f)
            raise self._corrupt(offset, size, "its length fails its CRC")
        stop = offset + _FRAME.size + length
        if stop > size:
            self._torn(offset, "a record cut short")
            return None, offset
        payload = f.read(length)
        if zlib.crc32(payload, length_crc) != crc:
            if stop == size or self._zeros(f, offset, size):
                self._torn(offset, "a last record failing its CRC")
                return None, offset
            raise self._corrupt(offset, size, "it fails its CRC and more records follow")
        try:
            return decode_record(payload), stop
        except MalformedMessage as exc:
            raise self._corrupt(offset, size, f"it passes its CRC but is not a well-formed "
                                              f"record: {exc.message}") from exc
        except FailedPrecondition as exc:  # another version: not applied, not cut
            raise FailedPrecondition(f"WAL segment {self.path}, the record at byte {offset}: "
                                     f"{exc.message}") from exc

    def _torn(self, offset: int, what: str) -> None:
        if not self.last:
            raise FailedPrecondition(
                f"WAL segment {self.path} is corrupt at byte {offset}: {what}, in a segment "
                "that later segments follow; move the log aside to start without it")

    def _corrupt(self, offset: int, size: int, why: str) -> FailedPrecondition:
        return FailedPrecondition(
            f"WAL segment {self.path} is corrupt at byte {offset} of {size}: {why} (not a "
            "torn tail: records after it would be lost); move the log aside to start "
            "without it")

    @staticmethod
    def _zeros(f: BinaryIO, offset: int, size: int) -> bool:
        f.seek(offset)
        while chunk := f.read(_CHUNK):
            if any(chunk):
                return False
        return True

    def _check_v1(self, f: BinaryIO) -> None:
        """A format-1 segment is refused by name (not called corrupt)."""
        f.seek(0)
        head = f.read(_FRAME_V1.size)
        if len(head) == _FRAME_V1.size:
            length, crc = _FRAME_V1.unpack(head)
            payload = f.read(min(length, _CHUNK))
            if len(payload) == length and zlib.crc32(payload) == crc:
                raise FailedPrecondition(
                    f"WAL segment {self.path} is format 1 (an older Persimmon); this one "
                    f"reads format {FORMAT}: recover it with the release that wrote it and "
                    "take a checkpoint, or move it aside")

    def _cut(self, offset: int, size: int) -> None:
        self.dropped = size - offset
        self.end = offset
        log.warning("WAL %s: dropped a torn tail of %d bytes at byte %d (an append cut short "
                    "by a crash or a write error; never acknowledged)", self.path,
                    self.dropped, offset)
        os.truncate(self.path, offset)
