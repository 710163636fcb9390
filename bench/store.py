"""Benchmark: the PS EmbeddingTable against a plain Python dict store, same work, same run.

Work: a batch of ``num_ids`` distinct ids, half of them already stored (pre-populated,
untimed), is looked up (creating the missing half) and then receives one Adagrad push of
``(num_ids, dim)`` gradients. The table is configured as a server would be for that many
rows (``initial_capacity=num_ids``: its arena is allocated when the table is built, untimed);
growth is measured separately as ``store_growing_s`` (``initial_capacity`` left at its
default). The baseline is what one writes naturally: a dict id → numpy row, a dict id →
accumulator, a Python loop per id (duplicates summed, non-finite dropped).

Run: ``python -m bench.store [num_ids] [dim]``.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import numpy as np

from services.ps.store import EmbeddingTable
from services.ps.tables import OptimizerConfig, TableConfig

__all__ = ["bench_store", "main"]

LR = 0.05
EPS = 1e-8


def _config(dim: int, seed: int, capacity: int = 1024) -> TableConfig:
    return TableConfig(name="bench", dim=dim, seed=seed, initial_capacity=capacity,
                       optimizer=OptimizerConfig(kind="adagrad", lr=LR, eps=EPS))


def _workload(num_ids: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(0, 2**63, size=int(num_ids * 1.01) + 16, dtype=np.uint64))
    ids = rng.permutation(ids)[:num_ids]
    known = ids[rng.permutation(num_ids)[:num_ids // 2]]
    grads = rng.standard_normal((num_ids, dim), dtype=np.float32)
    return ids, known, grads


def _warm_up(dim: int) -> None:
    """Load or compile every numba kernel the timed part uses."""
    table = EmbeddingTable(_config(dim, 0))
    ids = np.arange(64, dtype=np.uint64)
    table.lookup(ids[:32])
    table.lookup(ids)
    table.push(ids, np.ones((64, dim), dtype=np.float32))


def _time_store(config: TableConfig, ids: np.ndarray, known: np.ndarray,
                grads: np.ndarray) -> tuple[float, float, float]:
    """(lookup s, push s, max |error| of the pushed rows against the Adagrad formula)."""
    table = EmbeddingTable(config)
    table.lookup(known)  # pre-populate, untimed
    t0 = time.perf_counter()
    rows = table.lookup(ids)
    t1 = time.perf_counter()
    table.push(ids, grads)
    t2 = time.perf_counter()
    expected = rows - np.float32(LR) * grads / (np.sqrt(grads * grads) + np.float32(EPS))
    del rows
    error = float(np.abs(table.peek(ids)[0] - expected).max())
    return t1 - t0, t2 - t1, error


def _time_dict(ids: np.ndarray, known: np.ndarray, grads: np.ndarray, dim: int,
               seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    rows: dict[int, np.ndarray] = {}
    accum: dict[int, np.ndarray] = {}
    for i in known.tolist():  # pre-populate, untimed
        rows[i] = rng.uniform(-0.01, 0.01, dim).astype(np.float32)
        accum[i] = np.zeros(dim, dtype=np.float32)
    t0 = time.perf_counter()
    id_list = ids.tolist()
    out = np.empty((len(id_list), dim), dtype=np.float32)
    for j, i in enumerate(id_list):
        row = rows.get(i)
        if row is None:
            row = rng.uniform(-0.01, 0.01, dim).astype(np.float32)
            rows[i] = row
            accum[i] = np.zeros(dim, dtype=np.float32)
        out[j] = row
    t1 = time.perf_counter()
    summed: dict[int, np.ndarray] = {}
    for i, g in zip(id_list, grads, strict=True):
        prev = summed.get(i)
        summed[i] = g.copy() if prev is None else prev + g
    for i, g in summed.items():
        if not np.isfinite(g).all():
            continue
        acc = accum[i]
        acc += g * g
        rows[i] -= np.float32(LR) * g / (np.sqrt(acc) + np.float32(EPS))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def bench_store(num_ids: int = 1_000_000, dim: int = 16, seed: int = 0,
                repeats: int = 3) -> dict[str, Any]:
    """Seconds for lookup + Adagrad push of ``num_ids`` ids (half new), store vs dict.

    After a small run that loads the compiled kernels, the store runs ``1 + repeats`` times
    on fresh pre-sized tables: the first full-size run is reported as ``store_first_s`` (it
    also pays the process's first page faults of that much memory), the median of the
    others as ``store_s``; ``store_growing_s`` is the median of ``repeats`` runs on tables
    that start at the default capacity and grow while timed. The dict runs once, after the
    store. ``max_abs_err`` checks every run's pushed rows against the Adagrad formula.
    """
    ids, known, grads = _workload(num_ids, dim, seed)
    config = _config(dim, seed, capacity=num_ids)
    _warm_up(dim)
    runs = [_time_store(config, ids, known, grads) for _ in range(1 + max(1, repeats))]
    first_s = runs[0][0] + runs[0][1]
    growing = [_time_store(_config(dim, seed), ids, known, grads) for _ in range(max(1, repeats))]
    growing_s = statistics.median(r[0] + r[1] for r in growing)
    del growing
    lookup_s = statistics.median(r[0] for r in runs[1:])
    push_s = statistics.median(r[1] for r in runs[1:])
    error = max(r[2] for r in runs)
    dict_lookup_s, dict_push_s = _time_dict(ids, known, grads, dim, seed)
    store_s = lookup_s + push_s
    dict_s = dict_lookup_s + dict_push_s
    return {
        "num_ids": num_ids,
        "dim": dim,
        "store_s": store_s,
        "store_lookup_s": lookup_s,
        "store_push_s": push_s,
        "store_first_s": first_s,
        "store_growing_s": growing_s,
        "dict_s": dict_s,
        "dict_lookup_s": dict_lookup_s,
        "dict_push_s": dict_push_s,
        "store_vs_dict": dict_s / store_s,
        "store_first_vs_dict": dict_s / first_s,
        "store_ids_per_s": 2 * num_ids / store_s,
        "dict_ids_per_s": 2 * num_ids / dict_s,
        "max_abs_err": error,
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    num_ids = int(argv[0]) if argv else 1_000_000
    dim = int(argv[1]) if len(argv) > 1 else 16
    r = bench_store(num_ids=num_ids, dim=dim)
    print(f"store benchmark: {num_ids:,} ids (half new), dim {dim}, lookup + Adagrad push")
    print(f"{'':14}{'lookup s':>10}{'push s':>10}{'total s':>10}{'ids/s':>14}")
    print(f"{'EmbeddingTable':14}{r['store_lookup_s']:>10.3f}{r['store_push_s']:>10.3f}"
          f"{r['store_s']:>10.3f}{r['store_ids_per_s']:>14,.0f}")
    print(f"{'python dict':14}{r['dict_lookup_s']:>10.3f}{r['dict_push_s']:>10.3f}"
          f"{r['dict_s']:>10.3f}{r['dict_ids_per_s']:>14,.0f}")
    print(f"{'  first run':14}{'':>20}{r['store_first_s']:>10.3f}")
    print(f"{'  growing':14}{'':>20}{r['store_growing_s']:>10.3f}   (arena grown from 1024 rows)")
    print(f"store_vs_dict = {r['store_vs_dict']:.1f}x (first full-size run: "
          f"{r['store_first_vs_dict']:.1f}x); max |err| vs the Adagrad formula "
          f"{r['max_abs_err']:.2e}")


if __name__ == "__main__":
    main()
