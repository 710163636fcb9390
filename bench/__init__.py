"""Benchmarks: each prints one table with its baseline measured in the same run."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = ["save_plot", "write_json"]


def write_json(result: dict[str, Any], path: str | None) -> None:
    """Write a bench's figures to ``path`` (its ``--json``), when one is given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def save_plot(plot: Callable[[dict[str, Any], str], None], result: dict[str, Any],
              path: str | None, name: str) -> str:
    """Draw ``result`` to ``path`` (default: ``persimmon-bench-<name>.png`` in the temp dir)
    and return where it went."""
    png = path or os.path.join(tempfile.gettempdir(), f"persimmon-bench-{name}.png")
    plot(result, png)
    return png
