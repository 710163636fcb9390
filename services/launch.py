"""The local launcher: ``persimmon worker`` and ``persimmon train`` run the Trainer from flags or YAML.

It sits above the services (like ``services.demo``): it starts loader and PS processes and
forks workers.

- ``train``: a local cluster on this machine: a loader process for ``--train-data`` and one
  for ``--eval-data`` (loader specs such as ``criteo:day_*.gz`` or ``synthetic:ROWS``), PS
  shard processes with one table per sparse feature the loader reports, N gloo workers.
- ``worker``: one worker (a torchrun rank when ``WORLD_SIZE`` is set) against a running PS
  (``--ps host:port,...`` in shard order, or ``--registry``), fed by a running loader
  (``--loader host:port``) or, without one, by planted data generated in memory.
"""

from __future__ import annotations

import argparse
import json
import logging
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from services.common.config import add_flags, flag_values, load_config, print_config
from services.common.errors import ConfigError
from services.worker.config import TrainerConfig, ps_table_configs
from services.worker.models import MODELS, ModelConfig

__all__ = ["load_trainer_config", "register_cli", "train_on_local_cluster"]

_SUMMARY_KEYS = ("mode", "steps", "auc", "oracle_auc", "logloss", "samples_per_s",
                 "staleness_max", "wire_bytes")


def load_trainer_config(args: argparse.Namespace) -> TrainerConfig:
    return load_config(TrainerConfig, yaml_path=args.config, env_prefix="PERSIMMON_WORKER_",
                       flags=flag_values(TrainerConfig, args))


def _synthetic_rows(spec: str) -> int | None:
    """The row count of a ``synthetic:ROWS`` spec; None for any other source."""
    kind, _, rest = spec.partition(":")
    if kind != "synthetic":
        return None
    rows = rest.partition("?")[0]
    try:
        return int(rows) if rows else 65536
    except ValueError as exc:
        raise ConfigError(f"--train-data: bad row count {rows!r}") from exc


def _data_specs(args: argparse.Namespace) -> tuple[str, str | None]:
    """(train spec, eval spec): ``synthetic`` alone means 65,536 rows, and synthetic training
    data is evaluated on the test split unless ``--eval-data`` says otherwise."""
    from services.loader.config import SourceSpec

    train = str(args.train_data)
    rows = _synthetic_rows(train)
    if rows is not None:
        train = f"synthetic:{rows}"
    evaluation = args.eval_data
    if evaluation is None and rows is not None:
        evaluation = f"synthetic:{args.eval_rows}?split=test"
    for spec in (train, evaluation):
        if spec is not None:
            SourceSpec.parse(spec)  # a clear ConfigError before any process starts
    return train, evaluation


def _oracle(train_spec: str, eval_spec: str | None, seed: int) -> dict[str, float] | None:
    """The planted data's oracle on the eval split, when both are the synthetic generator's."""
    if _synthetic_rows(train_spec) is None or eval_spec is None \
            or not eval_spec.startswith("synthetic:") or "split=test" not in eval_spec:
        return None
    from services.loader.synthetic import SyntheticConfig, SyntheticDataset

    rows = int(eval_spec.split(":", 1)[1].partition("?")[0])
    return SyntheticDataset(SyntheticConfig(seed=seed)).oracle(rows)


def _sparse_features(admin_url: str) -> list[str]:
    """The sparse feature names a running loader reports (``GET /v1/sources``)."""
    with urllib.request.urlopen(admin_url + "/v1/sources", timeout=10) as response:
        sources = json.load(response)
    return list(sources[0]["sparse_features"])


def train_on_local_cluster(*, train_data: str, eval_data: str | None, config: TrainerConfig,
                           model: ModelConfig, workers: int = 1, shards: int = 2,
                           dim: int = 16, ps_lr: float = 0.05, batch_size: int = 512,
                           epochs: int = 1, data_seed: int = 0,
                           on_cluster: Callable[[Any, list[str]], None] | None = None
                           ) -> dict[str, Any]:
    """Start loaders and PS shards on loopback ports, train ``workers`` gloo ranks, stop
    everything; return the summary (with ``oracle_auc`` for planted data).

    ``on_cluster(cluster, tables)`` runs once the PS is up, before training (the demo starts
    its progress bar there)."""
    from services.processes import LocalLoader, LocalPS
    from services.worker.local import run_local_training

    with ExitStack() as stack:
        loader = stack.enter_context(LocalLoader(train_data, batch_size=batch_size,
                                                 world_size=workers, seed=data_seed,
                                                 epochs=epochs))
        eval_loader = (stack.enter_context(LocalLoader(eval_data, batch_size=4096,
                                                       world_size=workers, seed=data_seed))
                       if eval_data else None)
        features = _sparse_features(loader.admin_url)
        tables = ps_table_configs({f: dim for f in features}, lr=ps_lr)
        cluster = stack.enter_context(LocalPS(shards, tables, registry=config.registry))
        if on_cluster is not None:
            on_cluster(cluster, [str(t["name"]) for t in tables])
        summary = run_local_training(
            ps_addresses=cluster.addresses, loader=loader.address,
            eval_loader=eval_loader.address if eval_loader else None, model=model,
            config=config, num_workers=workers)
    oracle = _oracle(train_data, eval_data, data_seed)
    if oracle is not None:
        summary.update(oracle_auc=oracle["auc"], oracle_logloss=oracle["logloss"])
    return summary


