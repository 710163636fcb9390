"""Benchmark: what idempotent pushes cost a PS shard, with and without the check, same run.

Work: one shard (one Adagrad table, dim 16) applies pushes of ``batch`` unique ids through
``Shard.push_many_sync``, once with an origin (client id, sequence number: the fingerprint of
the push, the window's claim and commit; every push over the wire takes this path) and once
without (the in-process path, which skips the check). The two are interleaved round by round
on the same batches so drift hits both; the figure is the median over rounds of with/without
(1.0: free). The wire and the client are the same either way but for two ints per message.

Run: ``python -m bench.push_dedup [seconds]``.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from typing import Any

import numpy as np

from services.ps.config import PSConfig
from services.ps.dedup import PushOrigin
from services.ps.shard import Shard
from services.ps.tables import OptimizerConfig, TableConfig

__all__ = ["bench_push_dedup", "main"]

DIM = 16
UNIVERSE = 2_000_000


def _rows_per_s(shard: Shard, batches: list[tuple[np.ndarray, np.ndarray]],
                seqs: itertools.count[int] | None) -> float:
    start = time.perf_counter()
    rows = 0
    for ids, grads in batches:
        origin = None if seqs is None else PushOrigin(7, next(seqs))
        rows += shard.push_many_sync(["emb"], [ids.size], ids, grads, origin=origin).applied
    return rows / (time.perf_counter() - start)


def bench_push_dedup(batch: int = 65_536, seconds: float = 4.0, seed: int = 0) -> dict[str, Any]:
    """Push rows/s with and without the check, and their median ratio over rounds."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(8):
        ids = np.unique(rng.integers(0, UNIVERSE, size=batch, dtype=np.uint64))
        batches.append((ids, rng.standard_normal((ids.size, DIM)).astype(np.float32)))
    shard = Shard(PSConfig(tables=[TableConfig(
        name="emb", dim=DIM, initial_capacity=8 * batch,
        optimizer=OptimizerConfig(kind="adagrad", lr=0.05))]))
    seqs = itertools.count(1)
    _rows_per_s(shard, batches, None)  # rows created, kernels warm
    _rows_per_s(shard, batches, seqs)
    with_check, without, ratios = [], [], []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(ratios) < 3:
        a = _rows_per_s(shard, batches, None)
        b = _rows_per_s(shard, batches, seqs)
        without.append(a)
        with_check.append(b)
        ratios.append(b / a)
    last = next(seqs) - len(batches)  # the numbers of the last round, retried
    rows = shard.table("emb").lookup(batches[0][0])
    retry = time.perf_counter()
    for i, (ids, grads) in enumerate(batches):  # answered from the window, not applied
        shard.push_many_sync(["emb"], [ids.size], ids, grads, origin=PushOrigin(7, last + i))
    retry_s = (time.perf_counter() - retry) / len(batches)
    if not np.array_equal(shard.table("emb").lookup(batches[0][0]), rows):
        raise RuntimeError("a retried push changed the rows")
    return {"batch_ids": batch, "rounds": len(ratios),
            "rows_per_s_with_check": statistics.median(with_check),
            "rows_per_s_without": statistics.median(without),
            "ratio": statistics.median(ratios),
            "retry_answer_ms": 1e3 * retry_s}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    seconds = float(args[0]) if args else 4.0
    print(f"{'ids/push':>9} {'rounds':>6} {'with check rows/s':>18} {'without rows/s':>15} "
          f"{'ratio':>6} {'retry answered':>15}")
    for batch in (65_536, 4_096, 256):
        r = bench_push_dedup(batch, seconds)
        print(f"{batch:>9,} {r['rounds']:>6} {r['rows_per_s_with_check']:>18,.0f} "
              f"{r['rows_per_s_without']:>15,.0f} {r['ratio']:>6.3f} "
              f"{r['retry_answer_ms']:>12.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
