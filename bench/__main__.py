"""``python -m bench <name> [flags]``: run one benchmark from a checkout (``--help`` lists them)."""

from __future__ import annotations

import sys

from bench import register_benches
from services.common.commands import command_parser, run_parsed


def main(argv: list[str] | None = None) -> int:
    parser, sub = command_parser("python -m bench", "Run a benchmark and print its table.")
    register_benches(sub)
    return run_parsed(parser, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
