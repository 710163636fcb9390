"""The ``persimmon worker`` process: one NN worker (a torchrun rank when ``WORLD_SIZE`` is set)
against running PS shards (``--ps host:port,...`` in shard order, or ``--registry``), fed by a
running loader (``--loader host:port`` or ``registry``) or by batches generated in process.

Its lifecycle (:func:`run_worker`): check the flags, join the process group, find the loader,
build the :class:`~services.worker.trainer.Trainer`, train (on rank 0 with
``--checkpoint-dir``: under job checkpoints, periodic, on request over REST and at SIGTERM, see
:mod:`services.worker.job_checkpoints`), print the summary.

There is no ``server.py``: a worker serves nothing over gRPC. It is a client of the PS and of
the loader (``clients``), its ranks talk over torch.distributed, and what it serves is REST:
its admin API (``admin.py``: progress, config, metrics) and, on rank 0, the job-checkpoint API.

Batches generated in process (no ``--loader``): the planted data generator belongs to the
loader, which the worker never imports, so the command line that starts the worker injects an
:class:`InProcessSource` (``persimmon worker`` passes the one of :mod:`services.local.train`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.common.batch import Batch
from services.common.config import print_config
from services.common.errors import ConfigError, PersimmonError, TrainingFailed, Unavailable
from services.worker.config import TrainerConfig
from services.worker.models import ModelConfig
from services.worker.summary import summary_problem

__all__ = ["InProcessData", "InProcessSource", "SUMMARY_KEYS", "check_result",
           "check_worker_args", "failure_summary", "registered_loader", "report_summary",
           "run_worker", "summary_dict", "write_summary"]

log = logging.getLogger("persimmon.worker")

# What the summary line printed at the end holds (the JSON file of --summary-json has it all).
SUMMARY_KEYS = ("mode", "steps", "auc", "oracle_auc", "logloss", "best_step",
                "best_validation_auc", "samples_per_s", "time_to_first_step_s", "staleness_max",
                "wire_bytes")


@dataclass(frozen=True, slots=True)
class InProcessData:
    """One rank's batches generated in process: its training and held-out batches, the sparse
    features they carry and, for planted data, the oracle metrics of the held-out split."""

    features: list[str]
    train: list[Batch]
    test: list[Batch]
    oracle: dict[str, float] | None = field(default=None)


class InProcessSource(Protocol):
    """Where a worker without ``--loader`` gets its batches."""

    def check(self, args: argparse.Namespace) -> None:
        """Raise :class:`ConfigError` for data flags (``--train-data`` ...) it cannot serve."""

    def data(self, args: argparse.Namespace, rank: int, world: int) -> InProcessData:
        """Rank ``rank`` of ``world``'s batches."""


def check_worker_args(args: argparse.Namespace, config: TrainerConfig,
                      in_process: InProcessSource | None) -> None:
    """Every flag check that needs no process: a clear :class:`ConfigError` before anything
    starts (``--check-config`` stops after it)."""
    if not args.ps and not config.registry:
        raise ConfigError("give --ps (PS shard addresses in shard order) or --registry")
    if in_process is not None:
        in_process.check(args)
    elif not args.loader:
        raise ConfigError("give --loader: batches generated in this process need the "
                          "`persimmon worker` command")
    if args.checkpoint_dir and not (args.ps_admin or config.registry):
        raise ConfigError("--checkpoint-dir needs --ps-admin (PS admin URLs) or --registry")
    if config.export_dir:
        raise ConfigError("persimmon worker does not export model versions yet: use "
                          "persimmon train --export-dir, or persimmon export of the job's "
                          "checkpoints")
    if args.loader == "registry" and not config.registry:
        raise ConfigError("--loader registry needs --registry")
    if args.resume and (args.loader or not args.checkpoint_dir):
        raise ConfigError("--resume needs --checkpoint-dir, and works with in-process data only "
                          "for now (with --loader the dense state is not reloaded)")


def run_worker(args: argparse.Namespace, config: TrainerConfig, *,
               in_process: InProcessSource | None = None) -> int:
    """The ``persimmon worker`` process from its parsed flags; its exit status."""
    from services.worker.distributed import init_distributed

    print_config("worker", config)
    check_worker_args(args, config, in_process)
    if args.check_config:
        return 0
    info = init_distributed()  # a process group when torchrun (or compose) set WORLD_SIZE
    rank, world = info.rank, info.world_size
    data = None if args.loader or in_process is None else in_process.data(args, rank, world)
    with failure_summary(args.summary_json):
        summary = asyncio.run(_train(args, config, rank, world, data))
    if summary is None:
        return 0  # stopped by SIGTERM after a final job checkpoint
    if data is not None and data.oracle is not None:
        summary.update(oracle_auc=data.oracle["auc"], oracle_logloss=data.oracle["logloss"])
    return report_summary(summary, args.summary_json)


async def _train(args: argparse.Namespace, config: TrainerConfig, rank: int, world: int,
                 data: InProcessData | None) -> dict[str, Any] | None:
    from clients.loader_client import LoaderClient
    from services.worker.local_ranks import read_loader
    from services.worker.trainer import Trainer

    loader = args.loader
    if loader == "registry":
        loader = await registered_loader(str(config.registry))
    tables: Mapping[str, str] | None = None  # every sparse feature of the batches, named like it
    if data is not None:
        tables = {f: args.table_prefix + f for f in data.features}
        test: Any = data.test
    else:
        test = await read_loader(args.eval_loader, rank, world) if args.eval_loader else None
    addresses = args.ps.split(",") if args.ps else []
    async with Trainer(model=ModelConfig(name=args.model), ps_addresses=addresses,
                       tables=tables, config=config) as trainer:
        if data is not None:
            skip = await _resume(trainer, args, data.train[0]) if data.train else 0
            return await _fit(trainer, data.train[skip:], test, args, config.registry, rank)
        credits = (config.window or config.prefetch) + 2
        async with LoaderClient(loader, rank=rank, world_size=world, credits=credits) as client:
            return await _fit(trainer, client, test, args, config.registry, rank)


