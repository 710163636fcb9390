"""Running a command line: the ``main`` shared by ``persimmon`` and ``python -m services.<x>``.

Each service's ``__main__`` exposes ``register_cli(subparsers)``; :func:`command_parser` makes
the top parser those commands hang on (with ``--log-level``), :func:`run_parsed` parses, sets up
logging and runs the chosen command, printing a :class:`PersimmonError` as one clear line (exit
status 2). :func:`run_commands` serves a module with subcommands (``python -m bench``),
:func:`run_single` one with one command (``python -m services.ps``).
:func:`add_service_command` adds a command that runs a service from its config dataclass.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from services.common.config import add_flags
from services.common.errors import PersimmonError

__all__ = ["add_service_command", "command_parser", "run_commands", "run_parsed", "run_single"]

Register = Callable[[argparse._SubParsersAction], None]


def command_parser(prog: str, description: str
                   ) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """A top parser with ``--log-level`` and a required subcommand; returns it and its
    subparsers (for ``register_cli`` hooks)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return parser, parser.add_subparsers(dest="command", required=True)


def run_parsed(parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    """Parse ``argv``, configure logging, run the command's ``func``; its exit status."""
    args = parser.parse_args(list(argv))
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except PersimmonError as exc:
        print(f"{parser.prog}: error: {exc.message}", file=sys.stderr)
        return 2


def run_commands(register: Register, argv: Sequence[str] | None, *, prog: str,
                 description: str) -> int:
    """Run the command that ``argv`` (default: ``sys.argv[1:]``) names among those
    ``register`` adds: ``[--log-level LEVEL] COMMAND ...``."""
    parser, sub = command_parser(prog, description)
    register(sub)
    return run_parsed(parser, sys.argv[1:] if argv is None else argv)


def add_service_command(subparsers: argparse._SubParsersAction, name: str, config: type[Any],
                        run: Callable[[argparse.Namespace], int], *, help: str,
                        description: str, config_help: str,
                        ready_help: str) -> argparse.ArgumentParser:
    """Add command ``name`` that runs a service: ``--config`` (a YAML file),
    ``--check-config``, ``--ready-file`` and a flag for each field of ``config``."""
    parser = subparsers.add_parser(name, help=help, description=description)
    parser.add_argument("--config", help=config_help)
    parser.add_argument("--check-config", action="store_true",
                        help="print the effective config and exit")
    parser.add_argument("--ready-file", help=ready_help)
    add_flags(parser, config)
    parser.set_defaults(func=run)
    return parser


def run_single(command: str, register: Register, argv: Sequence[str], *,
               prog: str, description: str) -> int:
    """Run ``command`` (registered by ``register``) from ``argv`` that does not name it:
    ``[--log-level LEVEL] FLAGS...``."""
    parser, sub = command_parser(prog, description)
    register(sub)
    sub.choices[command].prog = prog  # its usage line names the module, not a subcommand
    argv = list(argv)
    head: list[str] = []
    while argv and argv[0].startswith("--log-level"):
        take = 1 if "=" in argv[0] else 2
        head, argv = head + argv[:take], argv[take:]
    return run_parsed(parser, [*head, command, *argv])
