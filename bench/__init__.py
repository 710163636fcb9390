"""Benchmarks: each prints one table with its baseline measured in the same run.

Not packaged: run them from a checkout, ``python -m bench <name>`` (or ``persimmon bench
<name>`` from the checkout's root). They use the public API of ``services`` and ``clients``
only (no ``_private`` names, no ``clients._stream``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["BENCHES", "latency_quantiles", "main_of", "register_benches", "save_plot",
           "write_json"]

# Modules exposing ``register_bench(subparsers)``: ``python -m bench <name>`` for each.
BENCHES = ["bench.ps", "bench.loader", "bench.train", "bench.compression", "bench.sync",
           "bench.staleness", "bench.load", "bench.recovery", "bench.chaos", "bench.push_cost",
           "bench.quality", "bench.serve", "bench.dashboard", "bench.scale", "bench.plan",
           "bench.e2e", "bench.abuse"]


def register_benches(subparsers: argparse._SubParsersAction) -> None:
    """Add every benchmark's subcommand (``persimmon bench`` and ``python -m bench``)."""
    for name in BENCHES:
        importlib.import_module(name).register_bench(subparsers)


def write_json(result: dict[str, Any], path: str | None) -> None:
    """Write a bench's figures to ``path`` (its ``--json``), when one is given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def main_of(run: Callable[[argparse.Namespace], dict[str, Any]],
            show: Callable[[dict[str, Any]], None]) -> Callable[[argparse.Namespace], int]:
    """A bench's command: ``run(args)``, ``show`` its table, write its ``--json``."""
    def main(args: argparse.Namespace) -> int:
        result = run(args)
        show(result)
        write_json(result, args.json)
        return 0
    return main


def latency_quantiles(seconds: Sequence[float]) -> dict[str, float]:
    """The median and 99th percentile of latencies ``seconds``, in ms (``p50_ms``,
    ``p99_ms``)."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


def save_plot(plot: Callable[[dict[str, Any], str], None], result: dict[str, Any],
              path: str | None, name: str) -> str:
    """Draw ``result`` to ``path`` (default: ``persimmon-bench-<name>.png`` in the temp dir)
    and return where it went."""
    png = path or os.path.join(tempfile.gettempdir(), f"persimmon-bench-{name}.png")
    plot(result, png)
    return png
