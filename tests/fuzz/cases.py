"""The count of fuzz cases each suite ran in this session (printed by tests/fuzz/conftest.py)."""

from __future__ import annotations

from collections import Counter

CASES: Counter[str] = Counter()


def count_case(suite: str) -> None:
    CASES[suite] += 1
