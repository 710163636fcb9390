"""Malformed records: counted per reason, logged with their position, kept in a file.

The dead-letter file holds one JSON object per line: ``partition``, ``position``, ``reason``
and ``raw`` (the record's bytes as text, undecodable bytes escaped as ``\\xNN``). Logging is
throttled: the first 20 records, then one in 1000.
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


class DeadLetters:
    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self.counts: Counter[str] = Counter()
        self.total = 0

    def _append(self, lines: list[str]) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write("".join(lines))

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
