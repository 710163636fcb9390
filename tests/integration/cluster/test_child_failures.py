"""A local child process that fails to start (a loader on a file it cannot read): the command
reports the child's own last error line, once, exits 1 and prints no traceback unless
debugging (``--debug``, which the child inherits as ``PERSIMMON_DEBUG``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services.cli import main
from services.common.errors import Unavailable
from services.local.processes import start_service

EMPTY_AVAZU = "is empty: no header line"  # the loader's own error: passes the launcher's check


def test_start_service_names_the_childs_last_error_line(
        tmp_path: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PERSIMMON_DEBUG", raising=False)
    command = [sys.executable, "-m", "services.loader", "loader", "--source",
               f"criteo:{tmp_path}/missing.tsv"]
    with pytest.raises(Unavailable) as failed:
        start_service(command, str(tmp_path / "ready"), timeout=60)
    assert failed.value.message == (f"loader exited with 2 before serving: source "
                                    f"'criteo:{tmp_path}/missing.tsv' matches no files")
    out, err = capfd.readouterr()
    assert "matches no files" not in err + out  # held back: the error says it, once


def test_train_whose_loader_fails_exits_1_with_one_line(
        tmp_path: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERSIMMON_DEBUG", "")  # restored after the test (--debug sets it)
    (tmp_path / "empty.csv").write_bytes(b"")
    argv = ["train", "--train-data", f"avazu:{tmp_path}/empty.csv", "--ps", "embedded"]
    assert main(argv) == 1
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == (f"persimmon: error: loader exited with 2 before serving: "
                        f"{tmp_path}/empty.csv {EMPTY_AVAZU}")
    assert main(["--debug", *argv]) == 1
    err = capfd.readouterr().err
    assert err.count("Traceback (most recent call last)") == 2, err  # the child's and ours
    assert err.rstrip().endswith(EMPTY_AVAZU)
