"""Train on this machine: N local worker processes (gloo) against a running PS.

:func:`run_local_training` is what ``persimmon demo`` and ``persimmon train`` call once the PS
shards (and loaders) are up. Training batches come from a loader service (``loader``: its
address; rank r gets batches ``b % num_workers == r`` and acks each once the PS acknowledged
its push) or from a list (batch ``b`` to worker ``b % num_workers``). Held-out batches come
from an eval loader (each rank reads its share once and keeps it) or a list split the same
way; AUC/logloss are computed over all ranks' shares. Validation batches (the best state's
selection, :mod:`services.worker.best`) come from a validation loader the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from clients.loader_client import LoaderClient
from services.common.batch import Batch, RankBatches, iterate
from services.common.errors import ConfigError
from services.worker.config import TrainerConfig
from services.worker.distributed import run_local_ranks
from services.worker.embedding.rows import RowsClient, RowsReplica
from services.worker.models import ModelConfig
from services.worker.trainer import Trainer

__all__ = ["read_loader", "run_local_training"]


async def read_loader(address: str, rank: int, world: int) -> list[Batch]:
    """Every batch the loader at ``address`` has for ``rank`` (acked as they arrive)."""
    out: list[Batch] = []
    async with LoaderClient(address, rank=rank, world_size=world, credits=16) as loader:
        async for batch in loader.batches():
            out.append(batch)
            await loader.ack(batch)
    return out


Source = Sequence[Batch] | str | RankBatches  # batches, a loader's address, or read by rank


async def _held_out(source: Source | None, rank: int, world: int) -> list[Batch] | None:
    """This rank's share of held-out batches, read once."""
    if source is None:
        return None
    if isinstance(source, str):
        return await read_loader(source, rank, world)
    if isinstance(source, RankBatches):
        return [b async for b in iterate(source.for_rank(rank, world))]
    return list(source)


async def _train(rank: int, world: int, ps_addresses: Sequence[str],
                 tables: Mapping[str, str] | None, model: ModelConfig, config: TrainerConfig,
                 train: Source, test: Source | None,
                 on_step: Callable[[dict[str, Any]], None] | None,
                 attach: Callable[[Trainer], object] | None = None,
                 rows_client: RowsClient | None = None, validation: Source | None = None,
                 head_replica: RowsReplica | None = None) -> dict[str, Any]:
    """One rank: ``train``/``test``/``validation`` are this rank's batches, a loader
    address, or a :class:`RankBatches` this rank reads its share of; ``attach(trainer)``
    runs on rank 0 before training."""
    held_out = await _held_out(test, rank, world)
    checks = await _held_out(validation, rank, world)
    async with Trainer(model=model, ps_addresses=ps_addresses, tables=tables, config=config,
                       on_step=on_step, rows_client=rows_client,
                       head_replica=head_replica) as trainer:
        if attach is not None and rank == 0:
            attach(trainer)
        if isinstance(train, str):
            credits = (config.window or config.prefetch) + 2
            async with LoaderClient(train, rank=rank, world_size=world,
                                    credits=credits) as loader:
                summary = await trainer.fit(loader, eval_batches=held_out,
                                            validation_batches=checks)
        else:
            batches = train.for_rank(rank, world) if isinstance(train, RankBatches) else train
            summary = await trainer.fit(batches, eval_batches=held_out,
                                        validation_batches=checks)
        return summary.as_dict()


def _share(batches: Source | None, rank: int, world: int) -> Source | None:
    if batches is None or isinstance(batches, str | RankBatches):
        return batches
    return list(batches[rank::world])


def _rank(rank: int, world: int, ps_addresses: Sequence[str], tables: Mapping[str, str] | None,
          model: ModelConfig, config: TrainerConfig, train: Source, test: Source | None,
          attach: Callable[[Trainer], object] | None, validation: Source | None
          ) -> dict[str, Any]:
    return asyncio.run(_train(rank, world, ps_addresses, tables, model, config,
                              _share(train, rank, world) or [], _share(test, rank, world), None,
                              attach, validation=validation))


def run_local_training(*, ps_addresses: Sequence[str] = (),
                       rows_client: RowsClient | None = None,
                       train_batches: Sequence[Batch] | RankBatches | None = None,
                       loader: str | None = None,
                       eval_batches: Sequence[Batch] | RankBatches | None = None,
                       eval_loader: str | None = None,
                       validation_loader: str | RankBatches | None = None,
                       tables: Mapping[str, str] | None = None,
                       model: ModelConfig | None = None, config: TrainerConfig | None = None,
                       num_workers: int = 1, timeout_s: float = 600.0,
                       on_step: Callable[[dict[str, Any]], None] | None = None,
                       attach: Callable[[Trainer], object] | None = None,
                       head_replica: RowsReplica | None = None) -> dict[str, Any]:
    """Train and return rank 0's summary (:meth:`FitSummary.as_dict`), with ``samples_per_s`` and
    ``wire_bytes`` summed over the workers and ``num_workers`` added. Give ``train_batches`` (a
    list, or :class:`RankBatches` each rank reads its share of) or ``loader`` (an address), and
    optionally ``eval_batches`` or ``eval_loader``, and ``validation_loader`` (an address or
    RankBatches).
    ``on_step`` runs only with one worker (in this process); with more, workers are forked
    processes joined by a gloo group.
    ``attach(trainer)`` runs on rank 0 before training (it must pickle: model exports).
    ``rows_client`` (one worker only): reach the rows through it instead of ``ps_addresses``
    (e.g. the PS's shards in this process); ``head_replica`` (one worker only): the worker's
    copy of its head rows (:class:`~services.worker.trainer.Trainer`)."""
    if num_workers < 1:
        raise ConfigError(f"num_workers must be >= 1, got {num_workers}")
    if (rows_client is not None or head_replica is not None) and num_workers != 1:
        raise ConfigError("a rows_client or a head replica serves one worker (this process); "
                          f"got num_workers={num_workers}")
    if (train_batches is None) == (loader is None):
        raise ConfigError("give either train_batches or a loader address")
    if eval_batches is not None and eval_loader is not None:
        raise ConfigError("give eval_batches or an eval_loader address, not both")
    if isinstance(train_batches, Sequence) and len(train_batches) < num_workers:
        raise ConfigError(f"{len(train_batches)} training batches cannot feed "
                          f"{num_workers} workers")
    model = model or ModelConfig()
    config = config or TrainerConfig()
    train: Source = loader if loader is not None else (
        train_batches if isinstance(train_batches, RankBatches) else list(train_batches or []))
    test: Source | None = eval_loader if eval_loader is not None else eval_batches
    if num_workers == 1:
        summary = asyncio.run(_train(0, 1, ps_addresses, tables, model, config, train, test,
                                     on_step, attach, rows_client, validation_loader,
                                     head_replica))
        summary["num_workers"] = 1
        return summary
    results = run_local_ranks(_rank, num_workers, list(ps_addresses), tables, model, config,
                              train, test, attach, validation_loader, backend="gloo",
                              timeout_s=timeout_s)
    summary = dict(results[0])
    summary["num_workers"] = num_workers
    summary["samples"] = sum(r["samples"] for r in results)
    summary["samples_per_s"] = sum(r["samples_per_s"] for r in results)
    summary["staleness_max"] = max(r["staleness_max"] for r in results)
    summary["wire_bytes"] = {k: sum(r["wire_bytes"][k] for r in results)
                             for k in results[0]["wire_bytes"]}
    return summary
