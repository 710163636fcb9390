"""The ``persimmon`` command: one entry point, a subcommand per service and benchmark."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from services.common.errors import PersimmonError

__all__ = ["main"]

# Modules exposing ``register_cli(subparsers)``; a module not present yet is left out.
_SERVICES = ["services.ps.__main__", "services.loader.__main__", "services.launch",
             "services.demo"]
# Modules exposing ``register_bench(subparsers)`` for ``persimmon bench <target>``.
_BENCHES = ["bench.ps", "bench.loader", "bench.train", "bench.compression", "bench.sync",
            "bench.staleness", "bench.load", "bench.recovery"]
# Commands whose module is registered alone, so that a PS or loader process starts quickly
# (without importing torch and the benchmarks): what a supervisor's restart waits for.
_LIGHT = {"ps": "services.ps.__main__", "loader": "services.loader.__main__",
          "synth": "services.loader.__main__"}


def _register(subparsers: argparse._SubParsersAction, modules: list[str], hook: str) -> None:
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # that part is not built yet
            raise
        getattr(module, hook)(subparsers)


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (skipping ``--log-level LEVEL``), if any."""
    args = iter(argv)
    for arg in args:
        if arg == "--log-level":
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or only ``command``'s when it is one of the light commands."""
    parser = argparse.ArgumentParser(
        prog="persimmon",
        description="Train huge recommendation models: embedding PS, NN workers, data loader.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    if command in _LIGHT:
        _register(sub, [_LIGHT[command]], "register_cli")
        return parser
    _register(sub, _SERVICES, "register_cli")
    bench = sub.add_parser("bench", help="run a benchmark and print its table")
    _register(bench.add_subparsers(dest="target", required=True), _BENCHES, "register_bench")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command_of(argv)).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except PersimmonError as exc:
        print(f"persimmon: error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
