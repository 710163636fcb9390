"""The builder of a worker's embedding side: :func:`connect` makes every object it owns.

:func:`connect` reaches the rows (a :class:`PSClient` to the PS's addresses or a registry's
shards, with ``ps_process`` a :class:`PSClientProcess` carrying the bulk traffic while the hot
chain keeps the PSClient as a lane of its own; or a given
:class:`~services.worker.embedding.rows.RowsClient`, e.g. the PS's shards in this process),
sizes the window where the staleness is ``auto`` (:mod:`services.worker.embedding.window`),
and builds the :class:`~services.worker.embedding.pipeline.EmbeddingPipeline` over them with
everything in its constructor: the rows, the chain's lane, the replica of the head rows and
the collectives across the workers (:mod:`services.worker.embedding.collectives`). The
:class:`EmbeddingLink` it returns owns them and closes what it opened.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from clients.ps_client import PSClient
from clients.ps_process import PSClientProcess
from services.common.errors import ConfigError
from services.worker.config import TrainerConfig
from services.worker.distributed import several_ranks
from services.worker.embedding.bound import staleness_bound
from services.worker.embedding.collectives import global_barrier, head_vote, step_gate
from services.worker.embedding.exchange import StepTimers, embedding_path
from services.worker.embedding.pipeline import EmbeddingPipeline
from services.worker.embedding.rows import RowsCapabilities, RowsClient, RowsReplica
from services.worker.embedding.window import WindowChoice, WindowTuner, choose_window

__all__ = ["EmbeddingLink", "check_rows_source", "connect"]

log = logging.getLogger("persimmon.worker.embedding")


class EmbeddingLink:
    """A connected embedding side: the ``pipeline`` over its rows client, the ``ps`` client
    it opened (None with a given rows client), the PS client ``process`` (None without
    ``ps_process``), what ``staleness auto`` chose (``window_choice``) and what the rows can
    do (``capabilities``). Made by :func:`connect`."""

    def __init__(self, pipeline: EmbeddingPipeline, *, ps: PSClient | None,
                 process: PSClientProcess | None, window_choice: WindowChoice | None) -> None:
        self.pipeline, self.ps, self.process = pipeline, ps, process
        self.window_choice = window_choice
        self.capabilities = RowsCapabilities.of(pipeline.rows)

    @property
    def rows(self) -> RowsClient:
        """The rows client the steps and evaluations use."""
        return self.pipeline.rows

    async def close(self) -> None:
        """Close what :func:`connect` opened (a given rows client is its owner's to close)."""
        if self.process is not None:
            await self.process.close()
        if self.ps is not None:
            await self.ps.close()


def check_rows_source(config: TrainerConfig, *, ps_addresses: Sequence[str],
                      rows_client: RowsClient | None) -> None:
    """A ConfigError unless exactly one way to the rows is given: a rows client, or PS
    addresses (or a registry)."""
    if rows_client is not None:
        if not isinstance(rows_client, RowsClient):
            raise ConfigError(f"rows_client must be a RowsClient, got {type(rows_client)}")
        if ps_addresses or config.registry or config.ps_process:
            raise ConfigError("give a rows_client or PS addresses (registry, ps_process), "
                              "not both")
    elif not ps_addresses and not config.registry:
        raise ConfigError("ps_addresses must list at least one PS shard "
                          "(or set a registry, or give a rows_client)")


def _ps_options(config: TrainerConfig) -> dict[str, Any]:
    return dict(rows_codec=config.rows_codec, timeout=config.timeout_s,
                grads_codec=config.grads_codec, retry_s=config.ps_retry_s)


async def _chosen_window(rows: RowsClient) -> WindowChoice:
    """``staleness auto``: the window that hides the measured round trip to the rows, the
    same on every rank (rank 0's choice)."""
    choice = await choose_window(rows)
    if several_ranks():
        shared = [choice]
        dist.broadcast_object_list(shared, src=0)
        choice = shared[0]
    log.info("staleness auto: window %d (%s)", choice.window, choice.reason)
    return choice


async def connect(config: TrainerConfig, *, ps_addresses: Sequence[str] = (),
                  rows_client: RowsClient | None = None,
                  tables: Mapping[str, str] | None = None, timers: StepTimers | None = None,
                  worker: int = 0, workers: int = 1,
                  head_replica: RowsReplica | None = None) -> EmbeddingLink:
    """The embedding side of rank ``worker`` of ``workers``, configured by ``config``,
    connected (see the module doc). With more than one rank every rank calls it."""
    check_rows_source(config, ps_addresses=ps_addresses, rows_client=rows_client)
    ps: PSClient | None = None
    process: PSClientProcess | None = None
    try:
        if rows_client is None:
            ps = (PSClient.from_registry(config.registry, **_ps_options(config))
                  if config.registry else PSClient(list(ps_addresses), **_ps_options(config)))
            await ps.connect()
            if config.ps_process:
                process = await PSClientProcess(ps.addresses, registry=config.registry,
                                                **_ps_options(config)).connect()
        rows: RowsClient = process or ps or rows_client  # type: ignore[assignment]
        choice = await _chosen_window(rows) if config.auto_window else None
        pipeline = _pipeline(config, rows, chain_rows=ps if process is not None else None,
                             window=choice.window if choice is not None else config.window,
                             tables=tables, timers=timers, worker=worker, workers=workers,
                             replica=head_replica,
                             tuner=(WindowTuner(choice, most=config.window or 1)
                                    if choice is not None and choice.round_trip_ms > 0
                                    and workers == 1 else None))
        pipeline.check_tables()
        _log_bound(config, pipeline, workers)
    except BaseException:
        if process is not None:
            await process.close()
        if ps is not None:
            await ps.close()
        raise
    return EmbeddingLink(pipeline, ps=ps, process=process, window_choice=choice)


def _log_bound(config: TrainerConfig, pipeline: EmbeddingPipeline, workers: int) -> None:
    """Say what the run's lookups may miss (async: that nothing bounds them)."""
    bound = staleness_bound(config.mode, workers=workers, global_bound=config.global_bound,
                            window=(pipeline.tuner.most if pipeline.tuner is not None
                                    else pipeline.window))
    log.info("staleness bound: %s", bound.describe() if bound is not None else
             f"none (mode async: lookups run up to {config.prefetch} batches ahead, pushes "
             "are never waited for, no step gate, no head ids)")


def _pipeline(config: TrainerConfig, rows: RowsClient, *, chain_rows: RowsClient | None,
              window: int | None, tables: Mapping[str, str] | None, timers: StepTimers | None,
              worker: int, workers: int, replica: RowsReplica | None,
              tuner: WindowTuner | None) -> EmbeddingPipeline:
    cfg = config
    hybrid = cfg.mode == "hybrid"
    return EmbeddingPipeline(
        rows, chain_rows=chain_rows, window=window, prefetch=cfg.prefetch, tables=tables,
        timers=timers, hot_ratio=cfg.hot_ratio or None, hot_window=cfg.hot_staleness,
        worker=worker, workers=workers,
        barrier=global_barrier() if cfg.mode == "global_sync" else None,
        path=embedding_path(cfg.embedding_path, cfg.pooling,
                            keep=cfg.activation_keep if cfg.embedding_path == "des" else 1.0),
        head_rate=cfg.head_rate or None,
        hot_barrier=global_barrier() if hybrid and cfg.global_hot else None,
        step_gate=(step_gate()
                   if cfg.mode in ("sync", "hybrid") and cfg.global_bound else None),
        head_vote=head_vote(workers) if hybrid and cfg.head_rate else None,
        replica=replica, tuner=tuner)
