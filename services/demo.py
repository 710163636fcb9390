"""``persimmon demo``: a local cluster on this machine, no Docker, no Redis.

It starts PS shard processes on loopback ports, trains a DLRM with gloo workers in PERSIA's
hybrid mode on planted synthetic data (in memory until the LoaderClient lands), and prints
test AUC against the data's oracle AUC, throughput and bytes on the wire, plus a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from services.cluster.supervise import Supervisor

__all__ = ["LocalPS", "register_cli"]

console = Console()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPS:
    """``num_shards`` PS processes on loopback ports; a context manager that stops them.

    ``registry``: the shards register there. ``supervise=True``: a shard that dies is started
    again on the same ports from the newest complete job checkpoint in ``checkpoint_dir``
    (``--restore job``); ``supervisor.restarts`` records each restart.
    """

    def __init__(self, num_shards: int, tables: list[dict[str, Any]],
                 checkpoint_dir: str | None = None, *, registry: str | None = None,
                 supervise: bool = False) -> None:
        if supervise and not checkpoint_dir:
            raise ValueError("supervise=True needs a checkpoint_dir to restart from")
        self.num_shards = num_shards
        self.tables = tables
        self.checkpoint_dir = checkpoint_dir
        self.registry = registry
        self.procs: list[subprocess.Popen[bytes]] = []
        self.commands: list[list[str]] = []
        self.addresses: list[str] = []
        self.admin_urls: list[str] = []
        self.supervisor: Supervisor | None = None
        self._supervise = supervise
        self._tmp = tempfile.TemporaryDirectory(prefix="persimmon-demo-")

    def __enter__(self) -> LocalPS:
        import yaml

        config = os.path.join(self._tmp.name, "ps.yaml")
        with open(config, "w") as f:
            yaml.safe_dump({"tables": self.tables}, f)
        for k in range(self.num_shards):
            grpc_port, admin_port = _free_port(), _free_port()
            cmd = [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "ps",
                   "--config", config, "--shard-id", str(k), "--num-shards", str(self.num_shards),
                   "--grpc-port", str(grpc_port), "--admin-port", str(admin_port)]
            if self.checkpoint_dir:
                cmd += ["--checkpoint-dir", self.checkpoint_dir]
            if self.registry:
                cmd += ["--registry", self.registry]
            self.commands.append(cmd)
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
            self.addresses.append(f"127.0.0.1:{grpc_port}")
            self.admin_urls.append(f"http://127.0.0.1:{admin_port}")
        for proc, url in zip(self.procs, self.admin_urls, strict=True):
            _wait_ready(proc, url)
        if self._supervise:
            self.supervisor = Supervisor(self.procs, self._restart).start()
        return self

    def _restart(self, k: int) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([*self.commands[k], "--restore", "job"], stdout=subprocess.DEVNULL)
        _wait_ready(proc, self.admin_urls[k])
        return proc

    def __exit__(self, *exc: object) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._tmp.cleanup()


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"PS at {url} did not become ready")
        time.sleep(0.1)


def _plot(summary: dict[str, Any], path: str) -> None:
    """Loss (moving average) against step and held-out AUC against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = np.asarray(summary.get("losses", []), dtype=np.float64)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    if losses.size:
        window = max(1, losses.size // 50)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax1.plot(np.arange(smooth.size) + window, smooth)
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


def _progress(cluster: LocalPS, total_steps: int, tables: list[str], done: Any) -> None:
    """A progress bar fed by the PS itself: pushes acknowledged per table = steps done.

    It polls the admin REST API (not gRPC: the workers are forked, and a process must not
    fork while gRPC threads run in it)."""
    def pushes() -> int:
        total = 0
        for url in cluster.admin_urls:
            for name in tables:
                with urllib.request.urlopen(f"{url}/v1/tables/{name}/stats", timeout=5) as r:
                    total += json.load(r)["pushes"]
        return total

    with Progress(console=console) as progress:
        task = progress.add_task("training (steps acknowledged by the PS)", total=total_steps)
        while not done.is_set():
            steps = pushes() / (len(tables) * cluster.num_shards)
            progress.update(task, completed=min(total_steps, steps))
            done.wait(0.5)
        progress.update(task, completed=total_steps)


def _run(args: argparse.Namespace) -> int:
    import threading

    from services.loader.synthetic import SyntheticConfig, SyntheticDataset
    from services.worker.config import TrainerConfig, ps_table_configs
    from services.worker.local import run_local_training
    from services.worker.models import ModelConfig

    dataset = SyntheticDataset(SyntheticConfig(seed=args.seed))
    features = dataset.config.sparse_names
    train = list(dataset.batches(args.batch_size, args.rows, "train"))
    test = list(dataset.batches(4096, args.eval_rows, "test"))
    oracle = dataset.oracle(args.eval_rows)
    config = TrainerConfig(mode=args.mode, staleness=args.staleness, seed=args.seed,
                           eval_every=max(1, len(train) // args.workers // 4))
    console.print(f"[bold]persimmon demo[/]: {args.shards} PS shards, {args.workers} workers "
                  f"(gloo), DLRM, {args.rows:,} planted rows, mode {args.mode}")
    tables = ps_table_configs({f: args.dim for f in features})
    with LocalPS(args.shards, tables) as cluster:
        done = threading.Event()
        bar = threading.Thread(target=_progress, daemon=True,
                               args=(cluster, len(train) // args.workers,
                                     [t["name"] for t in tables], done))
        bar.start()
        try:
            summary = run_local_training(ps_addresses=cluster.addresses, train_batches=train,
                                         eval_batches=test, model=ModelConfig(name="dlrm"),
                                         config=config, num_workers=args.workers)
        finally:
            done.set()
            bar.join(timeout=5)
    summary.update(oracle_auc=oracle["auc"], oracle_logloss=oracle["logloss"])
    _print_summary(summary, args)
    png = args.plot or "demo.png"
    _plot(summary, png)
    console.print(f"loss and AUC curves: {png}")
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump({k: v for k, v in summary.items() if k != "losses"}, f, indent=2)
    return 0


def _print_summary(summary: dict[str, Any], args: argparse.Namespace) -> None:
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
    parser.add_argument("--shards", type=int, default=2, help="PS shard processes")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (gloo)")
    parser.add_argument("--rows", type=int, default=131072, help="planted training rows")
    parser.add_argument("--eval-rows", type=int, default=16384, help="held-out rows")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--mode", default="hybrid", choices=["sync", "hybrid", "async"])
    parser.add_argument("--staleness", type=int, default=8, help="bound S of hybrid mode")
    parser.add_argument("--dim", type=int, default=16, help="embedding dimension")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="PNG of the loss and AUC curves (default demo.png)")
    parser.add_argument("--summary-json", help="write the summary to this JSON file")
    parser.set_defaults(func=_run)
