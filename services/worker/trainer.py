"""The Trainer: PERSIA hybrid training of a model whose embeddings live on the PS.
size: one dense replica's state (model, optimizer, sync, step, history), shared by the step,
fit and evaluate; what keeps state of its own lives beside it (dense_exchange, compute).

One step of one batch::

    EmbeddingPipeline: plan_batch (dedup ids per table, laid out by shard) → lookup_sharded
    (one message per shard) → [compute thread] pool_batch → model forward/backward (BCE with
    logits) → dense sync + optimizer step → EmbeddingPipeline: push_sharded of the
    per-unique-row gradients (in the background; ``des``:
    :mod:`services.worker.embedding.exchange`)

The embedding side (staleness slots, riders, lookahead, pushes) is the
:class:`~services.worker.embedding.pipeline.EmbeddingPipeline` of the
:class:`~services.worker.embedding.builder.EmbeddingLink` that
:func:`~services.worker.embedding.builder.connect` builds at :meth:`Trainer.start` (over a PS
client, a PS client process, or any ``rows_client``, e.g. the PS's shards in this process).
Compute runs in a :class:`~services.worker.compute.ComputeThread` so the event loop keeps serving
lookups and pushes meanwhile. The Trainer keeps the dense replica: the model, its optimizer, the
dense sync, ``fit`` and ``evaluate``.

The bound on staleness is a semaphore of ``TrainerConfig.window`` slots: taken before a batch's
lookup, freed when its push is acknowledged (``sync``: 1 slot, so a lookup waits for every earlier
push of its worker, ``global_sync`` of every worker; ``hybrid``: ``max(S, 1)``; ``async``: none).
The staleness of a batch is the number of earlier batches whose push is not yet acknowledged when
its lookup starts; ``fit`` reports the maximum.

Dense replicas synchronise through a :mod:`services.worker.sync` strategy (DDP all-reduce by
default) when a torch.distributed group of more than one rank is initialised. What crosses
between them through codecs (``dense_codec``, the 1-bit optimizers, the adaquant loss, DCT-MP
activations) and its bytes is the :class:`~services.worker.dense_exchange.DenseExchange` the
Trainer makes from its config and asks at each point.

Usage::

    async with Trainer(model=ModelConfig(name="dlrm"), ps_addresses=addrs,
                       tables={"C1": "C1", ...}, mode="hybrid", staleness=8) as trainer:
        summary = await trainer.fit(train_batches, eval_batches=test_batches)
        print(summary.auc, summary.samples_per_s)
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from clients.loader_client import LoaderClient
from clients.ps_client import PSClient
from services.common.admin import AdminServer
from services.common.batch import Batch, Batches, iterate
from services.common.codecs import WireStatsCollector
from services.common.config import config_to_dict
from services.common.errors import ConfigError, FailedPrecondition, InvalidArgument
from services.worker.admin import WorkerProgress, make_worker_admin
from services.worker.best import BestState
from services.worker.compute import (
    DONE,
    ComputeThread,
    StepPhases,
    compute_threads,
    gil_switch_interval,
    torch_threads,
)
from services.worker.config import TrainerConfig
from services.worker.dense_exchange import DenseExchange
from services.worker.dense_optimizers import make_optimizer
from services.worker.distributed import every_rank_has_a_first_batch, several_ranks
from services.worker.embedding.builder import EmbeddingLink, check_rows_source, connect
from services.worker.embedding.exchange import lookup_groups
from services.worker.embedding.pipeline import EmbeddingPipeline, Prepared
from services.worker.embedding.rows import (
    RowsCapabilities,
    RowsClient,
    RowsReplica,
    RowsSnapshots,
)
from services.worker.evaluation import EvalAccumulator, evaluate_overlapped, gather_accumulator
from services.worker.models import ModelConfig, pick_device
from services.worker.pooling import BatchPlan
from services.worker.summary import RECENT_LOSSES, FitSummary, LossCurve, StalenessStats
from services.worker.sync import SyncStrategy
from services.worker.warmup import warm_up_step

__all__ = ["Trainer"]

log = logging.getLogger("persimmon.worker.trainer")

# loss, logits, row gradients, and the loss's mean over the ranks (NaN when no codec adapts)
StepResult = tuple[float, np.ndarray, list[np.ndarray], float]


class Trainer:
    """Trains ``model`` on batches with embeddings on the PS at ``ps_addresses``.

    ``model`` is an ``nn.Module`` called as ``model(pooled, dense) -> logits`` or a
    :class:`ModelConfig` (built at the first batch from the tables' dims and the batch's dense
    width, after ``torch.manual_seed(seed)``). ``tables`` maps each sparse feature to its PS
    table (default: every feature of the first batch, table named like the feature); a
    feature's dim is its table's dim on the PS. Settings are a :class:`TrainerConfig` or its
    fields as keywords. ``on_step(info)`` is called after every step (progress bars);
    ``after_step(info)``, when set, is awaited after it (training waits: model exports).

    ``rows_client``: reach the rows through this :class:`RowsClient` instead of the PS at
    ``ps_addresses`` (then give no addresses, registry or ``ps_process``); it is used as given
    (connected) and its owner closes it. ``head_replica``: a copy of the head
    rows the pipeline reads and updates in this process where it can (one worker, remote rows,
    :mod:`services.ps.replica`).

    ``recent_losses`` holds the latest training losses (at most ``RECENT_LOSSES``), ``history``
    every evaluation (step, auc, logloss, samples).
    """

    def __init__(self, *, model: nn.Module | ModelConfig | str,
                 ps_addresses: Sequence[str] = (), tables: Mapping[str, str] | None = None,
                 config: TrainerConfig | None = None, sync: SyncStrategy | None = None,
                 on_step: Callable[[dict[str, Any]], None] | None = None,
                 rows_client: RowsClient | None = None,
                 head_replica: RowsReplica | None = None, **settings: Any) -> None:
        if config is not None and settings:
            raise ConfigError(f"give a config or settings, not both (got {sorted(settings)})")
        try:
            self.config = config or TrainerConfig(**settings)
        except TypeError as exc:
            raise ConfigError(f"unknown trainer setting: {exc}") from exc
        if isinstance(model, str):
            model = ModelConfig(name=model)
        if not isinstance(model, nn.Module | ModelConfig):
            raise ConfigError(f"model must be an nn.Module or a ModelConfig, got {type(model)}")
        rank, world = (dist.get_rank(), dist.get_world_size()) if several_ranks() else (0, 1)
        self.progress = WorkerProgress(rank=rank, world_size=world)
        cfg = self.config
        check_rows_source(cfg, ps_addresses=ps_addresses, rows_client=rows_client)
        self._rows_source: dict[str, Any] = dict(
            ps_addresses=ps_addresses, rows_client=rows_client, tables=tables,
            timers=self.progress, worker=rank, workers=world, head_replica=head_replica)
        self._link: EmbeddingLink | None = None  # the last one connect() built (start())
        self._given = (RowsCapabilities.of(rows_client) if rows_client is not None else None,
                       dict(tables) if tables is not None else None)  # known before start()
        self._connected = False  # False again once closed (the link stays to be inspected)
        self.device = pick_device(self.config.device)
        self._model_spec = model
        self.module: nn.Module | None = model if isinstance(model, nn.Module) else None
        self._forward: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._exchange = DenseExchange(cfg, sync_given=sync is not None)
        self._sync = sync
        self.on_step = on_step
        self.after_step: Callable[[dict[str, Any]], Awaitable[None]] | None = None
        self._warm = False  # the step's kernels loaded (warmup.py), at the first fit's batch
        self.progress.registry.register(WireStatsCollector(self.codec_rows))
        self._admin: AdminServer | None = None
        self.admin_port: int | None = None
        self.step = 0  # steps whose results the event loop has handled
        self._taking = 0  # the step the compute thread takes next (``step`` lags it)
        self.phases = StepPhases()  # where the steps of the last fit went (its summary's)
        self.recent_losses: collections.deque[float] = collections.deque(maxlen=RECENT_LOSSES)
        self.history: list[dict[str, float]] = []  # evaluations: step, auc, logloss, samples

    @property
    def adaquant_levels(self) -> dict[str, collections.deque[int]]:
        """The s of the adaquant codecs at the latest steps: ``"dense"`` (the comm hook or
        the averager) and ``"grads"`` (the PS's)."""
        return self._exchange.levels

    @property
    def link(self) -> EmbeddingLink:
        """The embedding side :meth:`start` connected (still there once closed)."""
        if self._link is None:
            raise FailedPrecondition("the trainer is not started: await trainer.start()")
        return self._link

    @property
    def ps(self) -> PSClient | None:
        """The gRPC client of the PS (None before :meth:`start`, or when the rows come
        through a rows_client)."""
        return self._link.ps if self._link is not None else None

    @property
    def pipeline(self) -> EmbeddingPipeline:
        """The embedding side of the steps (after :meth:`start`)."""
        return self.link.pipeline

    @property
    def rows(self) -> RowsClient:
        """The rows client the steps and evaluations use (after :meth:`start`)."""
        return self.link.rows

    @property
    def rows_snapshots(self) -> RowsSnapshots | None:
        """The rows as a :class:`RowsSnapshots` where they can take snapshots, else None
        (known before :meth:`start`: a client this trainer opens never can)."""
        capabilities = self._link.capabilities if self._link is not None else self._given[0]
        return capabilities.snapshots if capabilities is not None else None

    @property
    def tables(self) -> dict[str, str] | None:
        """Each sparse feature's table (None until given or seen in the first batch)."""
        return self._link.pipeline.tables if self._link is not None else self._given[1]

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> Trainer:
        """Connect to the PS (idempotent); with staleness ``auto``, size the window."""
        if not self._connected:
            self._link = await connect(self.config, **self._rows_source)
            self._connected = True
        if self.config.admin_port is not None and self._admin is None:
            stats = getattr(self.ps if self.ps is not None else self.rows, "stats", None)
            app = make_worker_admin(self.progress, config=lambda: config_to_dict(self.config),
                                    ready=lambda: self._connected, shards=stats)
            port = self.config.admin_port  # ranks on one host: rank r serves port + r
            port = port + self.progress.rank if port else 0
            self._admin = AdminServer(app, self.config.admin_host, port)
            self.admin_port = await self._admin.start()
        return self

    async def close(self) -> None:
        if self._admin is not None:
            await self._admin.close()
            self._admin = None
        if self._link is not None and self._connected:
            self._connected = False
            await self._link.close()
        if self._sync is not None and self._forward is not None:
            self._sync.close()

    async def __aenter__(self) -> Trainer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- model ---------------------------------------------------------------------------

    async def _ensure_model(self, batch: Batch) -> None:
        if self._forward is not None:
            return
        if self.module is None:
            dims = await self.pipeline.feature_dims()
            torch.manual_seed(self.config.seed)
            spec = self._model_spec
            assert isinstance(spec, ModelConfig)
            self.module = spec.build(sparse_dims=dims, num_dense=batch.num_dense)
        self.module.to(self.device)
        several = several_ranks()
        self._sync = self._exchange.sync_for(self.module, self._sync, several=several)
        self._forward = self._sync.prepare(self.module) if self._sync else self.module
        world = dist.get_world_size() if several else 1
        self._optimizer = make_optimizer(self.config.dense_optimizer, self.module, self.config,
                                         batch=batch.size * world)
        self._exchange.count_optimizer(self._optimizer)

    def codec_rows(self) -> list[dict[str, Any]]:
        """Raw and wire bytes per stream and codec: the PS payloads, the dense exchange this
        trainer set up and DCT-MP activations (exported as ``persimmon_codec_bytes_total``; no PS
        payloads before :meth:`start`)."""
        rows = self._link.pipeline.codec_stats().rows() if self._link is not None else []
        return rows + self._exchange.codec_rows()

    def sync_metrics(self) -> dict[str, Any]:
        """The dense sync strategy's name and stats with the consensus distance (collective
        with more than one rank: every rank calls it); empty before the model exists."""
        if self._sync is None:
            return {}
        return {"name": self._sync.name, **self._sync.stats.as_dict(),
                "consensus_distance": self._sync.consensus_distance()}

    async def build(self, batch: Batch) -> None:
        """Build the dense model from ``batch`` now, as the first training batch would."""
        await self.start()
        self.pipeline.features(batch)
        await self._ensure_model(batch)

    def dense_state(self) -> dict[str, Any]:
        """The dense model's and optimizer's state and the step (a job checkpoint's part)."""
        if self.module is None or self._optimizer is None:
            raise FailedPrecondition("the dense model does not exist before the first batch")
        return {"model": self.module.state_dict(), "optimizer": self._optimizer.state_dict(),
                "step": self.step}

    def load_dense_state(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`dense_state` (after :meth:`build`)."""
        if self.module is None or self._optimizer is None:
            raise FailedPrecondition("build the model first: await trainer.build(batch)")
        self.module.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])

    async def _cpu_seconds(self) -> float:
        """CPU seconds used so far by this process and its rows client's process, if any."""
        other = self.link.capabilities.process_cpu
        return time.process_time() + (await other.cpu_seconds() if other is not None else 0.0)

    # ---- compute (runs in a thread) ------------------------------------------------------

    def _inputs(self, item: Prepared, *, training: bool = True
                ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        pooled = item.pool(self.device)
        if training:  # DCT-MP, where set: kept positions only
            pooled.pooled = self._exchange.sparsify(pooled.pooled)
        # numpy's copies keep the GIL (torch.tensor's release it: another thread may take it)
        dense = torch.from_numpy(item.batch.dense.copy()).to(self.device)
        labels = torch.from_numpy(item.batch.labels.copy()).to(self.device)
        return pooled, dense, labels

    def train_step(self, item: Prepared) -> StepResult:
        """One training step of a looked-up batch: forward, backward, dense sync and optimizer
        step. Returns the loss, the logits and the row gradients (one array per group)."""
        if self._forward is None or self._optimizer is None or self.module is None:
            raise FailedPrecondition("build the model first: await trainer.build(batch)")
        step, self._taking = self._taking, self._taking + 1
        phases = self.phases
        phases.start()
        item.read_hot()
        phases.mark("read_hot")
        pooled, dense, labels = self._inputs(item)
        phases.mark("pool")
        if not self.module.training:  # after an evaluation (a walk over every submodule)
            self.module.train()
        logits = self._forward(pooled.pooled, dense)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        shared = self._exchange.after_loss(loss)
        phases.mark("forward")
        self._optimizer.zero_grad(set_to_none=True)
        loss.backward()
        phases.mark("backward")
        if self._sync is not None:
            self._sync.after_backward(step)
        self._optimizer.step()
        if self._sync is not None:
            self._sync.after_step(step)
        phases.mark("dense_update")
        grads = pooled.row_grads()
        item.apply_hot(grads)
        phases.mark("apply_hot")
        return float(loss.item()), logits.detach().cpu().numpy(), grads, shared

    def _eval_step(self, item: Prepared) -> np.ndarray:
        assert self.module is not None
        pooled, dense, _ = self._inputs(item, training=False)  # as served: unthresholded
        self.module.eval()
        with torch.no_grad():
            return self.module(pooled.pooled, dense).cpu().numpy()

    # ---- public API ----------------------------------------------------------------------

    async def fit(self, batches: Batches | LoaderClient, *, steps: int | None = None,
                  eval_batches: Callable[[], Batches] | Sequence[Batch] | None = None,
                  validation_batches: Callable[[], Batches] | Sequence[Batch] | None = None
                  ) -> FitSummary:
        """Train on ``batches`` (at most ``steps`` of them); returns a :class:`FitSummary`.

        ``batches`` is an iterable, an async iterable or a :class:`LoaderClient`, whose
        batches are acked to the loader once their push is acknowledged by the PS. With more
        than one rank, training stops at the step where the first rank runs out of batches.

        ``on_step`` runs between steps (the model is at that step; training waits for it).
        ``eval_batches`` (a list, or a callable giving a fresh iterable) is evaluated every
        ``eval_every`` steps and at the end; the summary's ``auc``/``logloss`` are then the
        final held-out figures, else the progressive (pre-update) training figures.
        ``validation_batches`` (same forms), when given, are the periodic evaluations, and
        ``keep_best`` restores the best state before the held-out one (:mod:`services.worker.best`).
        At the first batch of the Trainer's first fit, the step's kernels are loaded or
        compiled before any step (:mod:`services.worker.warmup`); the summary's
        ``time_to_first_step_s`` includes that.
        """
        if steps is not None and steps < 1:
            raise InvalidArgument(f"steps must be >= 1 or None, got {steps}")
        called = time.perf_counter()
        best = BestState.of(self, validation_batches)
        await self.start()
        cpu = self.device.type == "cpu"
        # process-wide while the whole fit runs, set before its first torch op: a thread keeps
        # the intra-op thread count it had at its first torch op (the loop's, the warm-up's)
        with gil_switch_interval(self.config.gil_switch_ms / 1e3
                                 if cpu and self.config.gil_switch_ms else None), \
                torch_threads((self.config.torch_threads or compute_threads(
                    self.link.capabilities.direct is not None)) if cpu else None):
            return await self._fit(batches, steps, eval_batches, validation_batches, best,
                                   called)

    async def _fit(self, batches: Batches | LoaderClient, steps: int | None,
                   eval_batches: Callable[[], Batches] | Sequence[Batch] | None,
                   validation_batches: Callable[[], Batches] | Sequence[Batch] | None,
                   best: BestState | None, called: float) -> FitSummary:
        periodic = eval_batches if best is None else validation_batches
        every = self.config.eval_every if periodic is not None else 0
        compute: ComputeThread[Prepared] = ComputeThread(
            self.train_step, room=None if self.config.window is not None else self.config.prefetch,
            eval_every=every,
            pause_each_step=self.on_step is not None or self.after_step is not None)
        self.pipeline.begin(acknowledge=batches.ack if isinstance(batches, LoaderClient) else None)
        compute.mark_started(await self._cpu_seconds())  # again if this fit builds the model
        self.phases.reset()

        source = iterate(batches.batches() if isinstance(batches, LoaderClient) else batches)
        planned: tuple[Batch, BatchPlan] | None = None
        if prepare := self._forward is None or not self._warm:
            try:
                planned = await self._first_batch(source, compute)
            except BaseException:
                await source.aclose()
                raise
        producer = asyncio.create_task(
            compute.put(None) if prepare and planned is None  # its compute thread tells the
            # other ranks, which wait in every_rank_has_a_first_batch
            else self.pipeline.feed(source, compute.put, compute.fail, steps=steps,
                                    planned=planned))
        self._taking = self.step
        runner = compute.start(self.step)
        train_acc = EvalAccumulator("the training data")
        staleness, curve = StalenessStats(), LossCurve()
        samples, first_step = 0, self.step
        try:
            while (got := await compute.results.get()) is not DONE:
                if isinstance(got, BaseException):
                    raise got
                item, (loss, logits, grads, shared) = got
                self.progress.training()
                await self._exchange.report_grads_loss(shared, self.pipeline.clients(), self.rows)
                self.pipeline.push(item, grads)
                await self._retune(compute)
                train_acc.add_step(item.batch.labels, logits, loss)
                self.recent_losses.append(loss)
                curve.add(self.step, loss)
                staleness.add(item.staleness)
                self.progress.record_step(samples=item.batch.size, loss=loss,
                                          staleness=item.staleness)
                self.step += 1
                samples += item.batch.size
                if self.on_step is not None or self.after_step is not None:
                    info = {"step": self.step, "loss": loss, "staleness": item.staleness,
                            "samples": samples,
                            "samples_per_s": samples / (time.perf_counter() - compute.started)}
                    if self.on_step is not None:
                        self.on_step(info)
                    if self.after_step is not None:
                        await self.after_step(info)
                if every and self.step % every == 0:
                    await (best.evaluate() if best else
                           self._evaluate_into_history(eval_batches))  # type: ignore[arg-type]
                if compute.pauses_after(self.step):  # the thread waited for on_step / eval
                    compute.resume.set()
            await self.pipeline.drain()
            loop_cpu_seconds = time.thread_time() - compute.started_loop_cpu
            cpu_seconds = await self._cpu_seconds() - compute.started_cpu
        finally:
            producer.cancel()
            compute.stop()
            await asyncio.gather(producer, runner, self.pipeline.settle(),
                                 return_exceptions=True)
        seconds = time.perf_counter() - compute.started
        self.progress.state = "done"
        steps_done = self.step - first_step
        recent, timing = list(self.recent_losses), compute.timing()
        summary = FitSummary(
            mode=self.config.mode, staleness=self.pipeline.window or 0, steps=steps_done,
            samples=samples, seconds=seconds,
            samples_per_s=samples / seconds if seconds > 0 else 0.0,
            loss=float(np.mean(recent[-50:])) if steps_done else math.nan,
            staleness_max=staleness.max, staleness_mean=staleness.mean,
            window_choice=(choice.as_dict() if (choice := self.link.window_choice) else None),
            hot_tables=list(self.pipeline.hot_tables), head_ids=self.pipeline.head_count(),
            step_wall_ms=timing["step_wall_ms"], step_cpu_ms=timing["step_cpu_ms"],
            batch_wait_ms=timing["batch_wait_ms"], loss_curve=curve.points(),
            step_phases=self.phases.per_step(steps_done),
            time_to_first_step_s=(compute.first_step_at - called
                                  if compute.first_step_at is not None else math.nan),
            worker_cpu_ms_per_step=1e3 * cpu_seconds / steps_done if steps_done else 0.0,
            loop_cpu_ms=1e3 * loop_cpu_seconds / steps_done if steps_done else 0.0,
            recent_losses=recent[len(recent) - min(steps_done, len(recent)):],
            replicated_rows=self.pipeline.replica.num_rows if self.pipeline.replica else 0)
        train = gather_accumulator(train_acc).result()
        summary.train_auc, summary.train_logloss = train.auc, train.logloss
        # the spread of the replicas as trained, then one model: their average
        summary.sync = await asyncio.to_thread(self.sync_metrics)
        averaged = self._sync is not None and await asyncio.to_thread(self._sync.finish)
        if best is not None:
            await best.finish(summary)
        await self._held_out(summary, eval_batches, averaged=averaged)
        summary.wire_bytes = self.pipeline.wire_bytes()
        summary.codec_bytes = self.pipeline.codec_stats().as_dict()  # payloads per codec
        summary.dense_bytes = self._exchange.dense_bytes()
        summary.activation_bytes = self._exchange.activation_bytes()
        summary.history = list(self.history)
        return summary

    async def _retune(self, compute: ComputeThread[Prepared]) -> None:
        """``staleness auto``: the window measured again when it is time (the live page
        gets each measurement)."""
        if await self.pipeline.retune(*compute.compute_so_far()):
            tuner = self.pipeline.tuner
            assert tuner is not None  # it measured
            self.progress.record_window(tuner.choice.remeasured[-1])

    async def _first_batch(self, source: AsyncGenerator[Batch, None],
                           compute: ComputeThread[Prepared]) -> tuple[Batch, BatchPlan] | None:
        """Before a fit's first step, its first batch from ``source``, planned (the plan
        decides the hot policy), the model built from it and the step's kernels loaded or
        compiled (:func:`~services.worker.warmup.warm_up_step`), none of it training time
        (the run's clocks start after). None where the source has no batch: before a model
        exists, the fit's compute thread then meets the other ranks' check that every rank
        has a first batch (:func:`~services.worker.distributed.every_rank_has_a_first_batch`)."""
        batch = await anext(source, None)
        if batch is None:
            return None
        plan = await self.pipeline.plan(batch)
        if self._forward is None:
            every_rank_has_a_first_batch()
            await self._ensure_model(batch)
        if not self._warm:
            assert self.module is not None  # built above
            await warm_up_step(self.pipeline, self.module, batch, self.device)
            self._warm = True
        compute.mark_started(await self._cpu_seconds())
        return batch, plan

    async def _held_out(self, summary: FitSummary, eval_batches: Callable[[], Batches]
                        | Sequence[Batch] | None, *, averaged: bool) -> None:
        """The summary's final held-out figures (the training ones without held-out data)."""
        if eval_batches is None:
            summary.auc, summary.logloss = summary.train_auc, summary.train_logloss
            return
        fresh = averaged or summary.restored_best  # the model is not the last one evaluated
        last = (self.history[-1] if self.history and self.history[-1]["step"] == self.step
                and not fresh else await self._evaluate_into_history(eval_batches))
        summary.auc, summary.logloss = last["auc"], last["logloss"]
        summary.eval_samples = int(last["samples"])

    async def _evaluate_into_history(self, eval_batches: Callable[[], Batches] | Sequence[Batch]
                                     ) -> dict[str, float]:
        source = eval_batches() if callable(eval_batches) else eval_batches
        result = await self.evaluate(source)
        entry = {"step": self.step, **result}
        self.history.append(entry)
        self.progress.record_eval(entry)
        return entry

    async def evaluate(self, batches: Batches) -> dict[str, float]:
        """Held-out ``auc``, ``logloss`` and ``samples`` (over every rank's batches when a
        process group is initialised: then every rank must call it), looked up on the path
        serving computes (:meth:`EmbeddingPath.for_evaluation`)."""
        await self.start()
        path = self.pipeline.path.for_evaluation()

        async def look_up(batch: Batch) -> Prepared:
            plan = await self.pipeline.plan(batch)
            return Prepared(batch, plan, await lookup_groups(path, self.rows, plan), 0, path)

        async def score(item: Prepared) -> np.ndarray:
            await self._ensure_model(item.batch)
            return await asyncio.to_thread(self._eval_step, item)

        return await evaluate_overlapped(iterate(batches), look_up, score)
