"""Property: random flag lists given to each ``persimmon`` command's parser end in exit 0
(``--help``) or 2 (one usage line), never another exit or a traceback. Parsing only: no
command runs, so no process starts."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.cli import build_parser

COMMANDS = ["ps", "loader", "worker", "train", "demo", "synth", "export", "serve", "bench"]


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string and subcommand name of ``parser`` and of its subparsers."""
    out: list[str] = []
    for action in parser._actions:
        out += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [name, *_options(sub)]
    return out


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


PARSERS = {command: build_parser(command) for command in COMMANDS}
OPTIONS = {command: sorted(set(_options(_subcommand(parser, command))))
           for command, parser in PARSERS.items()}
VALUES = st.one_of(
    st.integers(-10**6, 10**6).map(str), st.floats(allow_nan=True).map(str),
    st.sampled_from(["", "-", "--", "nan", "inf", "-1", "0", "x", "/nonexistent/file",
                     ".", "synthetic:-5", "criteo:/no/such/file.tsv", "a=b", "--help"]),
    st.text(max_size=12))


@pytest.mark.parametrize("command", COMMANDS)
def test_random_flags_parse_or_fail_with_exit_2(command: str) -> None:
    parser = PARSERS[command]

    @settings(max_examples=40, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.one_of(st.sampled_from(OPTIONS[command]), VALUES), max_size=8))
    def parse(flags: list[str]) -> None:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                parser.parse_args([command, *flags])
                return
            except SystemExit as exc:
                code = exc.code
        assert code in (0, 2), (flags, code, err.getvalue())
        assert "Traceback" not in err.getvalue()
        if code == 2:
            assert len(err.getvalue().splitlines()) == 1, err.getvalue()

    parse()
