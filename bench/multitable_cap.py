"""Benchmark: a worker's step over 26 tables of one shard, with and without a row cap.

Work: two shards in this process, each with 26 Adagrad tables (dim 16) holding the ids
they are asked for; one sets no ``max_rows``, the other the shard default ``default_max_rows``
(2^26: use bookkeeping for eviction). A step is a lookup and a push of ``ids`` ids per
table as one multi-table message each way (``Shard.lookup_many_sync``/``push_many_sync``,
what a shard serves for a worker's step). Each step runs on both shards back to back,
which first alternating, so drift hits both; the figure is the median over steps of the
capped/uncapped time (1.0: the cap costs nothing). Held ids create no row, so both take
the one-kernel path (:mod:`services.ps.multitable`) when the capped one marks use inside it.

Run: ``python -m bench.multitable_cap [rounds] [ids]``.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import numpy as np

from services.ps.config import PSConfig
from services.ps.shard import Shard
from services.ps.tables import OptimizerConfig, TableConfig

__all__ = ["bench_multitable_cap", "main"]

DIM = 16
TABLES = 26
STEPS = 50  # distinct batches; a round runs each once on both shards
DEFAULT_MAX_ROWS = PSConfig.__dataclass_fields__["default_max_rows"].default


def _shard(max_rows: int | None) -> Shard:
    adagrad = OptimizerConfig(kind="adagrad", lr=0.05)
    return Shard(PSConfig(tables=[
        TableConfig(name=f"t{k:02d}", dim=DIM, optimizer=adagrad, max_rows=max_rows)
        for k in range(TABLES)]))


def _step_s(shard: Shard, names: list[str], counts: list[int], ids: np.ndarray,
            grads: np.ndarray) -> float:
    start = time.perf_counter()
    shard.lookup_many_sync(names, counts, ids)
    shard.push_many_sync(names, counts, ids, grads)
    return time.perf_counter() - start


def bench_multitable_cap(rounds: int = 7, ids: int = 512, seed: int = 0) -> dict[str, Any]:
    """Median step ms of the uncapped and the capped shard, and the median of their paired
    ratios (each step run on both shards back to back, which first alternating)."""
    rng = np.random.default_rng(seed)
    names = [f"t{k:02d}" for k in range(TABLES)]
    counts = [ids] * TABLES
    batches = [(rng.integers(0, 4 * ids, size=ids * TABLES, dtype=np.uint64),
                rng.standard_normal((ids * TABLES, DIM)).astype(np.float32) * 1e-3)
               for _ in range(STEPS)]
    held = np.tile(np.arange(4 * ids, dtype=np.uint64), TABLES)
    shards = {"uncapped": _shard(None), "capped": _shard(DEFAULT_MAX_ROWS)}
    try:
        for shard in shards.values():
            shard.lookup_many_sync(names, [4 * ids] * TABLES, held)  # every row created
            for batch in batches[:3]:
                _step_s(shard, names, counts, *batch)  # kernels warm
        times: dict[str, list[float]] = {name: [] for name in shards}
        for step in range(rounds * STEPS):
            order = list(shards) if step % 2 == 0 else list(shards)[::-1]
            for name in order:
                times[name].append(_step_s(shards[name], names, counts,
                                           *batches[step % STEPS]))
        plain = [shard.table("t00").plain_view() is not None for shard in shards.values()]
    finally:
        for shard in shards.values():
            shard.close()
    return {"tables": TABLES, "ids_per_table": ids, "steps": rounds * STEPS,
            "uncapped_ms": 1e3 * statistics.median(times["uncapped"]),
            "capped_ms": 1e3 * statistics.median(times["capped"]),
            "capped_vs_uncapped": statistics.median(
                c / u for c, u in zip(times["capped"], times["uncapped"], strict=True)),
            "both_plain": all(plain)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    rounds = int(args[0]) if args else 7
    ids = int(args[1]) if len(args) > 1 else 512
    r = bench_multitable_cap(rounds, ids)
    print(f"{'tables':>6} {'ids/table':>9} {'steps':>6} {'uncapped ms':>12} "
          f"{'capped ms':>10} {'capped/uncapped':>16} {'both one-kernel':>16}")
    print(f"{r['tables']:>6} {r['ids_per_table']:>9} {r['steps']:>6} {r['uncapped_ms']:>12.3f} "
          f"{r['capped_ms']:>10.3f} {r['capped_vs_uncapped']:>16.3f} {r['both_plain']!s:>16}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
