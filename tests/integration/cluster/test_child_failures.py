"""A local child process that fails to start (a loader on a file it cannot read): the command
reports the child's own last error line, once, exits 1 and prints no traceback unless
debugging (``--debug``, which the child inherits as ``PERSIMMON_DEBUG``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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
    argv = ["train", "--train-data", f"avazu:{tmp_path}/empty.csv", "--ps", "embedded",
            "--no-cache"]  # a loader process reads it (the column cache: the test below)
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


def test_train_on_an_empty_file_through_the_cache_is_bad_input(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty.csv").write_bytes(b"")
    assert main(["train", "--train-data", f"avazu:{tmp_path}/empty.csv"]) == 2
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert lines[-1] == f"persimmon: error: {tmp_path}/empty.csv {EMPTY_AVAZU}"


def _children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (Linux /proc)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return set()
    return {int(c) for c in text.split()}


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


def test_sigterm_to_train_stops_its_child_processes(tmp_path: Path) -> None:
    """SIGTERM ends ``persimmon train`` as Ctrl-C does: its loaders and PS shard processes
    stop with it (by default Python would exit at once and leave them running)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "train",
         "--train-data", "synthetic:4000000", "--ps", "processes", "--shards", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        children: set[int] = set()
        while len(children) < 4:  # a loader, its held-out one, 2 shards
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, f"children seen: {children}"
            children = _children(proc.pid)
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        left = [pid for pid in children if _alive(pid)]
        for pid in left:  # what a failing run would leave behind
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err
    assert not left
