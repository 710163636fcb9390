"""``persimmon worker``: run one NN worker against a running PS (see :mod:`services.worker.service`).

    persimmon worker --ps HOST:PORT,... | --registry URL  [--loader HOST:PORT|registry] ...
    python -m services.worker [--log-level LEVEL] --ps ... --loader ...   (the same command)

``python -m services.worker`` needs ``--loader``: batches generated in process come from the
loader's planted data generator, which ``persimmon worker`` adds (the worker never imports the
loader).
"""

from __future__ import annotations

import argparse
import functools
import sys

from services.common.commands import float_at_least, int_at_least, run_single
from services.worker.flags import add_training_flags, load_trainer_config
from services.worker.service import InProcessSource

__all__ = ["main", "register_cli"]


def _run(args: argparse.Namespace, *, in_process: InProcessSource | None) -> int:
    from services.worker.service import run_worker

    return run_worker(args, load_trainer_config(args), in_process=in_process)


def register_cli(subparsers: argparse._SubParsersAction, *,
                 in_process: InProcessSource | None = None) -> None:
    """Add ``worker``; ``in_process`` serves the batches when no ``--loader`` is given."""
    worker = subparsers.add_parser("worker", help="run one NN worker against a running PS")
    add_training_flags(worker)
    worker.add_argument("--ps", help="PS shard addresses host:port,... in shard order "
                        "(or --registry)")
    worker.add_argument("--loader", help="host:port of the loader streaming training batches, "
                        "or 'registry' for the one registered at --registry "
                        "(default: planted data generated in this process)")
    worker.add_argument("--eval-loader", help="host:port of a loader of held-out batches")
    job = worker.add_argument_group("job checkpoints (rank 0)")
    job.add_argument("--checkpoint-dir", help="job checkpoints go here (the PS shards' dir)")
    job.add_argument("--checkpoint-every-steps", type=int_at_least(0), default=0, help="0: never")
    job.add_argument("--checkpoint-every-s", type=float_at_least(0), default=0.0, help="0: never")
    job.add_argument("--keep-checkpoints", type=int_at_least(0), default=0,
                     help="complete job checkpoints kept: after each, older ones are removed "
                          "(0: keep all)")
    job.add_argument("--ps-admin", help="PS admin URLs http://host:port,... (or --registry)")
    job.add_argument("--job-admin-port", type=int_at_least(0), default=None,
                     help="serve POST/GET /v1/job/checkpoints on this port")
    job.add_argument("--resume", action="store_true",
                     help="start from the newest complete job checkpoint's dense state")
    worker.add_argument("--table-prefix", default="", help="PS table = prefix + feature "
                        "(in-memory planted data)")
    worker.set_defaults(func=functools.partial(_run, in_process=in_process))


def main(argv: list[str] | None = None) -> int:
    """``python -m services.worker [--log-level LEVEL] FLAGS...``."""
    return run_single("worker", register_cli, sys.argv[1:] if argv is None else argv,
                      prog="python -m services.worker",
                      description="Run one NN worker against a running PS and loader.")


if __name__ == "__main__":
    raise SystemExit(main())
