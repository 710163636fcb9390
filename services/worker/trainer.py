"""The Trainer: PERSIA hybrid training of a model whose embeddings live on the PS.

One step of one batch::

    plan_batch (dedup ids per table, laid out by shard) → PSClient.lookup_sharded (one
    message per shard) → pool_batch → model forward/backward (BCE with logits) → dense sync
    + optimizer step → PSClient.push_sharded of the per-unique-row gradients (in the
    background)

Lookups run ahead of compute, as many at once as the staleness slots allow; once the slots
are taken, the next batches ride on the pushes that free them (one message per shard per
step). Compute runs in a thread so the event loop keeps serving lookups and pushes meanwhile;
with ``ps_process`` the PS traffic itself runs in a child process (:mod:`clients.ps_process`).

The bound on staleness is a semaphore of ``TrainerConfig.window`` slots: taken before a
batch's lookup, freed when its push is acknowledged (``sync``: 1 slot, so a lookup waits for
every earlier push; ``hybrid``: ``max(S, 1)``; ``async``: none). The staleness of a batch
is the number of earlier batches whose push is not yet acknowledged when its lookup starts;
``fit`` reports the maximum.

Dense replicas synchronise through a :mod:`services.worker.sync` strategy (DDP all-reduce by
default) when a torch.distributed group of more than one rank is initialised.

Usage::

    async with Trainer(model=ModelConfig(name="dlrm"), ps_addresses=addrs,
                       tables={"C1": "C1", ...}, mode="hybrid", staleness=8) as trainer:
        summary = await trainer.fit(train_batches, eval_batches=test_batches)
"""

from __future__ import annotations

import asyncio
import collections
import math
import queue
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from clients.loader_client import LoaderClient
from clients.ps_client import PSClient
from clients.ps_process import PSClientProcess
from services.common.admin import AdminServer
from services.common.batch import Batch
from services.common.codecs import WireStatsCollector
from services.common.config import config_to_dict
from services.common.errors import ConfigError, FailedPrecondition, InvalidArgument, Unavailable
from services.worker.admin import WorkerProgress, make_worker_admin
from services.worker.compression import (
    ActivationSparsifier,
    CodecAverager,
    CommStats,
    OnebitAdam,
    OnebitLamb,
    make_comm_hook,
)
from services.worker.config import TrainerConfig
from services.worker.evaluation import EvalAccumulator, gather_accumulator
from services.worker.models import ModelConfig, pick_device
from services.worker.pooling import BatchPlan, plan_batch, pool_batch
from services.worker.sync import SyncStrategy

__all__ = ["Trainer"]

Batches = AsyncIterable[Batch] | Iterable[Batch]
ONEBIT_OPTIMIZERS: dict[str, type[OnebitAdam | OnebitLamb]] = {
    "onebit_adam": OnebitAdam, "onebit_lamb": OnebitLamb}
