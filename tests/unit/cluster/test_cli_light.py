"""``persimmon ps``/``loader`` parse with only their own module (fast restarts)."""

from __future__ import annotations

import pytest

from services.cli import _command_of, build_parser


def test_command_of_skips_the_log_level() -> None:
    assert _command_of(["--log-level", "WARNING", "ps", "--shard-id", "1"]) == "ps"
    assert _command_of(["bench", "recovery"]) == "bench"
    assert _command_of(["--help"]) is None


def test_light_parser_has_only_its_command() -> None:
    args = build_parser("ps").parse_args(["ps", "--shard-id", "1", "--num-shards", "2"])
    assert args.command == "ps"
    with pytest.raises(SystemExit):
        build_parser("ps").parse_args(["worker", "--ps", "a:1"])
    assert build_parser().parse_args(["worker", "--ps", "a:1"]).command == "worker"
