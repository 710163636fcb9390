"""``persimmon demo``: a local cluster on this machine, no Docker, no Redis.

It starts a loader process streaming planted synthetic data (and one for its test split), PS
shard processes on loopback ports, and gloo workers that train a DLRM in PERSIA's hybrid mode;
a progress bar follows worker rank 0's admin API, and the URL of that API's live page
(``/dashboard``) is printed; it ends with test AUC against the data's oracle AUC, throughput
and bytes on the wire per stream, plus a PNG of the curves.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import urllib.request
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress, TextColumn
from rich.table import Table

from services.common.commands import float_at_least, int_at_least, output_file
from services.common.config import add_flags, flag_values, load_config
from services.common.errors import ConfigError
from services.common.ports import free_port
from services.local.processes import stopping_children_on_sigterm
from services.worker.config import SYNC_FIELDS, TrainerConfig

__all__ = ["register_cli"]

console = Console()
_POSITIVE = int_at_least(1)


def _plot(summary: dict[str, Any], path: str) -> None:
    """Loss (mean over spans of steps) against step and held-out AUC against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = np.asarray(summary.get("loss_curve", []), dtype=np.float64).reshape(-1, 2)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    if curve.size:  # (first step, mean loss) of spans of steps: the whole run, bounded
        ax1.plot(curve[:, 0], curve[:, 1])
    ax1.set(title="training loss (rank 0)", xlabel="step", ylabel="log loss")
    history = summary.get("history", [])
    if history:
        ax2.plot([h["step"] for h in history], [h["auc"] for h in history], marker="o",
                 label="test AUC")
    ax2.axhline(summary["oracle_auc"], color="gray", linestyle="--", label="oracle AUC")
    ax2.set(title="held-out AUC", xlabel="step", ylabel="AUC")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (the admin ports of worker ranks 0 and 1)."""
    while True:
        port = free_port()
        if port < 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue


def _progress(url: str, total_steps: int, done: threading.Event) -> None:
    """A progress bar fed by worker rank 0's ``GET /v1/progress`` (REST, not gRPC: the
    workers are forked, and a process must not fork while gRPC threads run in it)."""
    columns = [*Progress.get_default_columns(), TextColumn("{task.fields[status]}")]
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("training (rank 0 steps)", total=total_steps, status="starting")
        while not done.is_set():
            try:
                with urllib.request.urlopen(url + "/v1/progress", timeout=2) as r:
                    p = json.load(r)
            except OSError:  # not serving yet, or already gone
                done.wait(0.5)
                continue
            status = f"{p['samples_per_s'] * p['world_size']:,.0f} samples/s"
            if p["loss"] is not None:
                status += f"  loss {p['loss']:.4f}"
            if p["eval"]:
                status += f"  AUC {p['eval']['auc']:.4f}"
            bar.update(task, completed=min(total_steps, p["step"]), status=status)
            done.wait(0.5)
        bar.update(task, completed=total_steps)


def _run(args: argparse.Namespace) -> int:
    from services.local.train import train_on_local_cluster
    from services.worker.models import ModelConfig
    from services.worker.service import check_result, failure_summary, write_summary

    batches = -(-args.rows // args.batch_size)
    if batches < args.workers:
        raise ConfigError(f"--rows {args.rows} makes {batches} batches of --batch-size "
                          f"{args.batch_size}: fewer than --workers {args.workers}")
    total_steps = args.rows // args.batch_size // args.workers
    admin_port = _free_port_pair()
    config = load_config(TrainerConfig, flags={  # --mode, --staleness, --lr, --seed, --sync*
        **flag_values(TrainerConfig, args), "pooling": "mean", "admin_port": admin_port,
        "eval_every": max(1, total_steps // 4)})
    console.print(f"[bold]persimmon demo[/]: a loader, {args.shards} PS shards and "
                  f"{args.workers} workers (gloo) train a DLRM on {args.rows:,} planted rows, "
                  f"mode {args.mode}" + (f" S={args.staleness}" if args.mode == "hybrid" else ""))
    console.print(f"live page: http://127.0.0.1:{admin_port}/dashboard")
    done = threading.Event()
    bar = threading.Thread(target=_progress, daemon=True,
                           args=(f"http://127.0.0.1:{admin_port}", total_steps, done))
    bar.start()
    try:
        with stopping_children_on_sigterm(), failure_summary(args.summary_json):
            summary = train_on_local_cluster(
                train_data=f"synthetic:{args.rows}",
                eval_data=f"synthetic:{args.eval_rows}?split=test", config=config,
                model=ModelConfig(name="dlrm"), workers=args.workers, shards=args.shards,
                dim=args.dim, batch_size=args.batch_size, data_seed=args.seed)
    finally:
        done.set()
        bar.join(timeout=5)
    check_result(summary, args.summary_json)
    _print_summary(summary)
    png = args.plot or "demo.png"
    _plot(summary, png)
    console.print(f"loss and AUC curves: {png}")
    write_summary(summary, args.summary_json)
    return 0


def _print_summary(summary: dict[str, Any]) -> None:
    table = Table(title="demo summary")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("test AUC", f"{summary['auc']:.4f}")
    table.add_row("oracle AUC (teacher's own probabilities)", f"{summary['oracle_auc']:.4f}")
    table.add_row("test log loss / oracle", f"{summary['logloss']:.4f} / {summary['oracle_logloss']:.4f}")
    table.add_row("samples/s (all workers)", f"{summary['samples_per_s']:,.0f}")
    table.add_row("steps (rank 0)", str(summary["steps"]))
    table.add_row("mode, max staleness seen", f"{summary['mode']}, {summary['staleness_max']}")
    for stream, n in summary["wire_bytes"].items():
        table.add_row(f"wire bytes {stream}", f"{n:,}")
    console.print(table)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="train on a local cluster end to end (no Docker, no Redis)")
    parser.add_argument("--shards", type=_POSITIVE, default=2, help="PS shard processes")
    parser.add_argument("--workers", type=_POSITIVE, default=2, help="worker processes (gloo)")
    parser.add_argument("--rows", type=_POSITIVE, default=1048576, help="planted training rows")
    parser.add_argument("--eval-rows", type=_POSITIVE, default=65536, help="held-out rows")
    parser.add_argument("--batch-size", type=_POSITIVE, default=256)
    parser.add_argument("--mode", default="hybrid", choices=["sync", "hybrid", "async"])
    parser.add_argument("--staleness", type=int_at_least(0), default=8,
                        help="bound S of hybrid mode")
    parser.add_argument("--dim", type=_POSITIVE, default=16, help="embedding dimension")
    parser.add_argument("--lr", type=float_at_least(0, inclusive=False), default=3e-3,
                        help="dense Adam learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=output_file,
                        help="PNG of the loss and AUC curves (default demo.png)")
    parser.add_argument("--summary-json", type=output_file,
                        help="write the summary to this JSON file")
    add_flags(parser, TrainerConfig, only=SYNC_FIELDS)
    parser.set_defaults(func=_run)