def _finish(summary: dict[str, Any], path: str | None) -> int:
    summary.pop("losses", None)
    print(json.dumps({k: summary[k] for k in _SUMMARY_KEYS if k in summary}, indent=2))
    if path:
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def _in_memory_synthetic(args: argparse.Namespace, rank: int, world: int
                         ) -> tuple[list[str], list[Any], list[Any]]:
    """(features, this rank's training batches, its test batches) of planted data."""
    from services.loader.synthetic import SyntheticConfig, SyntheticDataset

    rows = _synthetic_rows(str(args.train_data))
    if rows is None:
        raise ConfigError("without --loader, --train-data must be synthetic[:ROWS]")
    dataset = SyntheticDataset(SyntheticConfig(seed=args.data_seed))
    train = [b for _ in range(args.epochs) for b in dataset.batches(args.batch_size, rows)]
    test = list(dataset.batches(4096, args.eval_rows, "test"))
    return dataset.config.sparse_names, train[rank::world], test[rank::world]


def _run_worker(args: argparse.Namespace) -> int:
    import asyncio

    from clients.loader_client import LoaderClient
    from services.worker.distributed import init_distributed
    from services.worker.local import read_loader
    from services.worker.trainer import Trainer

    config = load_trainer_config(args)
    print_config("worker", config)
    if not args.ps and not config.registry:
        raise ConfigError("give --ps (PS shard addresses in shard order) or --registry")
    train_spec, eval_spec = _data_specs(args)
    if args.checkpoint_dir and not (args.ps_admin or config.registry):
        raise ConfigError("--checkpoint-dir needs --ps-admin (PS admin URLs) or --registry")
    if args.loader == "registry" and not config.registry:
        raise ConfigError("--loader registry needs --registry")
    if args.resume and (args.loader or not args.checkpoint_dir):
        raise ConfigError("--resume needs --checkpoint-dir, and works with in-process data only "
                          "for now (with --loader the dense state is not reloaded)")
    if args.check_config:
        return 0
    info = init_distributed()  # a process group when torchrun (or compose) set WORLD_SIZE
    rank, world = info.rank, info.world_size
    addresses = args.ps.split(",") if args.ps else []

    async def main() -> dict[str, Any] | None:
        if args.loader == "registry":
            args.loader = await registered_loader(str(config.registry))
        if args.loader:
            tables = None  # every sparse feature of the batches, table named like it
            test = await read_loader(args.eval_loader, rank, world) if args.eval_loader else None
        else:
            features, train, test = _in_memory_synthetic(args, rank, world)
            tables = {f: args.table_prefix + f for f in features}
        async with Trainer(model=ModelConfig(name=args.model), ps_addresses=addresses,
                           tables=tables, config=config) as trainer:
            if not args.loader:
                skip = await _resume(trainer, args, train[0]) if train else 0
                return await _fit(trainer, train[skip:], test, args, config.registry, rank)
            credits = (config.window or config.prefetch) + 2
            async with LoaderClient(args.loader, rank=rank, world_size=world,
                                    credits=credits) as loader:
                return await _fit(trainer, loader, test, args, config.registry, rank)

    summary = asyncio.run(main())
    if summary is None:
        return 0  # stopped by SIGTERM after a final job checkpoint
    oracle = None if args.loader else _oracle(train_spec, eval_spec, args.data_seed)
    if oracle is not None:
        summary.update(oracle_auc=oracle["auc"], oracle_logloss=oracle["logloss"])
    return _finish(summary, args.summary_json)


async def registered_loader(url: str, timeout_s: float = 60.0) -> str:
    """The gRPC address of the first loader registered at ``url`` (``--loader registry``)."""
    import asyncio
    import time

    from services.common.errors import Unavailable
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


async def _resume(trainer: Any, args: argparse.Namespace, first: Any) -> int:
    """With ``--resume``: load the newest complete job checkpoint's dense state; returns the
    number of this rank's batches it already covered."""
    if not (args.resume and args.checkpoint_dir):
        return 0
    from services.cluster.job import resume_state

    state = resume_state(args.checkpoint_dir)
    if state is None:
        return 0
    await trainer.build(first)
    trainer.load_dense_state(state)
    logging.getLogger("persimmon.worker").info("resumed at step %d", trainer.step)
    return int(state["step"])


