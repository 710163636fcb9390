"""Benchmark: planning a batch (dedup ids per table, laid out by shard) against numpy's way.

Work: the Criteo-shaped planted profile's batches (26 features, one id each a sample), planned
for ``--shards`` PS shards by :func:`services.worker.plan_batch` (one numba pass a table) and by
what a user would write with numpy: per table ``np.unique(..., return_inverse=True)``, then the
unique ids ordered by shard (``shard_of``, a stable sort) with each id's index remapped. Both
give every id's index into its table's unique ids laid out by shard (checked once). The two
alternate batch by batch, so drift hits both; the figure per batch size is the median of the
paired ratios (`vs_numpy`: numpy's time over ours).

Run: ``python -m bench plan``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bench import main_of
from services.common.commands import int_at_least, ints_at_least
from services.common.sharding import shard_of
from services.loader.planted import SyntheticDataset, synthetic_profile
from services.worker.pooling import plan_batch

__all__ = ["register_bench", "run"]

console = Console()


def _numpy_plan(batch: dict[str, Any], num_shards: int) -> list[tuple[np.ndarray, ...]]:
    """Per table: its unique ids ordered by shard and each id's index into them."""
    planned = []
    for ids in (np.asarray(f.values) for f in batch.values()):
        unique, inverse = np.unique(ids, return_inverse=True)
        order = np.argsort(shard_of(unique, num_shards), kind="stable")
        where = np.empty_like(order)
        where[order] = np.arange(order.size)
        planned.append((unique[order], where[inverse]))
    return planned


def _check(batch: dict[str, Any], num_shards: int) -> None:
    """Both ways give every id back from its table's unique ids (the layouts' orders differ:
    first appearance against sorted, within a shard)."""
    plan = plan_batch(batch, num_shards=num_shards)
    for (unique, inverse), (name, feature) in zip(
            _numpy_plan(batch, num_shards),
            batch.items(), strict=True):
        ours = plan.features[name]
        ids = plan.groups[ours.group].layout.ids
        if not (np.array_equal(ids[ours.inverse], feature.values)
                and np.array_equal(unique[inverse], feature.values)
                and np.array_equal(np.sort(plan.unique[name]), np.sort(unique))):
            raise RuntimeError(f"the two plans disagree on feature {name}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Per batch size, the median ms a batch of each way and the median paired ratio."""
    data = SyntheticDataset(synthetic_profile("criteo", seed=args.seed))
    rows: dict[str, dict[str, float]] = {}
    for size in args.batch_sizes:
        batches = [dict(b.sparse) for b in data.batches(size, size * args.batches)]
        _check(batches[0], args.shards)  # and the kernels compiled, untimed
        ours, numpy_ms, ratios = [], [], []
        for r in range(args.repeats):
            for batch in batches:
                times = {}
                for way in ("ours", "numpy") if r % 2 == 0 else ("numpy", "ours"):
                    start = time.perf_counter()
                    if way == "ours":
                        plan_batch(batch, num_shards=args.shards)
                    else:
                        _numpy_plan(batch, args.shards)
                    times[way] = time.perf_counter() - start
                ours.append(times["ours"] * 1e3)
                numpy_ms.append(times["numpy"] * 1e3)
                ratios.append(times["numpy"] / times["ours"])
        rows[str(size)] = {"ms": statistics.median(ours),
                           "numpy_ms": statistics.median(numpy_ms),
                           "vs_numpy": statistics.median(ratios),
                           "ids": sum(np.asarray(f.values).size for f in batches[0].values())}
    return {"shards": args.shards, "repeats": args.repeats, "batches": args.batches,
            "batch_sizes": rows}


def _print(result: dict[str, Any]) -> None:
    table = Table(title=f"plan a batch: Criteo-shaped, 26 tables, {result['shards']} shards, "
                        f"median of {result['repeats']} x {result['batches']} paired batches")
    for column in ("batch", "ids", "plan_batch ms", "numpy ms", "vs_numpy"):
        table.add_column(column, justify="right")
    for size, row in result["batch_sizes"].items():
        table.add_row(f"{int(size):,}", f"{row['ids']:,}", f"{row['ms']:.2f}",
                      f"{row['numpy_ms']:.2f}", f"{row['vs_numpy']:.2f}")
    console.print(table)


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="planning a batch (dedup per table, by shard) against numpy's way")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--batch-sizes", type=ints_at_least(1),
                        default=(2048, 16384, 65536), help="comma list of batch sizes")
    parser.add_argument("--batches", type=int_at_least(1), default=8,
                        help="planted batches a size")
    parser.add_argument("--shards", type=int_at_least(1), default=2)
    parser.add_argument("--repeats", type=int_at_least(1), default=5,
                        help="passes over the batches, in alternating order")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=main_of(run, _print))
