"""``persimmon bench push_cost``: what exactly-once pushes cost training, in one run.

One worker (this process, torch at one thread) trains a DLRM on the planted synthetic data
against ``--shards`` PS shard processes over gRPC (nice 10, as in ``bench train``), in
``--mode`` (sync by default: every push is on the step's critical path, the worst case for
its cost). One cluster of shards per way, all started up front with the same tables:

- ``off``: ``--idempotent-pushes false``: every push applied, no fingerprint, no window;
- ``on``: the default: each push checked against the window of applied pushes;
- ``wal_<policy>`` for each of ``--wal-fsync``: ``on`` plus a write-ahead log
  (``--wal-dir`` on this machine's disk, ``--wal-fsync <policy>``).

Each repeat trains the same batches once on every cluster, in turn (the order reversed every
other repeat, so drift hits every way alike). Figures: each way's median samples/s over the
repeats, and ``on_vs_off`` and ``wal_<policy>_vs_off``: the median over repeats of that
ratio within the repeat (the issue asks ``on_vs_off`` >= 0.95).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import main_of
from services.common.commands import int_at_least

__all__ = ["register_bench", "run"]

console = Console(stderr=True)
PS_NICE = 10
POLICIES = ("always", "batch", "never")


def _start_clusters(work: str, ways: list[str], shards: int, config: str
                    ) -> tuple[dict[str, list[str]], list[subprocess.Popen[bytes]]]:
    """The shard addresses of every way and the processes (to stop), all started side by
    side (:func:`~services.local.processes.start_services`: one failing stops them all)."""
    from services.local.processes import start_services

    commands = []
    for way in ways:
        flags = {"off": ["--idempotent-pushes", "false"], "on": []}.get(way)
        if flags is None:
            flags = ["--wal-dir", os.path.join(work, way),
                     "--wal-fsync", way.removeprefix("wal_")]
        for k in range(shards):
            commands.append((
                [sys.executable, "-m", "services.ps", "--log-level", "ERROR", "--config",
                 config, "--shard-id", str(k), "--num-shards", str(shards), *flags],
                os.path.join(work, f"{way}-{k}.ready")))
    started = start_services(commands, timeout=300, nice=PS_NICE)
    addresses = [f"127.0.0.1:{grpc_port}" for _, grpc_port, _ in started]
    return ({way: addresses[i * shards:(i + 1) * shards] for i, way in enumerate(ways)},
            [proc for proc, _, _ in started])


def _train(addresses: list[str], batches: list[Any], config: Any) -> float:
    """Samples/s of one training run on ``batches`` against the shards at ``addresses``."""
    from services.worker.local_ranks import run_local_training
    from services.worker.models import ModelConfig

    return float(run_local_training(ps_addresses=addresses, train_batches=batches,
                                    model=ModelConfig(name="dlrm"),
                                    config=config)["samples_per_s"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import yaml

    from services.loader.planted import SyntheticConfig, SyntheticDataset
    from services.local.processes import stop_processes
    from services.worker.config import TrainerConfig, ps_table_configs

    policies = [p for p in args.wal_fsync.split(",") if p]
    if not set(policies) <= set(POLICIES):
        raise ValueError(f"--wal-fsync takes a comma list of {POLICIES}, got {args.wal_fsync!r}")
    torch.set_num_threads(1)
    data = SyntheticDataset(SyntheticConfig(seed=args.seed))
    features = list(data.config.sparse_names)
    train = list(data.batches(args.batch_size, args.rows))
    tables = ps_table_configs(dict.fromkeys(features, args.dim), seed=args.seed)
    config = TrainerConfig(mode=args.mode, staleness=8, seed=args.seed)
    ways = ["off", "on", *(f"wal_{p}" for p in policies)]
    runs: dict[str, list[float]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory(prefix="persimmon-push-cost-",
                                     dir=args.work_dir) as work:
        ps_config = os.path.join(work, "ps.yaml")
        with open(ps_config, "w") as f:
            yaml.safe_dump({"tables": tables}, f)
        clusters, procs = _start_clusters(work, ways, args.shards, ps_config)
        try:
            for way in ways:  # untimed: torch's and numba's one-time loading, on each path
                _train(clusters[way], train[:2], config)
            for r in range(args.repeats):
                for way in ways if r % 2 == 0 else ways[::-1]:
                    runs[way].append(_train(clusters[way], train, config))
        finally:
            stop_processes(procs)
    ratios = {f"{way}_vs_off": statistics.median(
        b / a for a, b in zip(runs["off"], runs[way], strict=True)) for way in ways[1:]}
    return {"samples_per_s": {way: statistics.median(v) for way, v in runs.items()},
            "samples_per_s_runs": runs, **ratios, "mode": args.mode, "shards": args.shards,
            "rows": args.rows, "batch_size": args.batch_size, "repeats": args.repeats,
            "load_average": os.getloadavg()[0]}


def _print(result: dict[str, Any]) -> None:
    table = Table(title=f"push cost: samples/s of one worker, {result['shards']} shard "
                        f"processes, {result['mode']} mode, median of {result['repeats']} "
                        "paired repeats")
    table.add_column("way")
    table.add_column("samples/s", justify="right")
    table.add_column("vs off (median of paired ratios)", justify="right")
    for way, rate in result["samples_per_s"].items():
        ratio = result.get(f"{way}_vs_off")
        table.add_row(way, f"{rate:,.0f}", "1.000" if ratio is None else f"{ratio:.3f}")
    console.print(table)


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "push_cost", help="training samples/s with idempotent pushes off, on, and with the WAL")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--rows", type=int, default=65536, help="planted training rows a run")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--dim", type=int, default=16, help="embedding dimension")
    parser.add_argument("--shards", type=int, default=2, help="PS shard processes per way")
    parser.add_argument("--mode", default="sync", choices=["sync", "hybrid", "async"])
    parser.add_argument("--wal-fsync", default="batch,always",
                        help=f"comma list of WAL fsync policies to measure, of {POLICIES}")
    parser.add_argument("--repeats", type=int_at_least(1), default=7, help="paired repeats")
    parser.add_argument("--work-dir", help="where the WALs go (default: the temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=main_of(run, _print))