async def _fit(trainer: Any, batches: Any, test: Any, args: argparse.Namespace,
               registry_url: str | None, rank: int) -> dict[str, Any] | None:
    """``trainer.fit``; on rank 0 with ``--checkpoint-dir``, under job checkpoints (periodic,
    REST on ``--job-admin-port``, SIGTERM). None when stopped by SIGTERM."""
    if not args.checkpoint_dir or rank != 0:
        return await trainer.fit(batches, eval_batches=test)
    from services.cluster.checkpoints import JobCheckpointer, loader_offsets_part
    from services.cluster.job import JobControl, fit_with_checkpoints
    from services.common.registry import open_registry

    registry = open_registry(registry_url) if registry_url else None
    loaders = await registry.members("loader") if registry is not None else []
    parts = {"loader-offsets": loader_offsets_part(loaders[0].admin_url)} \
        if loaders and loaders[0].admin_url else {}
    checkpointer = JobCheckpointer(
        args.checkpoint_dir, admin_urls=args.ps_admin.split(",") if args.ps_admin else None,
        registry=registry, parts=parts, every_steps=args.checkpoint_every_steps,
        every_s=args.checkpoint_every_s)
    try:
        summary, manifest = await fit_with_checkpoints(
            trainer, batches, JobControl(checkpointer, trainer.dense_state), eval_batches=test,
            admin_port=args.job_admin_port)
    finally:
        if registry is not None:
            await registry.close()
    print(json.dumps({"job_checkpoint": manifest and manifest["checkpoint_id"],
                      "step": manifest and manifest["step"]}))
    return summary


def _run_train(args: argparse.Namespace) -> int:
    config = load_trainer_config(args)
    print_config("train", config)
    train_spec, eval_spec = _data_specs(args)
    if args.check_config:
        return 0
    summary = train_on_local_cluster(
        train_data=train_spec, eval_data=eval_spec, config=config,
        model=ModelConfig(name=args.model), workers=args.workers, shards=args.shards,
        dim=args.dim, ps_lr=args.ps_lr, batch_size=args.batch_size, epochs=args.epochs,
        data_seed=args.data_seed)
    return _finish(summary, args.summary_json)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file with trainer settings")
    parser.add_argument("--check-config", action="store_true",
                        help="print the effective config, check the flags and exit")
    parser.add_argument("--model", default="dlrm", choices=sorted(MODELS))
    parser.add_argument("--train-data", default="synthetic",
                        help="loader spec: criteo:GLOB, avazu:GLOB, parquet:GLOB, "
                             "csv:GLOB?schema=F, kafka://..., synthetic[:ROWS]")
    parser.add_argument("--eval-data", help="loader spec of the held-out data (default for "
                        "synthetic training data: its test split)")
    parser.add_argument("--eval-rows", type=int, default=16384, help="synthetic held-out rows")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the data (shuffles, "
                        "planted data)")
    parser.add_argument("--summary-json", help="write the summary to this JSON file")
    add_flags(parser, TrainerConfig)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    worker = subparsers.add_parser("worker", help="run one NN worker against a running PS")
    _common(worker)
    worker.add_argument("--ps", help="PS shard addresses host:port,... in shard order "
                        "(or --registry)")
    worker.add_argument("--loader", help="host:port of the loader streaming training batches, "
                        "or 'registry' for the one registered at --registry "
                        "(default: planted data generated in this process)")
    worker.add_argument("--eval-loader", help="host:port of a loader of held-out batches")
    job = worker.add_argument_group("job checkpoints (rank 0)")
    job.add_argument("--checkpoint-dir", help="job checkpoints go here (the PS shards' dir)")
    job.add_argument("--checkpoint-every-steps", type=int, default=0, help="0: never")
    job.add_argument("--checkpoint-every-s", type=float, default=0.0, help="0: never")
    job.add_argument("--ps-admin", help="PS admin URLs http://host:port,... (or --registry)")
    job.add_argument("--job-admin-port", type=int, default=None,
                     help="serve POST/GET /v1/job/checkpoints on this port")
    job.add_argument("--resume", action="store_true",
                     help="start from the newest complete job checkpoint's dense state")
    worker.add_argument("--table-prefix", default="", help="PS table = prefix + feature "
                        "(in-memory planted data)")
    worker.set_defaults(func=_run_worker)
    train = subparsers.add_parser("train", help="train on a local cluster (loaders, PS, workers)")
    _common(train)
    train.add_argument("--shards", type=int, default=2, help="PS shard processes")
    train.add_argument("--workers", type=int, default=1, help="worker processes (gloo)")
    train.add_argument("--dim", type=int, default=16, help="embedding dimension")
    train.add_argument("--ps-lr", type=float, default=0.05, help="PS Adagrad learning rate")
    train.set_defaults(func=_run_train)
