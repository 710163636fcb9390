"""``persimmon loader``, ``persimmon loader produce`` and ``persimmon synth``.

    persimmon loader --source SPEC --grpc-port P --admin-port Q [--config loader.yaml] ...
    persimmon loader produce --topic T --bootstrap HOST:PORT FILE
    persimmon synth --rows N --out DIR [--seed S] [--test-rows M]

``python -m services.loader <command> ...`` runs the same commands.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from services.common.commands import (
    add_service_command,
    float_at_least,
    input_file,
    int_at_least,
    run_commands,
)
from services.common.config import flag_values, load_config
from services.common.lifecycle import serve_from_flags
from services.loader.config import LoaderConfig

__all__ = ["load_loader_config", "main", "register_cli"]


def load_loader_config(args: argparse.Namespace) -> LoaderConfig:
    return load_config(LoaderConfig, yaml_path=args.config, env_prefix="PERSIMMON_LOADER_",
                       flags=flag_values(LoaderConfig, args))


def _run(args: argparse.Namespace) -> int:
    from services.loader.service import LoaderService
    from services.loader.sources import check_source

    config = load_loader_config(args)
    check_source(config.source)  # its files and schema, before serving (or --check-config)
    return serve_from_flags(args, "loader", config, LoaderService)


def _produce(args: argparse.Namespace) -> int:
    from services.loader.sources.kafka import produce_file

    sent = asyncio.run(produce_file(args.bootstrap, args.topic, args.file,
                                    partitions=args.partitions))
    print(json.dumps({"topic": args.topic, "records": sent}))
    return 0


def _synth(args: argparse.Namespace) -> int:
    from services.loader.planted import SyntheticDataset, synthetic_profile

    dataset = SyntheticDataset(synthetic_profile(args.profile, seed=args.seed,
                                                 max_vocab=args.max_vocab, zipf=args.zipf))
    meta = dataset.write(args.out, args.rows, args.test_rows)
    print(json.dumps({k: meta[k] for k in ("train_rows", "test_rows", "oracle", "source",
                                             "test_source")}, indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``loader`` (with its ``produce`` subcommand) and ``synth`` to ``subparsers``."""
    loader = add_service_command(
        subparsers, "loader", LoaderConfig, _run,
        help="run a data loader (or: loader produce, to fill a Kafka topic)",
        description="Run a data loader. Settings come from --config YAML, PERSIMMON_LOADER_* "
                    "environment variables and flags (flags win). SPEC is criteo:GLOB, "
                    "avazu:GLOB, parquet:GLOB, csv:GLOB?schema=FILE, "
                    "kafka://HOST:PORT/TOPIC?group=G, redis://HOST:PORT/STREAM?group=G "
                    "or synthetic:ROWS.",
        config_help="YAML file with loader settings",
        ready_help="write the bound ports here as JSON once serving (launchers that pass "
                   "port 0 wait for it)")
    sub = loader.add_subparsers(dest="loader_command", required=False, metavar="produce")
    produce = sub.add_parser("produce", help="send every line of FILE to a Kafka topic")
    produce.add_argument("--topic", required=True)
    produce.add_argument("--bootstrap", required=True, help="HOST:PORT of a Kafka broker")
    produce.add_argument("--partitions", type=int_at_least(1), default=None,
                         help="use only the first N partitions (default: all)")
    produce.add_argument("file", type=input_file,
                         help="Criteo/CSV/JSON-lines file, plain or gzip")
    produce.set_defaults(func=_produce)

    synth = subparsers.add_parser(
        "synth", help="write planted synthetic train/test files and their oracle metrics",
        description="Write DIR/train.txt and DIR/test.txt (Criteo layout) and "
                    "DIR/synthetic.json with the teacher's oracle AUC and logloss.")
    synth.add_argument("--rows", type=int_at_least(1), required=True, help="training rows")
    synth.add_argument("--out", required=True, help="output directory")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--test-rows", type=int_at_least(1), default=50_000, help="test rows")
    synth.add_argument("--profile", default="toy",
                       help="toy: 8 small vocabularies; criteo: Criteo Kaggle's 26 "
                            "vocabularies (capped at --max-vocab), Zipf 1.1, 13 counts")
    synth.add_argument("--max-vocab", type=int_at_least(2), default=1_000_000,
                       help="criteo profile: the largest vocabulary")
    synth.add_argument("--zipf", type=float_at_least(0, inclusive=False), default=None,
                       help="the ids' Zipf exponent (default: the profile's)")
    synth.set_defaults(func=_synth)

    from services.loader.prepare import register_prepare

    register_prepare(subparsers)


def main(argv: list[str] | None = None) -> int:
    """``python -m services.loader [--log-level LEVEL] loader|synth ...``."""
    return run_commands(register_cli, argv, prog="python -m services.loader",
                        description="Run a data loader, fill a Kafka topic or write planted "
                                    "data.")


if __name__ == "__main__":
    raise SystemExit(main())