_DONE = object()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _every_rank_has_a_batch(has_batch: bool) -> bool:
    """Collective: True while every rank still has a batch (ranks may get uneven counts from a
    loader; DDP needs all of them to stop at the same step)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if has_batch else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@dataclass(slots=True)
class _Rider:
    """A planned batch waiting for a staleness slot: the push that frees one looks it up."""

    plan: BatchPlan
    future: asyncio.Future[tuple[list[np.ndarray] | None, int]]


@dataclass(slots=True)
class _Ahead:
    """A batch on its way to compute: its rows and staleness, once looked up."""

    batch: Batch
    plan: BatchPlan
    looked_up: asyncio.Task[tuple[list[np.ndarray], int]]


@dataclass(slots=True)
class _Prepared:
    """A batch whose rows came back from the PS, ready for compute."""

    batch: Batch
    plan: BatchPlan
    rows: list[np.ndarray]  # per group of tables, aligned with its layout's ids
    staleness: int


async def _iterate(batches: Batches) -> AsyncIterator[Batch]:
    if isinstance(batches, AsyncIterable):
        async for b in batches:
            yield b
    else:
        for b in batches:
            yield b


def _make_optimizer(name: str, module: nn.Module, config: TrainerConfig) -> torch.optim.Optimizer:
    lr = config.lr
    if name in ONEBIT_OPTIMIZERS:  # they refuse embedding modules (ConfigError) and sparse grads
        return ONEBIT_OPTIMIZERS[name](module, lr=lr, freeze_step=config.onebit_freeze_step)
    params = [p for p in module.parameters() if p.requires_grad]
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, fused=True)  # one kernel for every tensor
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=config.momentum)


class _ComputeThread:
    """Training steps in one thread, taken straight from a thread-safe feed, so that the event
    loop never paces compute; each step's result goes back to the loop as it comes.

    With ``eval_every``, the thread waits after every ``eval_every``-th step until the loop
    has evaluated (``resume``); with ``pause_each_step`` (an ``on_step`` callback is set) it
    waits after every step, so that the callback sees the model at that step. With ``room``
    (async mode), at most that many looked-up batches wait in the feed. With more than one
    rank, every rank stops at the step where the first one runs out of batches (one tiny
    all-reduce per step).
    """

    def __init__(self, trainer: Trainer, *, room: int | None, eval_every: int,
                 pause_each_step: bool) -> None:
        self.trainer = trainer
        self.loop = asyncio.get_running_loop()
        self.feed: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.results: asyncio.Queue[Any] = asyncio.Queue()
        self.resume = threading.Event()
        self.started = time.perf_counter()  # reset once the model is built
        self.started_cpu = 0.0  # the worker's CPU seconds at ``started`` (Trainer._cpu_seconds)
        self._room = asyncio.Semaphore(room) if room is not None else None
        self._eval_every = eval_every
        self._pause_each_step = pause_each_step
        self._stopping = False
        self._wall = self._cpu = self._wait = 0.0  # seconds, over the steps done
        self._steps_done = 0
        self._distributed = _distributed()

    async def put(self, item: Any) -> None:
        if self._room is not None and isinstance(item, _Prepared):
            await self._room.acquire()
        self.feed.put(item)

    def stop(self) -> None:
        self._stopping = True
        self.feed.put(_DONE)
        self.resume.set()

    def pauses_after(self, step: int) -> bool:
        """Whether the thread waits for ``resume`` after ``step``."""
        return self._pause_each_step or bool(self._eval_every) and step % self._eval_every == 0

    def _report(self, result: Any) -> None:
        self.loop.call_soon_threadsafe(self.results.put_nowait, result)

    def run(self, step: int) -> None:
        try:
            self._steps(step)
        except BaseException as exc:  # raised by the loop, which awaits results only
            self._report(exc)

    def timing(self) -> dict[str, float]:
        """Mean ms per step: ``step_wall_ms`` and ``step_cpu_ms`` of this thread's training
        steps (wall beyond CPU is time spent waiting for a core or for the GIL), and
        ``batch_wait_ms``, the wait for the next looked-up batch."""
        n = max(self._steps_done, 1)
        return {"step_wall_ms": 1e3 * self._wall / n, "step_cpu_ms": 1e3 * self._cpu / n,
                "batch_wait_ms": 1e3 * self._wait / n}

    def _steps(self, step: int) -> None:
        while not self._stopping:
            waited = time.perf_counter()
            item = self.feed.get()
            self._wait += time.perf_counter() - waited
            if self._stopping:
                return
            if self._distributed and not _every_rank_has_a_batch(isinstance(item, _Prepared)):
                item = _DONE
            if not isinstance(item, _Prepared):
                self._report(item)
                return
            if self._room is not None:
                self.loop.call_soon_threadsafe(self._room.release)
            wall, cpu = time.perf_counter(), time.thread_time()
            result = self.trainer._train_step(item)
            self._wall += time.perf_counter() - wall
            self._cpu += time.thread_time() - cpu
            self._steps_done += 1
            step += 1
            pause = self.pauses_after(step)
            if pause:
                self.resume.clear()
            self._report((item, result))
            if pause:
                self.resume.wait()


class Trainer:
    """Trains ``model`` on batches with embeddings on the PS at ``ps_addresses``.

    ``model`` is an ``nn.Module`` called as ``model(pooled, dense) -> logits`` or a
    :class:`ModelConfig` (built at the first batch from the tables' dims and the batch's dense
    width, after ``torch.manual_seed(seed)``). ``tables`` maps each sparse feature to its PS
    table (default: every feature of the first batch, table named like the feature); a
    feature's dim is its table's dim on the PS. Settings are a :class:`TrainerConfig` or its
    fields as keywords. ``on_step(info)`` is called after every step (progress bars).
    """

    def __init__(self, *, model: nn.Module | ModelConfig | str, ps_addresses: Sequence[str],
                 tables: Mapping[str, str] | None = None, config: TrainerConfig | None = None,
                 sync: SyncStrategy | None = None,
                 on_step: Callable[[dict[str, Any]], None] | None = None,
                 **settings: Any) -> None:
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
        if not ps_addresses and not self.config.registry:
            raise ConfigError("ps_addresses must list at least one PS shard "
                              "(or set a registry)")
        self.tables: dict[str, str] | None = dict(tables) if tables is not None else None
        if self.tables is not None and not self.tables:
            raise ConfigError("tables must map at least one feature to a PS table")
        self._ps_options: dict[str, Any] = dict(
            rows_codec=self.config.rows_codec, timeout=self.config.timeout_s,
            grads_codec=self.config.grads_codec, retry_s=self.config.ps_retry_s)
        self.ps = (PSClient.from_registry(self.config.registry, **self._ps_options)
                   if self.config.registry else PSClient(list(ps_addresses), **self._ps_options))
        # the rows and gradients of steps and evaluations go through this one
        self._rows_client: PSClient | PSClientProcess = self.ps
        self.device = pick_device(self.config.device)
        self._model_spec = model
        self.module: nn.Module | None = model if isinstance(model, nn.Module) else None
        self._forward: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        if sync is not None and (self.config.dense_optimizer in ONEBIT_OPTIMIZERS
                                 or self.config.dense_codec != "none"):
            raise ConfigError("dense_codec and the 1-bit optimizers set up the dense all-reduce "
                              "themselves; do not pass a sync strategy with them")
        self._sync = sync
        self._dense_stats: CommStats | None = None  # bytes of the dense exchange we set up
        self._report_loss: Callable[[float], Any] | None = None  # adaquant hook
        self._activations = (ActivationSparsifier(self.config.activation_keep)
                             if self.config.activation_keep < 1 else None)
        self.on_step = on_step
        self._connected = False
        self._loader: LoaderClient | None = None  # acked once a batch's push is acknowledged
        rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
        self.progress = WorkerProgress(rank=rank, world_size=world)
        self.progress.registry.register(WireStatsCollector(self.codec_rows))
        self._admin: AdminServer | None = None
        self.admin_port: int | None = None
        self._groups: list[list[str]] | None = None  # tables of one dim, sent together
        self._riders: collections.deque[_Rider] = collections.deque()
        self._unacked = 0
        self.step = 0
        self.losses: list[float] = []          # training loss of every step
        self.staleness: list[int] = []         # staleness of every step's lookup
        self.history: list[dict[str, float]] = []  # evaluations: step, auc, logloss, samples

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> Trainer:
        """Connect to the PS (idempotent)."""
        if not self._connected:
            await self.ps.connect()
            if self.config.ps_process:
                self._rows_client = await PSClientProcess(
                    self.ps.addresses, registry=self.config.registry,
                    **self._ps_options).connect()
            self._connected = True
            if self.tables is not None:
                self._check_tables()
        if self.config.admin_port is not None and self._admin is None:
            app = make_worker_admin(self.progress, config=lambda: config_to_dict(self.config),
                                    ready=lambda: self._connected)
            port = self.config.admin_port  # ranks on one host: rank r serves port + r
            port = port + self.progress.rank if port else 0
            self._admin = AdminServer(app, self.config.admin_host, port)
            self.admin_port = await self._admin.start()
        return self

    def _check_tables(self) -> None:
        assert self.tables is not None
        unknown = sorted(t for t in self.tables.values() if t not in self.ps.dims)
        if unknown:
            raise ConfigError(f"PS tables {unknown} do not exist; "
                              f"the PS has {sorted(self.ps.dims)}")

    async def close(self) -> None:
        if self._admin is not None:
            await self._admin.close()
            self._admin = None
        if self._connected:
            if self._rows_client is not self.ps:
                await self._rows_client.close()
                self._rows_client = self.ps
            await self.ps.close()
            self._connected = False
        if self._sync is not None and self._forward is not None:
            self._sync.close()

    async def __aenter__(self) -> Trainer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- model ---------------------------------------------------------------------------

    def _features(self, batch: Batch) -> dict[str, Any]:
        if self.tables is None:
            self.tables = {name: name for name in batch.sparse}
        missing = sorted(set(self.tables) - set(batch.sparse))
        if missing:
            raise InvalidArgument(f"batch {batch.batch_id} lacks sparse features {missing}")
        return {name: batch.sparse[name] for name in self.tables}

    async def _ensure_model(self, batch: Batch) -> None:
        if self._forward is not None:
            return
        assert self.tables is not None  # set by _features before any model is needed
        if self.module is None:
            await self.ps.tables()
            self._check_tables()
            dims = {f: self.ps.dims[t] for f, t in self.tables.items()}
            torch.manual_seed(self.config.seed)
            spec = self._model_spec
            assert isinstance(spec, ModelConfig)
            self.module = spec.build(sparse_dims=dims, num_dense=batch.num_dense)
        self.module.to(self.device)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        onebit = self.config.dense_optimizer in ONEBIT_OPTIMIZERS
        if self._sync is None and distributed and not onebit:
            self._sync = self._configured_sync()
        if distributed and onebit:  # no DDP: replicas must start equal
            for p in self.module.parameters():
                dist.broadcast(p.data, 0)
        self._forward = self._sync.prepare(self.module) if self._sync else self.module
        self._optimizer = _make_optimizer(self.config.dense_optimizer, self.module, self.config)
        if onebit:
            self._dense_stats = getattr(self._optimizer, "stats", None)

    def _configured_sync(self) -> SyncStrategy:
        """``config.sync`` with ``dense_codec`` as its DDP comm hook (allreduce) or as the
        averager of the parameters (the parameter-averaging strategies)."""
        cfg = self.config
        if cfg.sync == "allreduce":
            state, hook = make_comm_hook(cfg.dense_codec)
            self._dense_stats = state.stats
            self._report_loss = getattr(state, "report_loss", None)
            return cfg.sync_config().build(comm_hook=(state, hook))
        averager = CodecAverager(cfg.dense_codec) if cfg.dense_codec != "none" else None
        if averager is not None:
            self._dense_stats = averager.stats
            self._report_loss = averager.report_loss
        return cfg.sync_config().build(averager=averager)

    def codec_rows(self) -> list[dict[str, Any]]:
        """Raw and wire bytes per stream and codec: the PS payloads, the dense exchange this
        trainer set up and DCT-MP activations (exported as ``persimmon_codec_bytes_total``)."""
        rows = self._rows_client.codec_stats.rows()
        dense = (self.config.dense_optimizer if self.config.dense_optimizer in ONEBIT_OPTIMIZERS
                 else self.config.dense_codec)
        for stream, codec, stats in (("dense_allreduce", dense, self._dense_stats),
                                     ("activations", "dct_mp", getattr(self._activations,
                                                                       "stats", None))):
            if stats is not None:
                rows.append({"stream": stream, "codec": codec, "direction": "sent",
                             "raw_bytes": stats.raw_bytes, "wire_bytes": stats.wire_bytes})
        return rows

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
        self._features(batch)
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
        """CPU seconds used so far by this process and its PS-client process, if any."""
        child = self._rows_client
        return time.process_time() + (await child.cpu_seconds()
                                      if isinstance(child, PSClientProcess) else 0.0)

    # ---- PS round trips ------------------------------------------------------------------

    def _table_groups(self) -> list[list[str]]:
        """The tables pooled and sent together: those of one dim."""
        assert self.tables is not None
        by_dim: dict[int, list[str]] = {}
        for table in dict.fromkeys(self.tables.values()):
            by_dim.setdefault(self.ps.dims[table], []).append(table)
        return list(by_dim.values())

    async def _plan(self, batch: Batch) -> BatchPlan:
        """Dedup and lay out the batch's ids (it needs no PS state, so it runs ahead of the
        staleness slot)."""
        features = self._features(batch)
        if self._groups is None:
            await self._ensure_dims()
            self._groups = self._table_groups()
        return plan_batch(features, table_of=self.tables, num_shards=self.ps.num_shards,
                          groups=self._groups)

    async def _lookup(self, plan: BatchPlan) -> list[np.ndarray]:
        with self.progress.lookup_seconds.time():
            return list(await asyncio.gather(*(self._rows_client.lookup_sharded(g.layout)
                                               for g in plan.groups)))

    async def _ensure_dims(self) -> None:
        assert self.tables is not None
        if any(t not in self.ps.dims for t in self.tables.values()):
            await self.ps.tables()
            self._check_tables()

    async def _push(self, batch: Batch, plan: BatchPlan, grads: list[np.ndarray],
                    slots: asyncio.Semaphore | None) -> None:
        """Push a batch's row gradients; once the PS acknowledged them, ack the batch to the
        loader (so its source offsets can be committed) and free its slot.

        A batch waiting for a slot (a rider) rides on the push: its lookup travels in the same
        message per shard, after the gradients, and the slot passes straight to it."""
        rider = self._riders.popleft() if self._riders else None
        rows: list[np.ndarray] | None = None
        try:
            started = time.perf_counter()
            if rider is None:
                await asyncio.gather(*(self._rows_client.push_sharded(g.layout, grad)
                                       for g, grad in zip(plan.groups, grads, strict=True)))
            else:
                rows = await self._push_then_lookup(plan, grads, rider.plan)
                self.progress.lookup_seconds.observe(time.perf_counter() - started)
            self.progress.push_seconds.observe(time.perf_counter() - started)
            if self._loader is not None:
                await self._loader.ack(batch)
        except BaseException as exc:
            if rider is not None and not rider.future.done():
                rider.future.set_exception(exc if isinstance(exc, Exception)
                                           else Unavailable("the push it rode on was cancelled"))
            raise
        finally:
            self._unacked -= 1
            if rider is None and self._riders:  # it came after this push left: slot only
                rider = self._riders.popleft()
            if rider is not None and not rider.future.done():
                rider.future.set_result((rows, self._unacked))
                self._unacked += 1
            elif slots is not None:
                slots.release()

    async def _push_then_lookup(self, plan: BatchPlan, grads: list[np.ndarray],
                                then: BatchPlan) -> list[np.ndarray]:
        """Push ``plan``'s gradients and look ``then`` up, one message per shard and group
        (every batch has the trainer's features, so both plans have the same groups)."""
        done = await asyncio.gather(*(self._rows_client.push_then_lookup(g.layout, grad,
                                                                          h.layout)
                                      for g, grad, h in zip(plan.groups, grads, then.groups,
                                                            strict=True)))
        return [rows for _, rows in done]

    async def _produce(self, batches: Batches | LoaderClient, steps: int | None,
                       slots: asyncio.Semaphore | None, compute: _ComputeThread) -> None:
        """Plan batches and start their lookups ahead of compute, each after taking a slot, so
        that as many lookups are in flight as there are slots (``prefetch`` in async mode).
        Once every slot is taken, batches queue as riders (as many as there are slots), so
        that each push finds one waiting. :meth:`_feed` hands them to compute in order. The
        first batch builds the model (that one-time cost is not training time: the clock
        starts after it)."""
        ahead: asyncio.Queue[_Ahead | None] = asyncio.Queue(
            maxsize=self.config.window or self.config.prefetch)
        feeder = asyncio.create_task(self._feed(ahead, compute))
        try:
            taken = 0
            feed = batches.batches() if isinstance(batches, LoaderClient) else batches
            async for batch in _iterate(feed):
                if steps is not None and taken >= steps:
                    break
                plan = await self._plan(batch)
                if self._forward is None:
                    await self._ensure_model(batch)
                    compute.started = time.perf_counter()
                    compute.started_cpu = await self._cpu_seconds()
                if slots is not None and slots.locked():  # ride on the push that frees one
                    rider = _Rider(plan, asyncio.get_running_loop().create_future())
                    self._riders.append(rider)
                    looked_up = asyncio.create_task(self._ride(rider))
                else:
                    if slots is not None:
                        await slots.acquire()
                    looked_up = asyncio.create_task(self._look_up(plan, self._unacked))
                    self._unacked += 1
                await ahead.put(_Ahead(batch, plan, looked_up))
                taken += 1
            await ahead.put(None)
            await feeder
        except BaseException as exc:  # handed to the consumer, which raises it
            feeder.cancel()
            while not ahead.empty():
                if (item := ahead.get_nowait()) is not None:
                    item.looked_up.cancel()
                    if item.looked_up.done() and not item.looked_up.cancelled():
                        item.looked_up.exception()  # retrieved: the feeder never awaits it
            await asyncio.gather(feeder, return_exceptions=True)
            compute.results.put_nowait(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _look_up(self, plan: BatchPlan, staleness: int
                       ) -> tuple[list[np.ndarray], int]:
        return await self._lookup(plan), staleness

    async def _ride(self, rider: _Rider) -> tuple[list[np.ndarray], int]:
        """A rider's rows: from the push it rode on, or its own lookup when it was handed the
        slot only (it came after that push had left)."""
        rows, staleness = await rider.future
        return (rows if rows is not None else await self._lookup(rider.plan)), staleness

    async def _feed(self, ahead: asyncio.Queue[_Ahead | None], compute: _ComputeThread) -> None:
        """Hand the batches to compute in their order, each once its rows have arrived."""
        try:
            while (item := await ahead.get()) is not None:
                rows, staleness = await item.looked_up
                await compute.put(_Prepared(item.batch, item.plan, rows, staleness))
            await compute.put(_DONE)
        except Exception as exc:  # a failed lookup: the consumer raises it
            compute.results.put_nowait(exc)

    # ---- compute (runs in a thread) ------------------------------------------------------

    def _inputs(self, item: _Prepared) -> tuple[Any, torch.Tensor, torch.Tensor]:
        pooled = pool_batch(item.plan, item.rows, mode=self.config.pooling, device=self.device)
        if self._activations is not None:  # DCT-MP: gradients reach kept positions only
            pooled.pooled = self._activations(pooled.pooled)
        dense = torch.tensor(item.batch.dense).to(self.device)
        labels = torch.tensor(item.batch.labels).to(self.device)
        return pooled, dense, labels

    def _train_step(self, item: _Prepared) -> tuple[float, np.ndarray, list[np.ndarray]]:
        assert self._forward is not None and self._optimizer is not None and self.module
        pooled, dense, labels = self._inputs(item)
        if not self.module.training:  # after an evaluation (a walk over every submodule)
            self.module.train()
        logits = self._forward(pooled.pooled, dense)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        if self._report_loss is not None:
            self._report_loss(float(loss.item()))
        self._optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self._sync is not None:
            self._sync.after_backward(self.step)
        self._optimizer.step()
        if self._sync is not None:
            self._sync.after_step(self.step)
        return float(loss.item()), logits.detach().cpu().numpy(), pooled.row_grads()

    def _eval_step(self, item: _Prepared) -> np.ndarray:
        assert self.module is not None
        pooled, dense, _ = self._inputs(item)
        self.module.eval()
        with torch.no_grad():
            return self.module(pooled.pooled, dense).cpu().numpy()

    # ---- public API ----------------------------------------------------------------------

    async def fit(self, batches: Batches | LoaderClient, *, steps: int | None = None,
                  eval_batches: Callable[[], Batches] | Sequence[Batch] | None = None
                  ) -> dict[str, Any]:
        """Train on ``batches`` (at most ``steps`` of them); returns the summary dict.

        ``batches`` is an iterable, an async iterable or a :class:`LoaderClient`, whose
        batches are acked to the loader once their push is acknowledged by the PS. With more
        than one rank, training stops at the step where the first rank runs out of batches.

        ``on_step`` runs between steps (the model is at that step; training waits for it).
        ``eval_batches`` (a list, or a callable giving a fresh iterable) is evaluated every
        ``eval_every`` steps and at the end; the summary's ``auc``/``logloss`` are then the
        final held-out figures, else the progressive (pre-update) training figures.
        """
        if steps is not None and steps < 1:
            raise InvalidArgument(f"steps must be >= 1 or None, got {steps}")
        await self.start()
        window = self.config.window
        slots = asyncio.Semaphore(window) if window is not None else None
        every = self.config.eval_every if eval_batches is not None else 0
        compute = _ComputeThread(self, room=None if window is not None else self.config.prefetch,
                                 eval_every=every, pause_each_step=self.on_step is not None)
        self._loader = batches if isinstance(batches, LoaderClient) else None
        compute.started_cpu = await self._cpu_seconds()  # reset if this fit builds the model
        producer = asyncio.create_task(self._produce(batches, steps, slots, compute))
        runner = asyncio.create_task(asyncio.to_thread(compute.run, self.step))
        pushes: set[asyncio.Task[None]] = set()
        train_acc = EvalAccumulator()
        samples, first_step = 0, self.step
        first = len(self.losses)  # this fit's entries (step may start past 0 after a restore)
        try:
            while (got := await compute.results.get()) is not _DONE:
                if isinstance(got, BaseException):
                    raise got
                item, (loss, logits, grads) = got
                self.progress.training()
                task = asyncio.create_task(self._push(item.batch, item.plan, grads, slots))
                pushes.add(task)
                _prune_pushes(pushes)
                train_acc.add_step(item.batch.labels, logits, loss)
                self.losses.append(loss)
                self.staleness.append(item.staleness)
                self.progress.record_step(samples=item.batch.size, loss=loss,
                                          staleness=item.staleness)
                self.step += 1
                samples += item.batch.size
                if self.on_step is not None:
                    self.on_step({"step": self.step, "loss": loss, "staleness": item.staleness,
                                  "samples": samples, "samples_per_s":
                                  samples / (time.perf_counter() - compute.started)})
                if every and self.step % every == 0:
                    await self._evaluate_into_history(eval_batches)  # type: ignore[arg-type]
                if compute.pauses_after(self.step):  # the thread waited for on_step / eval
                    compute.resume.set()
            await asyncio.gather(*pushes)
            cpu_seconds = await self._cpu_seconds() - compute.started_cpu
        finally:
            producer.cancel()
            compute.stop()
            await asyncio.gather(producer, runner, *pushes, return_exceptions=True)
            self._riders.clear()
        started = compute.started
        seconds = time.perf_counter() - started
        self.progress.state = "done"
        steps_done = self.step - first_step
        summary: dict[str, Any] = {
            "mode": self.config.mode, "staleness": self.config.staleness,
            "steps": steps_done, "samples": samples, "seconds": seconds,
            "samples_per_s": samples / seconds if seconds > 0 else 0.0,
            "loss": float(np.mean(self.losses[-50:])) if steps_done else math.nan,
            "staleness_max": max(self.staleness[first:], default=0),
            "staleness_mean": float(np.mean(self.staleness[first:])) if steps_done else 0.0,
            "losses": [float(x) for x in self.losses[first:]],
            **compute.timing(),
            "worker_cpu_ms_per_step": 1e3 * cpu_seconds / steps_done if steps_done else 0.0,
        }
        train = gather_accumulator(train_acc).result()
        summary.update(train_auc=train.auc, train_logloss=train.logloss)
        # the spread of the replicas as trained, then one model: their average
        summary["sync"] = await asyncio.to_thread(self.sync_metrics)
        averaged = self._sync is not None and await asyncio.to_thread(self._sync.finish)
        if eval_batches is not None:
            last = (self.history[-1] if self.history and self.history[-1]["step"] == self.step
                    and not averaged else await self._evaluate_into_history(eval_batches))
            summary.update(auc=last["auc"], logloss=last["logloss"],
                           eval_samples=last["samples"])
        else:
            summary.update(auc=train.auc, logloss=train.logloss)
        summary["wire_bytes"] = self._rows_client.wire_bytes()
        summary["codec_bytes"] = self._rows_client.codec_stats.as_dict()  # payloads per codec
        summary["dense_bytes"] = self._dense_stats.as_dict() if self._dense_stats else {}
        summary["activation_bytes"] = (self._activations.stats.as_dict()
                                       if self._activations is not None else {})
        summary["history"] = list(self.history)
        return summary

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
        process group is initialised: then every rank must call it)."""
        await self.start()
        acc = EvalAccumulator()
        iterator = _iterate(batches).__aiter__()
        pending: asyncio.Task[Any] | None = None

        async def fetch() -> tuple[Batch, BatchPlan, list[np.ndarray]] | None:
            try:
                batch = await iterator.__anext__()
            except StopAsyncIteration:
                return None
            plan = await self._plan(batch)
            return batch, plan, await self._lookup(plan)

        pending = asyncio.create_task(fetch())
        try:
            while (got := await pending) is not None:
                pending = asyncio.create_task(fetch())  # the next lookup overlaps compute
                batch, plan, rows = got
                await self._ensure_model(batch)
                item = _Prepared(batch, plan, rows, 0)
                acc.update(batch.labels, await asyncio.to_thread(self._eval_step, item))
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
        result = gather_accumulator(acc).result()
        return {"auc": result.auc, "logloss": result.logloss, "samples": result.count}


def _prune_pushes(tasks: set[asyncio.Task[None]]) -> None:
    """Forget acknowledged pushes; raise the error of a failed one."""
    for task in [t for t in tasks if t.done()]:
        tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            raise exc
