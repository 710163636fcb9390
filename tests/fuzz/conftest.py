"""Fuzz bookkeeping: the totals of :mod:`tests.fuzz.cases` are printed at the end of the
session (the figures quoted in the README)."""

from __future__ import annotations

import pytest

from tests.fuzz.cases import CASES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if CASES:
        terminalreporter.write_sep("-", "fuzz cases run")
        for suite, n in sorted(CASES.items()):
            terminalreporter.write_line(f"{suite}: {n}")
        terminalreporter.write_line(f"total: {sum(CASES.values())}")
