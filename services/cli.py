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


def _register(subparsers: argparse._SubParsersAction, modules: list[str], hook: str) -> None:
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # that part is not built yet
            raise
        getattr(module, hook)(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="persimmon",
        description="Train huge recommendation models: embedding PS, NN workers, data loader.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    _register(sub, _SERVICES, "register_cli")
    bench = sub.add_parser("bench", help="run a benchmark and print its table")
    _register(bench.add_subparsers(dest="target", required=True), _BENCHES, "register_bench")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except PersimmonError as exc:
        print(f"persimmon: error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
