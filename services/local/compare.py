"""Several trainer configs side by side on one local cluster, measured in one run.

:func:`train_configs` forks ``workers`` gloo ranks once and trains each
:class:`~services.worker.config.TrainerConfig` in turn on the same planted batches against
local PS shard processes, on fresh tables each time; the benchmarks of sync strategies,
staleness bounds and compression, and the sync strategies' integration test, compare configs
this way.

:data:`PLANTED` is planted data whose oracle AUC is reachable from a few ten thousand rows (4
features, vocabularies of 10-50 ids), so a config that trains worse shows as a gap to the
oracle rather than drowning in the finite-sample gap of large vocabularies (with the default
``SyntheticConfig`` even a tuned logistic regression on the one-hot ids stays 0.02 below the
oracle at 32k rows). :data:`TRAINING` and :data:`STRATEGY_SETTINGS` are the settings the
strategies are compared with.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from services.common.batch import Batch
from services.loader.planted import SyntheticConfig, SyntheticDataset
from services.local.processes import LocalPS
from services.worker.config import TrainerConfig, ps_table_configs
from services.worker.distributed import run_local_ranks
from services.worker.models import ModelConfig
from services.worker.service import summary_dict
from services.worker.trainer import Trainer

__all__ = ["PLANTED", "STRATEGY_SETTINGS", "TRAINING", "train_configs"]

_WARMUP_STEPS = 4

# Planted data whose oracle is reachable from small samples (see the module docstring); every
# teacher setting is spelled out so that changes to the defaults do not move these figures.
PLANTED = SyntheticConfig(seed=0, vocab_sizes=[10, 20, 30, 50], num_multi_hot=1, num_dense=2,
                          mean_multi_hot_length=3.0, max_multi_hot_length=8,
                          zipf_exponent=2.0, interaction_rank=4, weight_scale=1.0,
                          interaction_scale=0.2, dense_scale=0.5, bias=-1.0)
# Mean pooling matches the teacher (it averages a multi-hot feature's ids); lr 1e-2 because a
# short run gives the dense net only tens of Adam steps; mode "sync" because every batch
# reads the same few hot rows, where embedding staleness would blur the dense comparison.
TRAINING = TrainerConfig(mode="sync", lr=1e-2, pooling="mean")
STRATEGY_SETTINGS: dict[str, dict[str, Any]] = {
    "allreduce": {},
    "local_sgd": {"sync_period": 8},
    "ds_sync": {"sync_group_size": 2},
    "shadow": {},
    "gossip": {"gossip_topology": "ring"},
    "hierarchical": {"ranks_per_node": 2},
    "sfb": {},
}  # not gadmm: it is for convex models (bench sync --gadmm), these runs train a DLRM


async def _train_one(rank: int, world: int, addresses: list[str], tables: dict[str, str],
                     config: TrainerConfig, model: ModelConfig, train: list[Batch],
                     test: list[Batch], slow: float = 1.0) -> dict[str, Any]:
    """Rank ``rank``'s run; rank 0's steps take ``slow`` times as long (a sleep after each);
    rank 0's summary holds the PS's counts of the run's lookups (``ps_staleness``)."""
    async with Trainer(model=model, ps_addresses=addresses, tables=tables,
                       config=config) as trainer:
        if rank == 0 and slow > 1:
            trainer.after_step = _slowed(slow)
        summary = summary_dict(await trainer.fit(train[rank::world],
                                                 eval_batches=test[rank::world]))
        if rank == 0 and trainer.ps is not None:
            shards = await trainer.ps.stats()
            counts = [t for shard in shards for name, t in shard.tables.items()
                      if name in tables.values()]
            summary["ps_staleness"] = {
                "global_staleness_max": max((t.global_staleness_max for t in counts), default=0),
                "own_staleness_max": max((t.own_staleness_max for t in counts), default=0),
                "total_staleness_max": max((t.total_staleness_max for t in counts), default=0)}
        return summary


def _slowed(slow: float) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """An ``after_step`` that makes each step last ``slow`` times as long."""
    last = [time.perf_counter()]

    async def after_step(info: dict[str, Any]) -> None:
        await asyncio.sleep((slow - 1) * (time.perf_counter() - last[0]))
        last[0] = time.perf_counter()
    return after_step


async def _train_all(rank: int, world: int, addresses: list[str], features: list[str],
                     configs: list[TrainerConfig], model: ModelConfig, train: list[Batch],
                     test: list[Batch], slow: float = 1.0) -> list[dict[str, Any]]:
    warm = train[:_WARMUP_STEPS * world]
    await _train_one(rank, world, addresses, {f: f"warm_{f}" for f in features}, TRAINING,
                     model, warm, warm)
    return [await _train_one(rank, world, addresses, {f: f"r{k}_{f}" for f in features},
                             config, model, train, test, slow)
            for k, config in enumerate(configs)]


def _rank_runs(rank: int, world: int, *args: Any) -> list[dict[str, Any]]:
    """One rank, one event loop: a short untimed warm-up (first-call costs of torch, gloo and
    the PS's compiled loops), then every config in turn, each on fresh PS tables (``r<k>_``)."""
    return asyncio.run(_train_all(rank, world, *args))


def train_configs(configs: Sequence[TrainerConfig], *, rows: int, batch_size: int = 128,
                  eval_rows: int = 16_384, workers: int = 4, data: SyntheticConfig = PLANTED,
                  model: ModelConfig | None = None, dim: int = 16, ps_lr: float = 0.05,
                  shards: int = 2, timeout_s: float = 600.0, slow: float = 1.0
                  ) -> tuple[list[dict[str, Any]], float]:
    """Train each config on the same planted batches with ``workers`` gloo ranks (forked once)
    against ``shards`` PS processes (fresh tables per config); returns rank 0's summary per config (``samples_per_s``
    summed over the ranks) and the oracle AUC of the held-out rows. ``slow``: rank 0's
    steps take that many times as long (a worker slower than the others)."""
    dataset = SyntheticDataset(data)
    train = list(dataset.batches(batch_size, rows))
    test = list(dataset.batches(4096, eval_rows, "test"))
    features = dataset.config.sparse_names
    model = model or ModelConfig(name="dlrm")
    prefixes = ["warm_", *(f"r{k}_" for k in range(len(configs)))]
    first, *rest = [ps_table_configs({f: model.table_dim(dim) for f in features}, prefix=p,
                                     lr=ps_lr) for p in prefixes]
    with LocalPS(shards, first) as ps:  # the others once up (LocalPS.create_tables: why)
        ps.create_tables([t for tables in rest for t in tables])
        per_rank = run_local_ranks(_rank_runs, workers, ps.addresses, features, list(configs),
                                   model, train, test, slow,
                                   timeout_s=timeout_s)
    summaries = []
    for k in range(len(configs)):
        summary = dict(per_rank[0][k])
        summary["samples_per_s"] = sum(r[k]["samples_per_s"] for r in per_rank)
        summaries.append(summary)
    return summaries, dataset.oracle(eval_rows)["auc"]