async def registered_loader(url: str, timeout_s: float = 60.0) -> str:
    """The gRPC address of the first loader registered at ``url`` (``--loader registry``)."""
    from services.common.registry import open_registry

    registry = open_registry(url)
    deadline = time.monotonic() + timeout_s
    try:
        while not (loaders := await registry.members("loader")):
            if time.monotonic() > deadline:
                raise Unavailable(f"no loader registered at {url} within {timeout_s}s")
            await asyncio.sleep(0.2)
    finally:
        await registry.close()
    return loaders[0].address


async def _resume(trainer: Any, args: argparse.Namespace, first: Batch) -> int:
    """With ``--resume``: load the newest complete job checkpoint's dense state; returns the
    number of this rank's batches it already covered."""
    if not (args.resume and args.checkpoint_dir):
        return 0
    from services.worker.job_checkpoints import resume_state

    state = resume_state(args.checkpoint_dir)
    if state is None:
        return 0
    await trainer.build(first)
    trainer.load_dense_state(state)
    log.info("resumed at step %d", trainer.step)
    return int(state["step"])


async def _fit(trainer: Any, batches: Any, test: Any, args: argparse.Namespace,
               registry_url: str | None, rank: int) -> dict[str, Any] | None:
    """``trainer.fit``; with ``--checkpoint-dir``, under consistent job cuts on every rank
    (rank 0 writes them: periodic, REST on ``--job-admin-port``, SIGTERM). None when
    stopped by SIGTERM."""
    if not args.checkpoint_dir:
        return summary_dict(await trainer.fit(batches, eval_batches=test))
    import torch.distributed as dist

    from services.common.registry import open_registry
    from services.worker.distributed import several_ranks
    from services.worker.job_checkpoints import JobCheckpointer, loader_offsets_part
    from services.worker.job_control import JobControl, fit_with_checkpoints

    group = dist.new_group(backend="gloo") if several_ranks() else None  # the cuts' meetings
    registry = open_registry(registry_url) if registry_url and rank == 0 else None
    try:
        checkpointer = None
        if rank == 0:
            loaders = await registry.members("loader") if registry is not None else []
            parts = {"loader-offsets": loader_offsets_part(loaders[0].admin_url)} \
                if loaders and loaders[0].admin_url else {}
            checkpointer = JobCheckpointer(
                args.checkpoint_dir,
                admin_urls=args.ps_admin.split(",") if args.ps_admin else None,
                registry=registry, parts=parts, every_steps=args.checkpoint_every_steps,
                every_s=args.checkpoint_every_s, keep=args.keep_checkpoints,
                epochs=trainer.ps.epochs if trainer.ps is not None else None)
        summary, manifest = await fit_with_checkpoints(
            trainer, batches, JobControl(checkpointer, trainer, group=group),
            eval_batches=test, admin_port=args.job_admin_port)
    finally:
        if registry is not None:
            await registry.close()
    if rank == 0:
        print(json.dumps({"job_checkpoint": manifest and manifest["checkpoint_id"],
                          "step": manifest and manifest["step"]}))
    return None if summary is None else summary_dict(summary)


def summary_dict(summary: Any) -> dict[str, Any]:
    """A fit summary (a :class:`FitSummary` or a mapping) as a plain dict, for JSON and for
    adding the oracle's metrics."""
    as_dict = getattr(summary, "as_dict", None)
    return dict(as_dict() if callable(as_dict) else summary)


def _json_ready(value: Any) -> Any:
    """``value`` with every NaN or infinity as None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    return value


def write_summary(summary: Mapping[str, Any], path: str | None) -> None:
    """Write ``summary`` to ``path`` (``--summary-json``) as strict JSON, when given."""
    if path:
        with open(path, "w") as f:
            json.dump(_json_ready(summary), f, indent=2)


def check_result(summary: Mapping[str, Any], path: str | None) -> None:
    """A :class:`TrainingFailed` when ``summary`` holds no result to report
    (:func:`~services.worker.summary.summary_problem`), after writing it with that reason as
    its ``error`` to ``path``."""
    problem = summary_problem(summary)
    if problem is not None:
        write_summary({**summary, "error": problem}, path)
        raise TrainingFailed(problem)


@contextlib.contextmanager
def failure_summary(path: str | None) -> Iterator[None]:
    """Training under this block that fails writes ``{"error": ...}`` to ``path``."""
    try:
        yield
    except PersimmonError as exc:
        write_summary({"error": exc.message}, path)
        raise


def report_summary(summary: Mapping[str, Any], path: str | None) -> int:
    """Print the summary's headline keys as strict JSON (a NaN, such as the best validation
    AUC of a run without validation data, as null) and write all of it to ``path`` when given;
    returns 0 (the exit status). A summary without a result is a :class:`TrainingFailed`
    (:func:`check_result`)."""
    summary = summary_dict(summary)
    check_result(summary, path)
    print(json.dumps(_json_ready({k: summary[k] for k in SUMMARY_KEYS if k in summary}),
                     indent=2))
    write_summary(summary, path)
    return 0
