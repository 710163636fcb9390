"""``run_parsed``: every failure is one line and an exit status (0 ok, 1 runtime failure, 2 bad
input), its traceback only when debugging; the argparse types of counts, rates and output
files."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from services.common.commands import (
    command_parser,
    float_at_least,
    int_at_least,
    ints_at_least,
    output_file,
    run_parsed,
)
from services.common.errors import (
    ConfigError,
    Internal,
    InvalidArgument,
    NotFound,
    TrainingFailed,
    Unavailable,
)


def run(raise_: Callable[[], object], capsys: pytest.CaptureFixture[str],
        *flags: str) -> tuple[int, list[str]]:
    """Run a command whose body calls ``raise_``; its status and its stderr lines."""
    parser, sub = command_parser("tool", "a test tool")
    sub.add_parser("go").set_defaults(func=lambda args: raise_())
    code = run_parsed(parser, [*flags, "go"])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def raiser(exc: BaseException) -> Callable[[], object]:
    def body() -> object:
        raise exc
    return body


@pytest.mark.parametrize(("exc", "status"), [
    (ConfigError("--rows must be >= 1"), 2), (InvalidArgument("labels must be 0 or 1"), 2),
    (NotFound("no complete job checkpoint in d"), 2), (Unavailable("loader exited"), 1),
    (TrainingFailed("training consumed no valid record"), 1), (Internal("rank died"), 1)])
def test_a_persimmon_error_is_its_message_and_its_status(
        exc: Exception, status: int, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PERSIMMON_DEBUG", raising=False)
    assert run(raiser(exc), capsys) == (status, [f"tool: error: {exc}"])


def test_other_errors_are_one_line_exit_1_and_traced_only_when_debugging(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PERSIMMON_DEBUG", raising=False)
    code, lines = run(raiser(ValueError("bad shape")), capsys)
    assert (code, lines) == (1, ["tool: error: internal error: ValueError: bad shape"])
    code, lines = run(raiser(FileNotFoundError(2, "No such file", "x.json")), capsys)
    assert (code, lines) == (1, ["tool: error: [Errno 2] No such file: 'x.json'"])
    assert run(raiser(KeyboardInterrupt()), capsys) == (130, ["tool: interrupted"])
    monkeypatch.setenv("PERSIMMON_DEBUG", "1")
    code, lines = run(raiser(Unavailable("loader exited")), capsys)
    assert code == 1 and lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "tool: error: loader exited"


def test_debug_flag_traces_and_reaches_child_processes(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERSIMMON_DEBUG", "")  # restored after the test
    code, lines = run(raiser(ConfigError("bad")), capsys)
    assert (code, lines) == (2, ["tool: error: bad"])
    code, lines = run(raiser(ConfigError("bad")), capsys, "--debug")
    assert code == 2 and lines[0].startswith("Traceback") and lines[-1] == "tool: error: bad"
    assert os.environ["PERSIMMON_DEBUG"] == "1"  # what a child process inherits


def test_a_usage_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    parser, sub = command_parser("tool", "a test tool")
    go = sub.add_parser("go")
    go.add_argument("--rows", type=int_at_least(1), required=True)
    for argv, says in ((["go", "--rows", "0"], "argument --rows: must be >= 1, got 0"),
                       (["go"], "required: --rows"), (["stop"], "invalid choice: 'stop'"),
                       (["--log-level", "LOUD", "go", "--rows", "1"], "unknown level")):
        with pytest.raises(SystemExit) as exited:
            run_parsed(parser, argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and len(err.splitlines()) == 1 and says in err, err


def test_flags_are_not_abbreviated_and_an_unknown_one_names_what_it_may_mean(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--data`` once read as ``--data-seed`` (its only prefix match) and failed as a bad
    int; now the subcommand it was given to reports it, with the flags it may mean."""
    parser, sub = command_parser("tool", "a test tool")
    ran: list[argparse.Namespace] = []
    train = sub.add_parser("train")
    train.add_argument("--train-data")
    train.add_argument("--data-seed", type=int, default=0)
    train.add_argument("--rows", type=int, default=1)
    train.set_defaults(func=ran.append)
    deeper = sub.add_parser("bench").add_subparsers(dest="target", required=True)
    deeper.add_parser("plan").add_argument("--batch-size", type=int)
    for argv, says in (
            (["train", "--data", "x.csv"], "tool train: error: unrecognized arguments: "
             "--data x.csv; did you mean --train-data or --data-seed? (see tool train --help)"),
            (["train", "--row", "5"], "unrecognized arguments: --row 5; did you mean --rows?"),
            (["train", "--train-data=x", "extra"], "tool train: error: unrecognized "
             "arguments: extra (see tool train --help)"),
            (["bench", "plan", "--batch", "8"], "tool bench plan: error: unrecognized "
             "arguments: --batch 8; did you mean --batch-size?")):
        with pytest.raises(SystemExit) as exited:
            run_parsed(parser, argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and len(err.splitlines()) == 1 and says in err, err
    assert not ran  # nothing ran on bad flags
    assert run_parsed(parser, ["train", "--train-data", "x.csv", "--data-seed", "3"]) == 0
    assert ran[0].train_data == "x.csv" and ran[0].data_seed == 3


def test_the_argument_types(tmp_path: Path) -> None:
    assert int_at_least(0)("0") == 0 and float_at_least(0, inclusive=False)("1e-3") == 1e-3
    assert ints_at_least(1)(" 2, 16384,") == (2, 16384)
    for parse, text, says in ((int_at_least(1), "-5", "must be >= 1, got -5"),
                              (ints_at_least(1), "2,0", "must be >= 1, got 0"),
                              (ints_at_least(1), "2,x", "expected an integer, got 'x'"),
                              (ints_at_least(1), " , ", "expected integers like 1,2"),
                              (int_at_least(1), "2.5", "expected an integer"),
                              (float_at_least(0), "inf", "must be >= 0"),
                              (float_at_least(0), "nan", "must be >= 0"),
                              (float_at_least(0, inclusive=False), "0", "must be > 0"),
                              (float_at_least(0), "fast", "expected a number"),
                              (output_file, str(tmp_path), "is a directory"),
                              (output_file, str(tmp_path / "no" / "x.json"), "does not exist")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            parse(text)
    assert output_file(str(tmp_path / "x.json")) == str(tmp_path / "x.json")
