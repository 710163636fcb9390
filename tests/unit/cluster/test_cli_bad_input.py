"""Every ``persimmon`` command under bad input: exit status 2, one line on stderr naming what
is wrong, no traceback, and nothing written (the table runs in the test's own directory and
compares its files before and after).

The commands run in this process (``services.cli.main``) and must fail before any process
starts; ``ps``, ``loader``, ``worker`` and ``serve`` get ``--check-config`` so that a check
gone missing fails the test instead of serving forever. ``train``, ``demo``, ``synth`` and
``export`` run without it: their checks must come before their work.

Unreadable files: these tests may run as root, which reads through mode 000, so an
unreadable input is a directory where a file is expected (``open`` fails with an OSError,
the same path as EACCES): ``--config DIR``, ``--model-config DIR``, a source naming a
directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.cli import main

# (argv with {tmp} for the test's directory, what the error line says)
CASES: dict[str, list[tuple[list[str], str]]] = {
    "ps": [
        (["--config", "{tmp}/unknown.yaml"], "unknown keys ['colour']"),
        (["--config", "{tmp}/missing.yaml"], "cannot read config file"),
        (["--config", "{tmp}/adir"], "Is a directory"),
        (["--shard-id", "x"], "shard_id: expected int, got 'x'"),
        (["--num-shards", "-1"], "num_shards must be >= 1"),
        (["--shard-id", "2", "--num-shards", "2"], "shard_id must be in [0, 2)"),
        (["--grpc-port", "70000"], "grpc_port"),
    ],
    "loader": [
        (["--source", "criteo:{tmp}/missing.tsv"], "matches no files"),
        (["--source", "criteo:{tmp}/adir"], "adir is a directory"),
        (["--source", "csv:{tmp}/empty.tsv?schema={tmp}/missing.yaml"],
         "cannot read schema file"),
        (["--source", "parquet:{tmp}/empty.tsv?colour=red"], "unknown parameters ['colour']"),
        (["--source", "hdfs:/data"], "unknown source kind 'hdfs'"),
        (["--batch-size", "-3"], "batch_size must be >= 1, got -3"),
        (["--epochs", "many"], "epochs: expected int, got 'many'"),
        (["--shuffle-files", "maybe"], "expected a boolean"),
        (["--config", "{tmp}/unknown.yaml"], "unknown keys ['colour']"),
        (["--checkpoint-dir", "{tmp}", "--shuffle-buffer", "8"], "needs shuffle_buffer 0"),
        (["--source", "csv:{tmp}/empty.tsv?schema={tmp}/empty.tsv"], "must hold a mapping"),
        (["produce", "--topic", "t", "--bootstrap", "127.0.0.1:1", "{tmp}/missing.tsv"],
         "missing.tsv' does not exist"),
        (["produce", "--topic", "t", "--bootstrap", "127.0.0.1:1", "{tmp}/adir"],
         "is a directory, not a file"),
    ],
    "worker": [
        ([], "give --ps"),
        (["--ps", "a:1", "--epochs", "-1"], "argument --epochs: must be >= 1, got -1"),
        (["--ps", "a:1", "--batch-size", "x"], "argument --batch-size: expected an integer"),
        (["--ps", "a:1", "--mode", "nope"], "mode must be one of"),
        (["--ps", "a:1", "--model", "nope"], "argument --model: invalid choice: 'nope'"),
        (["--ps", "a:1", "--train-data", "criteo:{tmp}/missing.tsv"],
         "--train-data: source"),
        (["--ps", "a:1", "--loader", "l:1", "--resume"], "--resume needs --checkpoint-dir"),
        (["--ps", "a:1", "--config", "{tmp}/unknown.yaml"], "unknown keys ['colour']"),
        (["--ps", "a:1", "--summary-json", "{tmp}/adir"], "is a directory, not a file"),
    ],
    "train": [
        (["--train-data", "criteo:{tmp}/missing.tsv"], "--train-data: source"),
        (["--train-data", "criteo:{tmp}/adir"], "adir is a directory"),
        (["--train-data", "bogus:/nowhere"], "unknown source kind 'bogus'"),
        (["--eval-data", "criteo:{tmp}/missing.tsv"], "--eval-data: source"),
        (["--train-data", "synthetic:many"], "bad row count"),
        (["--train-data", "synthetic:-5"], "synthetic row count must be >= 1, got -5"),
        (["--workers", "0"], "argument --workers: must be >= 1, got 0"),
        (["--shards", "two"], "argument --shards: expected an integer, got 'two'"),
        (["--ps-lr", "nan"], "argument --ps-lr: must be > 0"),
        (["--ps", "embedded", "--workers", "2"], "--ps embedded cannot serve 2 workers"),
        (["--ps-optimizer", "lion"], "argument --ps-optimizer: invalid choice"),
        (["--config", "{tmp}/unknown.yaml"], "unknown keys ['colour']"),
        (["--summary-json", "{tmp}/nodir/summary.json"], "does not exist"),
        (["--ps-table-lr", "C1"], "bad table lr 'C1'"),
    ],
    "demo": [
        (["--rows", "-5"], "argument --rows: must be >= 1, got -5"),
        (["--rows", "lots"], "argument --rows: expected an integer, got 'lots'"),
        (["--mode", "chaos"], "argument --mode: invalid choice: 'chaos'"),
        (["--rows", "100", "--batch-size", "64", "--workers", "4"], "fewer than --workers 4"),
        (["--plot", "{tmp}/adir"], "argument --plot"),
        (["--sync", "telepathy"], "telepathy"),
    ],
    "synth": [
        (["--rows", "-5", "--out", "{tmp}/out"], "argument --rows: must be >= 1, got -5"),
        (["--rows", "ten", "--out", "{tmp}/out"], "expected an integer, got 'ten'"),
        (["--rows", "10", "--test-rows", "0", "--out", "{tmp}/out"], "--test-rows"),
        (["--rows", "10", "--out", "{tmp}/empty.tsv"], "is not a directory"),
        (["--rows", "10"], "required: --out"),
    ],
    "export": [
        (["--checkpoint-dir", "{tmp}/missing"], "--checkpoint-dir"),
        (["--checkpoint-dir", "{tmp}/empty.tsv"], "is not a directory"),
        (["--checkpoint-dir", "{tmp}/adir"], "no complete job checkpoint"),
        (["--checkpoint-dir", "{tmp}/adir", "--model", "nope"], "unknown model 'nope'"),
        (["--checkpoint-dir", "{tmp}/adir", "--row-dtype", "float8"], "row_dtype must be"),
        (["--checkpoint-dir", "{tmp}/adir", "--keep", "-1"], "keep must be >= 0"),
        (["--checkpoint-dir", "{tmp}/adir", "--model-config", "{tmp}/adir"],
         "cannot read model config"),
        (["--checkpoint-dir", "{tmp}/adir", "--config", "{tmp}/unknown.yaml"],
         "unknown keys ['colour']"),
        (["--checkpoint-dir", "{tmp}/adir", "--features", "{tmp}/empty.json"],
         "cannot read feature spec file"),
    ],
    "serve": [
        ([], "model_dir is required"),
        (["--model-dir", "{tmp}/empty.tsv"], "is not a directory"),
        (["--model-dir", "{tmp}", "--max-batch-records", "0"], "max_batch_records must be"),
        (["--model-dir", "{tmp}", "--admin-port", "http"], "admin_port: expected int"),
        (["--model-dir", "{tmp}", "--config", "{tmp}/unknown.yaml"], "unknown keys"),
    ],
    "bench": [
        (["nope"], "argument target: invalid choice: 'nope'"),
        (["train", "--rows", "-5"], "argument --rows: must be >= 1, got -5"),
        (["ps", "--seconds", "0"], "argument --seconds: must be > 0"),
        (["loader", "--repeat", "x"], "argument --repeat: expected an integer"),
    ],
}
# the commands that would serve or train once their flags pass: stopped after the checks
CHECK_CONFIG = {"ps", "loader", "worker", "serve"}
EXPORT_FLAGS = ["--job-checkpoint", "latest", "--features", "synthetic:10", "--out", "{tmp}/out"]


def _argv(command: str, flags: list[str], tmp: Path) -> list[str]:
    argv = [command, *flags]
    if command == "export" and "--checkpoint-dir" in flags:
        argv = [command, *EXPORT_FLAGS, *flags]  # the case's own flags come last: they win
    if command in CHECK_CONFIG and "produce" not in flags:
        argv.append("--check-config")
    return [a.replace("{tmp}", str(tmp)) for a in argv]


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*")}


@pytest.fixture
def inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of bad inputs, the test's working directory too."""
    (tmp_path / "unknown.yaml").write_text("colour: red\n")
    (tmp_path / "empty.tsv").write_bytes(b"")
    (tmp_path / "empty.json").write_bytes(b"")
    (tmp_path / "adir").mkdir()
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith(("PERSIMMON_PS_", "PERSIMMON_LOADER_", "PERSIMMON_WORKER_",
                            "PERSIMMON_SERVE_", "PERSIMMON_EXPORT_")):
            monkeypatch.delenv(name)
    return tmp_path


