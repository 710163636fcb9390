"""The ``persimmon`` command: one entry point, a subcommand per service, local orchestration and
benchmark.

The CLI sits on top: it imports the services' ``register_cli`` hooks and ``services.local``;
nothing under ``services/`` imports it. The ``bench`` folder of a checkout (it is not packaged)
is imported for ``persimmon bench`` and the full parser (``--help``) only, never for a service
command; without a checkout ``persimmon bench`` says where to run it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

from services.common.commands import command_parser, run_parsed
from services.common.errors import ConfigError

__all__ = ["build_parser", "main"]

Register = Callable[[argparse._SubParsersAction], None]


def _worker(subparsers: argparse._SubParsersAction) -> None:
    """``persimmon worker``, with planted data generated in process when there is no loader."""
    from services.local.train import PlantedData
    from services.worker.__main__ import register_cli

    register_cli(subparsers, in_process=PlantedData())


def _serve(subparsers: argparse._SubParsersAction) -> None:
    """``persimmon serve`` and ``export``, with the PS's initial rows and checkpoint reader
    (no torch: ``serve`` runs on the core install)."""
    from services.local.ps_reads import ps_initial_rows, ps_read_shards
    from services.serve.__main__ import register_cli

    register_cli(subparsers, initial_rows=ps_initial_rows, read_shards=ps_read_shards)


def _hook(module: str) -> Register:
    def register(subparsers: argparse._SubParsersAction) -> None:
        importlib.import_module(module).register_cli(subparsers)
    return register


_PS, _LOADER = _hook("services.ps.__main__"), _hook("services.loader.__main__")
_TOKEN = _hook("services.common.token_command")
_SERVICES: list[Register] = [_PS, _LOADER, _worker, _serve, _hook("services.local.train"),
                             _hook("services.local.demo"), _TOKEN]
# Commands whose module is registered alone, so that a PS, loader or serving process starts
# quickly (without importing torch): what a supervisor's restart waits for.
_LIGHT = {"ps": _PS, "loader": _LOADER, "synth": _LOADER, "prepare": _LOADER, "token": _TOKEN,
          "serve": _serve, "export": _serve}


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (skipping ``--log-level LEVEL``), if any."""
    args = iter(argv)
    for arg in args:
        if arg == "--log-level":
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


def _import_bench() -> object | None:
    """The ``bench`` package of the checkout this runs from (the current directory), or None."""
    try:
        return importlib.import_module("bench")
    except ModuleNotFoundError as exc:
        if exc.name != "bench":
            raise
    if os.path.isfile(os.path.join(os.getcwd(), "bench", "__main__.py")):
        sys.path.insert(0, os.getcwd())
        return importlib.import_module("bench")
    return None


def _no_bench(args: argparse.Namespace) -> int:
    raise ConfigError("`persimmon bench` runs from a checkout of the repository: the bench "
                      "folder is not installed. cd to the checkout's root and run "
                      f"`persimmon bench {args.target}` or `python -m bench {args.target}`")


def _register_bench(subparsers: argparse._SubParsersAction, load: bool) -> None:
    """``persimmon bench TARGET``: the benchmarks' own parsers when ``load`` (the command is
    ``bench``, or none: the full parser) and the checkout's ``bench`` imports; otherwise a
    stand-in (a command such as ``worker`` does not import the benchmarks)."""
    bench = _import_bench() if load else None
    parser = subparsers.add_parser("bench", help="run a benchmark and print its table "
                                   "(from a checkout: python -m bench)")
    if bench is not None:
        bench.register_benches(parser.add_subparsers(dest="target",  # type: ignore[attr-defined]
                                                     required=True))
        return
    parser.add_argument("target", help="the benchmark (python -m bench --help lists them)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(func=_no_bench)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or only ``command``'s when it is one of the light commands."""
    parser, sub = command_parser(
        "persimmon", "Train huge recommendation models: embedding PS, NN workers, data loader.")
    if command in _LIGHT:
        _LIGHT[command](sub)
        return parser
    for register in _SERVICES:
        register(sub)
    _register_bench(sub, load=command in (None, "bench"))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_parsed(build_parser(_command_of(argv)), argv)


if __name__ == "__main__":
    raise SystemExit(main())
