"""``persimmon demo``: a local cluster on this machine, no Docker, no Redis.

Today it starts two PS shard processes on loopback ports and drives lookup/push rounds
through :class:`clients.ps_client.PSClient`, printing what crossed the wire. (Training with
workers and the loader joins it as those services land.)
"""

from __future__ import annotations

import argparse
import asyncio
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

from clients.ps_client import PSClient

__all__ = ["LocalPS", "register_cli"]

console = Console()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPS:
    """``num_shards`` PS processes on loopback ports; a context manager that stops them."""

    def __init__(self, num_shards: int, tables: list[dict[str, Any]],
                 checkpoint_dir: str | None = None) -> None:
        self.num_shards = num_shards
        self.tables = tables
        self.checkpoint_dir = checkpoint_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.addresses: list[str] = []
        self.admin_urls: list[str] = []
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
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
            self.addresses.append(f"127.0.0.1:{grpc_port}")
            self.admin_urls.append(f"http://127.0.0.1:{admin_port}")
        for proc, url in zip(self.procs, self.admin_urls, strict=True):
            _wait_ready(proc, url)
        return self

    def __exit__(self, *exc: object) -> None:
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


async def _rounds(addresses: list[str], rounds: int, batch: int, dim: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    async with PSClient(addresses, rows_codec="fp16", grads_codec="fp16") as ps:
        started = time.perf_counter()
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("lookup → push rounds", total=rounds)
            for _ in range(rounds):
                ids = rng.zipf(1.2, size=batch).astype(np.uint64)
                rows = await ps.lookup("demo", ids)
                await ps.push("demo", ids, 0.1 * rows)  # pull every row toward zero
                progress.advance(task)
        elapsed = time.perf_counter() - started
        stats = await ps.stats("demo")
        return {"rounds": rounds, "ids_per_s": rounds * batch / elapsed,
                "rows": sum(s["tables"]["demo"]["rows"] for s in stats),
                "wire_bytes": ps.wire_bytes()}


def _run(args: argparse.Namespace) -> int:
    tables = [{"name": "demo", "dim": args.dim, "optimizer": {"kind": "adagrad", "lr": 0.05}}]
    console.print(f"[bold]persimmon demo[/]: {args.shards} PS shards on loopback")
    with LocalPS(args.shards, tables) as cluster:
        summary = asyncio.run(_rounds(cluster.addresses, args.rounds, args.batch, args.dim))
    table = Table(title="demo summary")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("PS shards", str(args.shards))
    table.add_row("rounds (lookup + push)", str(summary["rounds"]))
    table.add_row("ids per second", f"{summary['ids_per_s']:,.0f}")
    table.add_row("rows stored", f"{summary['rows']:,}")
    for stream, n in summary["wire_bytes"].items():
        table.add_row(f"wire bytes {stream}", f"{n:,}")
    console.print(table)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run a local cluster end to end (no Docker)")
    parser.add_argument("--shards", type=int, default=2, help="PS shard processes")
    parser.add_argument("--rounds", type=int, default=200, help="lookup/push rounds")
    parser.add_argument("--batch", type=int, default=4096, help="ids per round")
    parser.add_argument("--dim", type=int, default=16, help="embedding dimension")
    parser.add_argument("--summary-json", help="write the summary to this JSON file")
    parser.set_defaults(func=_run)
