"""The dead-letter file never grows past its cap: records past it are counted, not kept."""

from __future__ import annotations

import json

import pytest

from services.loader.config import LoaderConfig
from services.loader.deadletter import DeadLetters
from services.loader.parsers import BadRecord


def _records(n: int, start: int = 0) -> list[BadRecord]:
    return [BadRecord(position=start + i, reason="too few fields", raw=b"x" * 100)
            for i in range(n)]


async def test_the_file_stops_at_its_cap(tmp_path):
    path = tmp_path / "dead.jsonl"
    letters = DeadLetters(str(path), max_bytes=2000)
    for batch in range(10):
        await letters.write("part-0", _records(5, start=5 * batch))
    assert path.stat().st_size <= 2000
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept and [r["position"] for r in kept] == list(range(len(kept)))
    assert letters.total == 50 and letters.dropped == 50 - len(kept)
    assert letters.counts["too few fields"] == 50


async def test_a_file_already_at_its_cap_takes_no_more(tmp_path):
    path = tmp_path / "dead.jsonl"
    path.write_text("x" * 3000)
    letters = DeadLetters(str(path), max_bytes=2000)
    await letters.write("part-0", _records(3))
    assert path.stat().st_size == 3000 and letters.dropped == 3


def test_the_cap_is_checked():
    with pytest.raises(ValueError, match="dead_letter_max_bytes"):
        LoaderConfig(dead_letter="d.jsonl", dead_letter_max_bytes=0)
    assert LoaderConfig().dead_letter_max_bytes == 64 << 20
