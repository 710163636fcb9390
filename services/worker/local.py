"""Train on this machine: N local worker processes (gloo) against a running PS.

:func:`run_local_training` is what ``persimmon demo`` and ``persimmon train`` call once the PS
shards are up: batch ``b`` of the list goes to worker ``b % num_workers`` (every worker gets
the same number of steps, as DDP needs), held-out batches are split the same way and the
AUC/logloss are computed over all of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.common.batch import Batch
from services.common.errors import ConfigError
from services.worker.config import TrainerConfig
from services.worker.distributed import run_local_ranks
from services.worker.models import ModelConfig
from services.worker.trainer import Trainer

__all__ = ["run_local_training"]


async def _train(ps_addresses: Sequence[str], tables: Mapping[str, str] | None,
                 model: ModelConfig, config: TrainerConfig, train: Sequence[Batch],
                 test: Sequence[Batch] | None,
                 on_step: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
    async with Trainer(model=model, ps_addresses=ps_addresses, tables=tables, config=config,
                       on_step=on_step) as trainer:
        summary = await trainer.fit(train, eval_batches=test)
        summary["history"] = trainer.history
        summary["losses"] = trainer.losses
        return summary


def _rank(rank: int, world: int, ps_addresses: Sequence[str], tables: Mapping[str, str] | None,
          model: ModelConfig, config: TrainerConfig, train: Sequence[Batch],
          test: Sequence[Batch] | None) -> dict[str, Any]:
    steps = len(train) // world
    mine = list(train[rank::world])[:steps]
    my_test = list(test[rank::world]) if test is not None else None
    return asyncio.run(_train(ps_addresses, tables, model, config, mine, my_test, None))


def run_local_training(*, ps_addresses: Sequence[str], train_batches: Sequence[Batch],
                       eval_batches: Sequence[Batch] | None = None,
                       tables: Mapping[str, str] | None = None,
                       model: ModelConfig | None = None, config: TrainerConfig | None = None,
                       num_workers: int = 1, timeout_s: float = 600.0,
                       on_step: Callable[[dict[str, Any]], None] | None = None
                       ) -> dict[str, Any]:
    """Train and return rank 0's summary, with ``samples_per_s`` and ``wire_bytes`` summed over
    the workers and ``num_workers`` added. ``on_step`` runs only with one worker (in this
    process); with more, workers are forked processes joined by a gloo group."""
    if num_workers < 1:
        raise ConfigError(f"num_workers must be >= 1, got {num_workers}")
    if len(train_batches) < num_workers:
        raise ConfigError(f"{len(train_batches)} training batches cannot feed "
                          f"{num_workers} workers")
    model = model or ModelConfig()
    config = config or TrainerConfig()
    if num_workers == 1:
        summary = asyncio.run(_train(ps_addresses, tables, model, config, train_batches,
                                     eval_batches, on_step))
        summary["num_workers"] = 1
        return summary
    results = run_local_ranks(_rank, num_workers, list(ps_addresses), tables, model, config,
                              list(train_batches), eval_batches, backend="gloo",
                              timeout_s=timeout_s)
    summary = dict(results[0])
    summary["num_workers"] = num_workers
    summary["samples"] = sum(r["samples"] for r in results)
    summary["samples_per_s"] = sum(r["samples_per_s"] for r in results)
    summary["staleness_max"] = max(r["staleness_max"] for r in results)
    summary["wire_bytes"] = {k: sum(r["wire_bytes"][k] for r in results)
                             for k in results[0]["wire_bytes"]}
    return summary