def fails_cleanly(argv: list[str], capsys: pytest.CaptureFixture[str], status: int = 2) -> str:
    """Run ``persimmon ARGV``; assert the exit status and one error line; return it."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own exit
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == status, (argv, code, err)
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith("persimmon") and ": error: " in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(("command", "flags", "says"), [
    (command, flags, says) for command, cases in CASES.items() for flags, says in cases])
def test_bad_input_is_one_line_and_exit_2(command: str, flags: list[str], says: str,
                                          inputs: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    before = _files(inputs)
    line = fails_cleanly(_argv(command, flags, inputs), capsys)
    assert says.replace("{tmp}", str(inputs)) in line, line
    assert _files(inputs) == before  # no partial output, data or checkpoint directory


def test_a_usage_error_outside_any_command(inputs: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert "required: command" in fails_cleanly([], capsys)
    assert "invalid choice: 'frobnicate'" in fails_cleanly(["frobnicate"], capsys)
    assert "unknown level 'LOUD'" in fails_cleanly(
        ["--log-level", "LOUD", "synth", "--rows", "1", "--out", "out"], capsys)
    assert not (inputs / "out").exists()


def test_synth_that_fails_midway_leaves_no_file(inputs: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A runtime failure (exit 1) after a split was written: the staged files go too, and a
    directory synth created itself is removed whole."""
    (inputs / "out").mkdir()
    (inputs / "out" / "test.txt").mkdir()  # the second split cannot take its place
    line = fails_cleanly(["synth", "--rows", "10", "--test-rows", "10", "--out", "out"],
                         capsys, status=1)
    assert "Is a directory" in line
    assert _files(inputs / "out") == {Path("test.txt")}  # nor train.txt, nor .tmp-*
    assert main(["synth", "--rows", "10", "--test-rows", "10", "--out", "new/deep"]) == 0
    assert _files(inputs / "new" / "deep") == {Path(n) for n in
                                               ("train.txt", "test.txt", "synthetic.json")}

