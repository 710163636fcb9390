"""The bound across workers holds under every dense sync strategy: no lookup of any worker
misses more than S pushes of any worker (``global_staleness_max`` <= S), S - 1 of its own.

One group of 4 forked gloo ranks trains every strategy of ``bench staleness --sync`` in turn
(hybrid, window S, every row under it) against a PS shard process over gRPC; rank 0's steps
take 4 times as long as the others' (a sleep after each). The planted data's few ids are in
every batch, so every push touches every table and the PS's count is exact. The count that
summed the workers' misses (now ``total_staleness_max``) read 7 = N·S - 1 here for every
strategy; a gate that let a worker take its slot before the others held theirs of the step
before would let a lookup miss up to 2S - 1 of a worker's pushes (the compute thread's
per-step vote still holds the ranks within a step).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from services.local.compare import STRATEGY_SETTINGS, TRAINING, train_configs
from services.worker.embedding.bound import staleness_bound

WORKERS, S, STEPS, BATCH = 4, 2, 16, 32


@pytest.fixture(scope="module")
def counted() -> dict[str, dict[str, Any]]:
    names = list(STRATEGY_SETTINGS)
    configs = [replace(TRAINING, mode="hybrid", staleness=S, hot_ratio=0.0, head_rate=0.0,
                       sync=name, **STRATEGY_SETTINGS[name]) for name in names]
    summaries, _ = train_configs(configs, rows=WORKERS * STEPS * BATCH, batch_size=BATCH,
                                 eval_rows=WORKERS * 4096, workers=WORKERS, shards=1,
                                 slow=4.0, timeout_s=300)
    return dict(zip(names, summaries, strict=True))


@pytest.mark.parametrize("name", list(STRATEGY_SETTINGS))
def test_no_lookup_misses_more_than_s_pushes_of_any_worker(
        counted: dict[str, dict[str, Any]], name: str) -> None:
    summary = counted[name]
    assert summary["steps"] == STEPS and summary["sync"]["name"] == name
    bound = staleness_bound("hybrid", window=S, workers=WORKERS, global_bound=True)
    assert bound is not None and (bound.own, bound.any_worker) == (S - 1, S)
    ps = summary["ps_staleness"]
    assert ps["own_staleness_max"] <= S - 1, (name, ps)
    assert ps["global_staleness_max"] <= S, (name, ps)
    assert ps["total_staleness_max"] <= WORKERS * S - 1, (name, ps)
