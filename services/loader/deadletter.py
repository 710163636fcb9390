"""Malformed records: counted per reason, logged with their position, kept in a file.

The dead-letter file holds one JSON object per line: ``partition``, ``position``, ``reason``
and ``raw`` (the record's bytes as text, undecodable bytes escaped as ``\\xNN``). The file
never grows past ``max_bytes``: the records that would pass it are counted (``dropped``) and
not written. Logging is throttled: the first 20 records, then one in 1000.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from pathlib import Path

from services.loader.parsers import BadRecord

__all__ = ["DeadLetters"]

log = logging.getLogger("persimmon.loader.deadletter")

_LOG_FIRST = 20
_LOG_EVERY = 1000
MAX_BYTES = 64 << 20


class DeadLetters:
    """Malformed records' counts and, with a ``path``, their file of at most ``max_bytes``."""

    def __init__(self, path: str | None, max_bytes: int = MAX_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"dead_letter_max_bytes must be >= 1, got {max_bytes}")
        self.path = Path(path) if path else None
        self.max_bytes = max_bytes
        self.counts: Counter[str] = Counter()
        self.total = 0
        self.dropped = 0  # records not written: the file was full

    def _append(self, lines: list[str]) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as fh:
            room = self.max_bytes - fh.tell()
            data = [line.encode() for line in lines]
            kept = 0
            for line in data:
                if len(line) > room:
                    break
                room -= len(line)
                kept += 1
            fh.write(b"".join(data[:kept]))
        if kept < len(lines):
            if not self.dropped:
                log.warning("dead-letter file %s reached its limit of %d bytes "
                            "(dead_letter_max_bytes): further malformed records are counted, "
                            "not kept", self.path, self.max_bytes)
            self.dropped += len(lines) - kept

    async def write(self, partition: str, records: list[BadRecord]) -> None:
        """Count, log and (with a path) append ``records`` of ``partition``."""
        if not records:
            return
        for record in records:
            self.total += 1
            self.counts[record.reason] += 1
            if self.total <= _LOG_FIRST or self.total % _LOG_EVERY == 0:
                log.warning("malformed record #%d at %s position %d: %s", self.total, partition,
                            record.position, record.reason)
        if self.path is not None:
            lines = [json.dumps({"partition": partition, "position": r.position,
                                 "reason": r.reason,
                                 "raw": r.raw.decode("utf-8", "backslashreplace")}) + "\n"
                     for r in records]
            await asyncio.to_thread(self._append, lines)
