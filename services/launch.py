"""The local launcher: ``persimmon worker`` and ``persimmon train`` run the Trainer from flags or YAML.

It sits above the services (like ``services.demo``) because, until the LoaderClient lands,
it feeds planted synthetic data from ``services.loader.synthetic`` in memory.

- ``worker``: one worker against a running PS (``--ps host:port,...`` in shard order).
- ``train``: a local cluster (PS shard processes + N workers) on this machine.

Until the LoaderClient lands, both read planted synthetic data in memory
(``--train-data synthetic[:ROWS]``).
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from services.common.config import add_flags, flag_values, load_config, print_config
from services.common.errors import ConfigError
from services.worker.config import TrainerConfig, ps_table_configs
from services.worker.models import MODELS, ModelConfig

__all__ = ["load_trainer_config", "register_cli"]


def load_trainer_config(args: argparse.Namespace) -> TrainerConfig:
    return load_config(TrainerConfig, yaml_path=args.config, env_prefix="PERSIMMON_WORKER_",
                       flags=flag_values(TrainerConfig, args))


def _train_rows(args: argparse.Namespace) -> int:
    """The row count of ``--train-data synthetic[:ROWS]``."""
    kind, _, rows = str(args.train_data).partition(":")
    if kind != "synthetic":
        raise ConfigError(f"--train-data {args.train_data!r}: only 'synthetic[:ROWS]' is "
                          "supported until the loader client lands")
    try:
        return int(rows) if rows else 65536
    except ValueError as exc:
        raise ConfigError(f"--train-data: bad row count {rows!r}") from exc


def _synthetic(args: argparse.Namespace) -> tuple[Any, list[Any], list[Any], dict[str, Any]]:
    """(dataset, train batches, test batches, oracle) from ``--train-data synthetic[:ROWS]``."""
    train_rows = _train_rows(args)
    from services.loader.synthetic import SyntheticConfig, SyntheticDataset

    dataset = SyntheticDataset(SyntheticConfig(seed=args.data_seed))
    train = [b for _ in range(args.epochs)
             for b in dataset.batches(args.batch_size, train_rows, "train")]
    test = list(dataset.batches(4096, args.eval_rows, "test"))
    return dataset, train, test, dataset.oracle(args.eval_rows)


def _finish(summary: dict[str, Any], oracle: dict[str, Any], path: str | None) -> int:
    summary["oracle_auc"] = oracle["auc"]
    summary["oracle_logloss"] = oracle["logloss"]
    summary.pop("losses", None)
    line = {k: summary[k] for k in ("mode", "steps", "auc", "oracle_auc", "logloss",
                                    "samples_per_s", "staleness_max", "wire_bytes")}
    print(json.dumps(line, indent=2))
    if path:
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def _run_worker(args: argparse.Namespace) -> int:
    import asyncio

    from services.worker.distributed import init_distributed
    from services.worker.trainer import Trainer

    config = load_trainer_config(args)
    print_config("worker", config)
    if not args.ps and not config.registry:
        raise ConfigError("give --ps (PS shard addresses in shard order) or --registry")
    _train_rows(args)
    if args.check_config:
        return 0
    info = init_distributed()  # a process group when torchrun (or compose) set WORLD_SIZE
    dataset, train, test, oracle = _synthetic(args)
    if info.world_size > 1:
        steps = len(train) // info.world_size
        train = train[info.rank::info.world_size][:steps]
        test = test[info.rank::info.world_size]
    tables = {f: args.table_prefix + f for f in dataset.config.sparse_names}
    addresses = args.ps.split(",") if args.ps else []

    async def main() -> dict[str, Any]:
        async with Trainer(model=ModelConfig(name=args.model), ps_addresses=addresses,
                           tables=tables, config=config) as trainer:
            return await trainer.fit(train, eval_batches=test)

    return _finish(asyncio.run(main()), oracle, args.summary_json)


def _run_train(args: argparse.Namespace) -> int:
    from services.demo import LocalPS
    from services.worker.local import run_local_training

    config = load_trainer_config(args)
    print_config("train", config)
    _train_rows(args)
    if args.check_config:
        return 0
    dataset, train, test, oracle = _synthetic(args)
    features = dataset.config.sparse_names
    tables = ps_table_configs({f: args.dim for f in features}, lr=args.ps_lr)
    with LocalPS(args.shards, tables) as cluster:
        summary = run_local_training(ps_addresses=cluster.addresses, train_batches=train,
                                     eval_batches=test, model=ModelConfig(name=args.model),
                                     config=config, num_workers=args.workers)
    return _finish(summary, oracle, args.summary_json)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file with trainer settings")
    parser.add_argument("--check-config", action="store_true",
                        help="print the effective config, check the flags and exit")
    parser.add_argument("--model", default="dlrm", choices=sorted(MODELS))
    parser.add_argument("--train-data", default="synthetic", help="synthetic[:ROWS]")
    parser.add_argument("--eval-rows", type=int, default=16384, help="held-out rows")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic data")
    parser.add_argument("--summary-json", help="write the summary to this JSON file")
    add_flags(parser, TrainerConfig)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    worker = subparsers.add_parser("worker", help="run one NN worker against a running PS")
    _common(worker)
    worker.add_argument("--ps", help="PS shard addresses host:port,... in shard order "
                        "(or --registry)")
    worker.add_argument("--table-prefix", default="", help="PS table = prefix + feature")
    worker.set_defaults(func=_run_worker)
    train = subparsers.add_parser("train", help="train on a local cluster (PS + workers)")
    _common(train)
    train.add_argument("--shards", type=int, default=2, help="PS shard processes")
    train.add_argument("--workers", type=int, default=1, help="worker processes (gloo)")
    train.add_argument("--dim", type=int, default=16, help="embedding dimension")
    train.add_argument("--ps-lr", type=float, default=0.05, help="PS Adagrad learning rate")
    train.set_defaults(func=_run_train)


if __name__ == "__main__":
    import sys

    from services.cli import main

    logging.basicConfig(level=logging.INFO)
    raise SystemExit(main(sys.argv[1:]))
