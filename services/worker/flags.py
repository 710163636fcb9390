"""The flags of every command that trains (``persimmon worker``, ``persimmon train``) and the
trainer config they give."""

from __future__ import annotations

import argparse

from services.common.commands import int_at_least, output_file
from services.common.config import add_flags, flag_values, load_config
from services.worker.config import TrainerConfig
from services.worker.models import MODELS

__all__ = ["add_training_flags", "load_trainer_config"]


def load_trainer_config(args: argparse.Namespace) -> TrainerConfig:
    """The trainer config of the flags, over ``--config`` YAML and PERSIMMON_WORKER_* ."""
    return load_config(TrainerConfig, yaml_path=args.config, env_prefix="PERSIMMON_WORKER_",
                       flags=flag_values(TrainerConfig, args))


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of every command that trains (``worker``, ``train``): config, model, data,
    summary and every :class:`TrainerConfig` field."""
    parser.add_argument("--config", help="YAML file with trainer settings")
    parser.add_argument("--check-config", action="store_true",
                        help="print the effective config, check the flags and exit")
    parser.add_argument("--model", default="dlrm", choices=sorted(MODELS))
    parser.add_argument("--train-data", default="synthetic",
                        help="loader spec: criteo:GLOB, avazu:GLOB, parquet:GLOB, "
                             "csv:GLOB?schema=F, kafka://..., synthetic[:ROWS]")
    parser.add_argument("--eval-data", help="loader spec of the held-out data (default for "
                        "synthetic training data: its test split)")
    parser.add_argument("--eval-rows", type=int_at_least(1), default=16384,
                        help="synthetic held-out rows")
    parser.add_argument("--epochs", type=int_at_least(1), default=1)
    parser.add_argument("--batch-size", type=int_at_least(1), default=512)
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the data (shuffles, "
                        "planted data)")
    parser.add_argument("--summary-json", type=output_file,
                        help="write the summary to this JSON file")
    add_flags(parser, TrainerConfig)
