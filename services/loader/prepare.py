"""``persimmon prepare``: file sources parsed into the column cache ahead of training, with a
progress bar (``persimmon train`` calls :func:`prepare_sources` too, before any step)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from services.common.errors import ConfigError
from services.loader.cache import CachedData, ColumnCache, default_cache_dir
from services.loader.config import SourceSpec

__all__ = ["cacheable", "prepare_sources", "register_prepare"]


def cacheable(spec: str | None) -> bool:
    """Whether a loader spec is a file source (what the cache holds)."""
    return spec is not None and SourceSpec.parse(spec).kind.is_file


def prepare_sources(specs: Sequence[str], *, cache_dir: str | Path | None = None,
                    show: bool = True) -> list[CachedData]:
    """Each spec's files cached (parsed now where no valid entry is there), in order; a
    progress bar on stderr when ``show``, something is parsed and rich is installed (the
    ``demo`` extra; the core install parses without one)."""
    cache = ColumnCache(cache_dir)
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TaskID,
            TimeRemainingColumn,
        )
    except ImportError:
        return [cache.prepare(spec) for spec in specs]
    out = []
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=True,
                  disable=not show) as bar:
        for spec in specs:
            task = bar.add_task(f"parsing {spec.partition('?')[0]} once", total=None)

            def parsed(done: int, total: int, task: TaskID = task) -> None:
                bar.update(task, completed=done, total=total)
            out.append(cache.prepare(spec, progress=parsed))
            bar.remove_task(task)
    return out


def _prepare(args: argparse.Namespace) -> int:
    try:
        cached = prepare_sources(args.data, cache_dir=args.cache_dir, show=sys.stderr.isatty())
    except OSError as exc:
        raise ConfigError(f"cannot prepare {exc.filename}: {exc.strerror}") from exc
    print(json.dumps([{"source": spec, "entries": data.entries, **data.describe()}
                      for spec, data in zip(args.data, cached, strict=True)], indent=2))
    return 0


def register_prepare(subparsers: argparse._SubParsersAction) -> None:
    prepare = subparsers.add_parser(
        "prepare", help="parse file sources once into the column cache (persimmon train "
                        "reads it)",
        description="Parse each file source's files into the column cache: hashed ids, dense "
                    "values and labels, memory-mapped by persimmon train in every later epoch "
                    "and run. A file that changed, or a cache entry that is corrupt, is "
                    "parsed again.")
    prepare.add_argument("data", nargs="+", help="loader spec of a file source "
                                                 "(criteo:GLOB, avazu:GLOB, csv:..., parquet:...)")
    prepare.add_argument("--cache-dir", default=None,
                         help=f"the cache's directory (default: $PERSIMMON_CACHE_DIR, else "
                              f"{default_cache_dir()})")
    prepare.set_defaults(func=_prepare)
