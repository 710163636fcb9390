"""``python -m bench <name> [flags]``: run one benchmark from a checkout (``--help`` lists them)."""

from __future__ import annotations

from bench import register_benches
from services.common.commands import run_commands


def main(argv: list[str] | None = None) -> int:
    return run_commands(register_benches, argv, prog="python -m bench",
                        description="Run a benchmark and print its table.")


if __name__ == "__main__":
    raise SystemExit(main())
