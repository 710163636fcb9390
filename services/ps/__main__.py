"""``persimmon ps``: run one PS shard (``python -m services.ps FLAGS...`` runs the same)."""

from __future__ import annotations

import argparse
import sys

from services.common.commands import add_service_command, run_single
from services.common.config import flag_values, load_config
from services.common.lifecycle import serve_from_flags
from services.ps.config import PSConfig

__all__ = ["load_ps_config", "main", "register_cli"]


def load_ps_config(args: argparse.Namespace) -> PSConfig:
    return load_config(PSConfig, yaml_path=args.config, env_prefix="PERSIMMON_PS_",
                       flags=flag_values(PSConfig, args))


def _run(args: argparse.Namespace) -> int:
    from services.ps.service import PSService

    return serve_from_flags(args, "ps", load_ps_config(args), PSService)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    add_service_command(
        subparsers, "ps", PSConfig, _run, help="run one embedding parameter server shard",
        description="Run one PS shard. Settings come from --config YAML, PERSIMMON_PS_* "
                    "environment variables and flags (flags win).",
        config_help="YAML file with PS settings and tables",
        ready_help="write the bound ports here as JSON once serving (launchers that pass "
                   "port 0 wait for it)")


def main(argv: list[str] | None = None) -> int:
    """``python -m services.ps [--log-level LEVEL] FLAGS...``: the ``persimmon ps`` command."""
    return run_single("ps", register_cli, sys.argv[1:] if argv is None else argv,
                      prog="python -m services.ps", description="Run one PS shard.")


if __name__ == "__main__":
    raise SystemExit(main())
