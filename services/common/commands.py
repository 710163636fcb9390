"""Running a command line: the ``main`` shared by ``persimmon`` and ``python -m services.<x>``.

Each service's ``__main__`` exposes ``register_cli(subparsers)``; :func:`command_parser` makes
the top parser those commands hang on (with ``--log-level`` and ``--debug``), :func:`run_parsed`
parses, sets up logging and runs the chosen command. Every failure is one clear line on stderr
and an exit status (:func:`exit_status`): 0 ok, 1 a runtime failure, 2 a usage error or bad
input (a bad flag, an :class:`~services.common.errors.InvalidArgument`, a
:class:`~services.common.errors.NotFound` of something the command line names). The traceback is
printed too only with ``--debug`` or ``PERSIMMON_DEBUG=1`` (which child processes inherit).
:func:`run_commands` serves a module with subcommands (``python -m bench``),
:func:`run_single` one with one command (``python -m services.ps``).
:func:`add_service_command` adds a command that runs a service from its config dataclass.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from services.common.config import add_flags
from services.common.errors import InvalidArgument, NotFound, PersimmonError

__all__ = ["OK", "RUNTIME_FAILURE", "USAGE_ERROR", "add_service_command", "command_parser",
           "debug_enabled", "exit_status", "float_at_least", "input_file", "int_at_least",
           "ints_at_least", "output_file", "run_commands", "run_parsed", "run_single"]

Register = Callable[[argparse._SubParsersAction], None]

OK, RUNTIME_FAILURE, USAGE_ERROR = 0, 1, 2  # the exit statuses of every command
DEBUG_ENV = "PERSIMMON_DEBUG"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (the usage is in ``--help``); its
    subcommands' parsers are of this class too. Flags are not abbreviated (``--data`` is not
    taken for ``--data-seed``); an unknown one is reported by the subcommand it was given to,
    with the flags it may have meant."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.splitlines())  # a value may hold a line break
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._chosen(parsed)
            meant = list(dict.fromkeys(o for flag in extras if flag.startswith("--")
                                       for o in parser._meant(flag)))
            hint = f"; did you mean {_either(meant)}?" if meant else ""
            parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return parsed

    def _chosen(self, parsed: argparse.Namespace) -> _Parser:
        """The innermost subcommand's parser that ``parsed`` went through."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(sub, _Parser):
                    return sub._chosen(parsed)
        return self

    def _meant(self, flag: str) -> list[str]:
        """Up to three of this parser's flags that ``flag`` (unknown) may stand for: those
        with its word among theirs (``--data``: ``--train-data``), else the closest."""
        typed = flag.split("=", 1)[0]
        flags = [o for action in self._actions for o in action.option_strings
                 if o.startswith("--")]
        word = typed.lstrip("-")
        return ([o for o in flags if word in o.lstrip("-").split("-")][:3]
                or difflib.get_close_matches(typed, flags, n=3, cutoff=0.75))


def _either(words: Sequence[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return " or ".join(filter(None, (", ".join(words[:-1]), words[-1])))


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low`` (the error names the flag and the value)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def ints_at_least(low: int) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type``: a comma list of integers >= ``low`` (``1,2``), at least one."""
    one = int_at_least(low)

    def parse(text: str) -> tuple[int, ...]:
        values = tuple(one(part.strip()) for part in text.split(",") if part.strip())
        if not values:
            raise argparse.ArgumentTypeError(f"expected integers like {low},{low + 1}, "
                                             f"got {text!r}")
        return values
    return parse


def float_at_least(low: float, *, inclusive: bool = True) -> Callable[[str], float]:
    """An argparse ``type``: a finite number >= ``low`` (> ``low`` unless ``inclusive``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(
                f"must be {'>=' if inclusive else '>'} {low:g}, got {text}")
        return value
    return parse


def input_file(text: str) -> str:
    """An argparse ``type``: a file that exists (a directory is not one)."""
    if not Path(text).is_file():
        what = "is a directory, not a file" if Path(text).is_dir() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text!r} {what}")
    return text


def output_file(text: str) -> str:
    """An argparse ``type``: a file the command writes at its end (checked at the start, so
    that a typo does not cost a whole run): not a directory, in a directory that exists."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {str(path.parent)!r} does not exist")
    return text


def debug_enabled() -> bool:
    """Whether ``PERSIMMON_DEBUG`` asks for tracebacks (``--debug`` sets it)."""
    return os.environ.get(DEBUG_ENV, "").lower() in ("1", "true", "yes", "on")


def exit_status(exc: BaseException) -> int:
    """The exit status of a command that raised ``exc``: bad input (an
    :class:`InvalidArgument`, or a :class:`NotFound` of what the flags name) is a usage
    error, anything else a runtime failure."""
    return USAGE_ERROR if isinstance(exc, InvalidArgument | NotFound) else RUNTIME_FAILURE


def _error_line(exc: BaseException) -> str:
    if isinstance(exc, PersimmonError):
        return exc.message
    if isinstance(exc, OSError):
        return str(exc)
    return f"internal error: {type(exc).__name__}: {exc}"


def command_parser(prog: str, description: str
                   ) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """A top parser with ``--log-level`` and a required subcommand; returns it and its
    subparsers (for ``register_cli`` hooks)."""
    parser = _Parser(prog=prog, description=description)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument("--debug", action="store_true",
                        help=f"print the traceback of a failure (or set {DEBUG_ENV}=1)")
    return parser, parser.add_subparsers(dest="command", required=True)


def run_parsed(parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    """Parse ``argv``, configure logging, run the command's ``func``; its exit status. A
    failure is printed as one line (after its traceback when debugging)."""
    args = parser.parse_args(list(argv))
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # child processes print their tracebacks too
    level = args.log_level.upper()
    if not isinstance(logging.getLevelName(level), int):
        parser.error(f"argument --log-level: unknown level {args.log_level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or OK)
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure is one line and an exit status
        if debug_enabled():
            traceback.print_exc()
        print(f"{parser.prog}: error: {_error_line(exc)}", file=sys.stderr)
        return exit_status(exc)


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
    ``[--log-level LEVEL] [--debug] FLAGS...``."""
    parser, sub = command_parser(prog, description)
    register(sub)
    sub.choices[command].prog = prog  # its usage line names the module, not a subcommand
    argv = list(argv)
    head: list[str] = []
    while argv and (argv[0].startswith("--log-level") or argv[0] == "--debug"):
        take = 1 if "=" in argv[0] or argv[0] == "--debug" else 2
        head, argv = head + argv[:take], argv[take:]
    return run_parsed(parser, [*head, command, *argv])
