"""The trainer's way to the embedding rows: its PS client and the pipeline over it.

A :class:`RowsLink` owns what a :class:`~services.worker.trainer.Trainer` reaches the rows
through: a :class:`PSClient` to the PS's addresses (or the shards of a registry), or a given
:class:`clients.rows.RowsClient` (e.g. the PS's shards in this process); with ``ps_process``,
a :class:`PSClientProcess` carrying the bulk traffic while the hot chain keeps the PSClient;
and the :class:`~services.worker.pipeline.EmbeddingPipeline` over them, whose window
``staleness auto`` sizes at :meth:`RowsLink.connect` (:mod:`services.worker.window`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from clients.ps_client import PSClient
from clients.ps_process import PSClientProcess
from clients.rows import RowsClient, RowsReplica
from services.common.errors import ConfigError, FailedPrecondition
from services.worker.compute import distributed, every_rank_has_a_batch
from services.worker.config import TrainerConfig
from services.worker.exchange import embedding_path
from services.worker.head_vote import Ballot, vote
from services.worker.pipeline import EmbeddingPipeline, StepTimers
from services.worker.window import WindowChoice, choose_window

__all__ = ["RowsLink"]

log = logging.getLogger("persimmon.worker.rows_link")


class RowsLink:
    """The PS client (None with a given ``rows_client``) and the embedding pipeline of rank
    ``worker`` of ``workers``, configured by ``config`` (``head_replica``: the pipeline's
    copy of the head rows, where it can use one)."""

    def __init__(self, config: TrainerConfig, *, ps_addresses: Sequence[str],
                 rows_client: RowsClient | None, tables: Mapping[str, str] | None,
                 timers: StepTimers, worker: int, workers: int,
                 head_replica: RowsReplica | None = None) -> None:
        self.config = config
        self._tables, self._timers, self._worker, self._workers = tables, timers, worker, workers
        self._replica = head_replica
        self.ps = self._ps_client(ps_addresses, rows_client)
        self.window_choice: WindowChoice | None = None  # what staleness auto chose (connect)
        self.pipeline = self._pipeline(
            rows_client if rows_client is not None else self._connected_ps(),
            window=1 if config.auto_window else config.window)
        self.connected = False

    def _ps_client(self, ps_addresses: Sequence[str], rows_client: RowsClient | None
                   ) -> PSClient | None:
        cfg = self.config
        if rows_client is not None:
            if not isinstance(rows_client, RowsClient):
                raise ConfigError(f"rows_client must be a RowsClient, got {type(rows_client)}")
            if ps_addresses or cfg.registry or cfg.ps_process:
                raise ConfigError("give a rows_client or PS addresses (registry, ps_process), "
                                  "not both")
            return None
        if not ps_addresses and not cfg.registry:
            raise ConfigError("ps_addresses must list at least one PS shard "
                              "(or set a registry, or give a rows_client)")
        options = self._ps_options()
        return (PSClient.from_registry(cfg.registry, **options) if cfg.registry
                else PSClient(list(ps_addresses), **options))

    def _ps_options(self) -> dict[str, Any]:
        cfg = self.config
        return dict(rows_codec=cfg.rows_codec, timeout=cfg.timeout_s,
                    grads_codec=cfg.grads_codec, retry_s=cfg.ps_retry_s)

    def _connected_ps(self) -> PSClient:
        if self.ps is None:
            raise FailedPrecondition("this trainer reaches the rows through its rows_client")
        return self.ps

    @staticmethod
    def _global_barrier() -> Callable[[], Awaitable[None]] | None:
        """A wait for every rank, on a gloo group of its own (so that it never interleaves
        with the dense all-reduce); None with one rank."""
        if not distributed():
            return None
        group = dist.new_group(backend="gloo")

        async def barrier() -> None:
            await asyncio.to_thread(dist.barrier, group=group)
        return barrier

    @staticmethod
    def _step_gate() -> Callable[[bool], Awaitable[bool]] | None:
        """The bound across workers: a collective per step on a gloo group of its own, True
        while every rank has a batch for it (None with one rank)."""
        if not distributed():
            return None
        group = dist.new_group(backend="gloo")

        async def gate(has_batch: bool) -> bool:
            return await asyncio.to_thread(every_rank_has_a_batch, has_batch, group)
        return gate

    @staticmethod
    def _head_vote(workers: int) -> Callable[[Ballot], Awaitable[dict[int, np.ndarray]]] | None:
        """One head-id set for the job: the vote's two collectives on a gloo group of its
        own, in a thread (None with one rank)."""
        if not distributed():
            return None
        group = dist.new_group(backend="gloo")

        def gather_now(obj: Any) -> list[Any]:
            out: list[Any] = [None] * workers
            dist.all_gather_object(out, obj, group=group)
            return out

        def add_now(counts: np.ndarray) -> np.ndarray:
            summed = torch.from_numpy(counts.copy())
            dist.all_reduce(summed, group=group)
            return summed.numpy()

        async def gather(obj: Any) -> list[Any]:
            return await asyncio.to_thread(gather_now, obj)

        async def add(counts: np.ndarray) -> np.ndarray:
            return await asyncio.to_thread(add_now, counts)

        async def head_vote(ballot: Ballot) -> dict[int, np.ndarray]:
            return await vote(ballot, workers, gather, add)
        return head_vote

    def _pipeline(self, rows: RowsClient, *, window: int | None) -> EmbeddingPipeline:
        cfg = self.config
        return EmbeddingPipeline(
            rows, window=window, prefetch=cfg.prefetch, tables=self._tables,
            timers=self._timers, hot_ratio=cfg.hot_ratio or None, hot_window=cfg.hot_staleness,
            worker=self._worker, workers=self._workers,
            barrier=self._global_barrier() if cfg.mode == "global_sync" else None,
            path=embedding_path(cfg.embedding_path, cfg.pooling,
                                keep=cfg.activation_keep if cfg.embedding_path == "des" else 1.0),
            head_rate=cfg.head_rate or None,
            hot_barrier=self._global_barrier() if cfg.mode == "hybrid" and cfg.global_hot
            else None,
            step_gate=self._step_gate() if cfg.mode in ("sync", "hybrid") and cfg.global_bound
            else None,
            head_vote=self._head_vote(self._workers) if cfg.mode == "hybrid" and cfg.head_rate
            else None, replica=self._replica)

    async def _size_window(self) -> None:
        """``staleness auto``: the window that hides the measured round trip to the rows,
        the same on every rank (rank 0's choice)."""
        choice = await choose_window(self.pipeline.rows)
        if distributed():
            shared = [choice]
            dist.broadcast_object_list(shared, src=0)
            choice = shared[0]
        self.window_choice = choice
        if choice.window != self.pipeline.window:
            rows, chain_rows = self.pipeline.rows, self.pipeline.chain_rows
            self.pipeline = self._pipeline(rows, window=choice.window)
            self.pipeline.chain_rows = chain_rows
        log.info("staleness auto: window %d (%s)", choice.window, choice.reason)

    async def connect(self) -> None:
        """Connect to the PS (idempotent); with staleness ``auto``, size the window."""
        if self.connected:
            return
        if self.ps is not None:
            await self.ps.connect()
            if self.config.ps_process:
                self.pipeline.rows = await PSClientProcess(
                    self.ps.addresses, registry=self.config.registry,
                    **self._ps_options()).connect()
                self.pipeline.chain_rows = self.ps  # the hot chain's lane of its own
        if self.config.auto_window and self.window_choice is None:
            await self._size_window()
        self.connected = True
        self.pipeline.check_tables()

    async def close(self) -> None:
        """Close what this link opened (a given rows client is its owner's to close)."""
        if not self.connected:
            return
        if self.ps is not None:
            if self.pipeline.rows is not self.ps:
                await self.pipeline.rows.close()
                self.pipeline.rows = self.ps
                self.pipeline.chain_rows = None
            await self.ps.close()
        self.connected = False
