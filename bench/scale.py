"""Benchmark: how one PS table's cost grows with its rows, all in RAM and with the disk tier.

Each case builds one table of ``rows`` rows (ids a fixed bijection of ``0..rows-1``, created
by lookups in chunks: the build time), then runs Zipf(1.1) traffic over those rows: a
``batch`` of ids is drawn (duplicates removed, as a worker sends them), looked up, and
receives one push (Adagrad by default, ``--optimizer``; Zipf truncated to the table: draws past
its rows are redrawn).
Every table is built first and runs ``warmup`` untimed steps. A tiered table is then timed
right after its build (cold rows/s: its RAM tier holds the last rows built, not the hot
ones) and settles (untimed steps until it has promoted ``ram_rows`` rows), the steady state
of a training job. Then every case runs ``repeats`` rounds of ``steps`` steps, the cases in
alternating order; a round's rows/s is its rows over its time (a tiered table's write-backs
come in bursts: the median step would hide them), a case's the median of its rounds'.
Reported per case: lookup + push rows/s, the RAM tier's hit ratio (rows a lookup found in
RAM; 1 for RAM-only tables), RAM bytes per row (everything the table
allocates in RAM, indexes included, over its rows), disk bytes per row (blocks of the arena
file) and the build time. The baseline is the all-in-RAM table of the same run.

Run: ``persimmon bench scale [--ram-sizes 1000000,10000000] [--disk-sizes 10000000]
[--ram-rows 1000000] [--optimizer rowwise_adagrad] [--json PATH] [--plot PNG]``.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import track

from bench import save_plot, write_json
from services.common.commands import int_at_least
from services.ps.optimizers import state_layout
from services.ps.store import EmbeddingTable
from services.ps.tables import OptimizerConfig, OptimizerKind, StorageConfig, TableConfig

__all__ = ["bench_scale", "register_bench"]

ZIPF_A = 1.1
_SCRAMBLE = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it is a bijection of uint64


def _ids(ranks: np.ndarray) -> np.ndarray:
    """The id of each popularity rank (spread over uint64, so hot ids are not neighbours)."""
    return ranks.astype(np.uint64) * _SCRAMBLE


def zipf_ranks(rng: np.random.Generator, n: int, rows: int) -> np.ndarray:
    """``n`` popularity ranks in ``[0, rows)`` drawn from Zipf(1.1) truncated to ``rows``."""
    out = np.empty(0, dtype=np.int64)
    while out.shape[0] < n:
        z = rng.zipf(ZIPF_A, n)
        out = np.concatenate([out, z[z <= rows] - 1])
    return out[:n]


def _config(rows: int, dim: int, optimizer: str, disk: str | None, ram_rows: int,
            batch: int) -> TableConfig:
    storage = (StorageConfig() if disk is None
               else StorageConfig(tier="disk", path=disk, ram_rows=ram_rows))
    capacity = rows if disk is None else ram_rows + batch
    return TableConfig(name="scale", dim=dim, initial_capacity=capacity, storage=storage,
                       optimizer=OptimizerConfig(kind=optimizer, lr=0.05))


def _build(config: TableConfig, rows: int, chunk: int) -> tuple[EmbeddingTable, float]:
    t0 = time.perf_counter()
    table = EmbeddingTable(config)
    for start in range(0, rows, chunk):
        table.lookup(_ids(np.arange(start, min(rows, start + chunk))))
    return table, time.perf_counter() - t0


class Case:
    """One table of the run: built, warmed up (a tiered one also timed cold, then settled), then
    timed in rounds of ``steps`` steps by :meth:`time_round`, alternating with the others.

    A tiered table is timed cold right after the build (its RAM tier holds the last rows
    built) and then settles, with untimed steps until it has promoted ``ram_rows`` rows (at
    most ``settle_max`` steps): the rounds time a training job's steady state."""

    def __init__(self, rows: int, *, dim: int = 16, optimizer: str = "adagrad",
                 disk: str | None = None, ram_rows: int = 1_000_000, batch: int = 65_536,
                 steps: int = 20, warmup: int = 3, settle_max: int = 2000, seed: int = 0) -> None:
        self.rows, self.dim, self.batch, self.steps = rows, dim, batch, steps
        self.config = _config(rows, dim, optimizer, disk, ram_rows, batch)
        self.table, build_s = _build(self.config, rows,
                                     chunk=min(ram_rows, 1 << 20) if disk else 1 << 20)
        self.rng = np.random.default_rng(seed)
        self.info: dict[str, Any] = {"rows": rows, "tier": "ram" if disk is None else "disk",
                                     "ram_rows": rows if disk is None else ram_rows,
                                     "build_s": build_s}
        self._run(warmup)
        if disk is not None:
            times, sent = self._run(steps)
            self.info["cold_rows_per_s"] = sum(sent) / sum(times)
            start, settle = self.table.stats().promoted, 0
            while self.table.stats().promoted - start < ram_rows and settle < settle_max:
                settle += len(self._run(1)[0])
            self.info["settle_steps"] = settle
        self.before = self.table.stats()
        self.round_rates: list[float] = []
        self.times: list[float] = []
        self.sent: list[int] = []

    def _run(self, count: int) -> tuple[list[float], list[int]]:
        """``count`` steps (lookup, then push, of a batch's unique ids): seconds and rows of
        each."""
        times, sent = [], []
        for _ in range(count):
            ids = np.unique(_ids(zipf_ranks(self.rng, self.batch, self.rows)))
            grads = self.rng.standard_normal((ids.shape[0], self.dim), dtype=np.float32)
            t0 = time.perf_counter()
            self.table.lookup(ids)
            self.table.push(ids, grads)
            times.append(time.perf_counter() - t0)
            sent.append(2 * ids.shape[0])
        return times, sent

    def time_round(self) -> None:
        times, sent = self._run(self.steps)
        self.round_rates.append(sum(sent) / sum(times))
        self.times += times
        self.sent += sent

    def result(self) -> dict[str, Any]:
        """The case's figures: rows/s the median of its rounds' (each its rows over its time)."""
        after = self.table.stats()
        looked = after.ids_looked_up - self.before.ids_looked_up
        payload = 4 * self.dim + sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt
                                     in state_layout(self.config.optimizer, self.dim).values())
        return {
            **self.info,
            "step_s_median": statistics.median(self.times),
            "step_s_max": max(self.times),
            "ids_per_step": statistics.median(self.sent) / 2,
            "rows_per_s": statistics.median(self.round_rates),
            "rounds_rows_per_s": self.round_rates,
            "hit_ratio": 1.0 - (after.promoted - self.before.promoted) / max(1, looked),
            "ram_bytes_per_row": after.bytes / after.rows,
            "disk_bytes_per_row": after.disk_bytes / after.rows,
            "payload_bytes_per_row": payload,
            "disk_rows": after.disk_rows,
        }


def disk_read_us(directory: str, size_mb: int = 1024, reads: int = 2000,
                 seed: int = 0) -> float | None:
    """Median microseconds of one random 4 KiB read, one at a time (queue depth 1, as a page
    fault of the tier's memory map is), past the page cache (O_DIRECT), from a file of
    ``size_mb`` MiB written under ``directory``; None where O_DIRECT is refused."""
    fd, path = tempfile.mkstemp(prefix="persimmon-disk-", dir=directory)
    try:
        chunk = os.urandom(1 << 20)
        for _ in range(size_mb):
            os.write(fd, chunk)
        os.fsync(fd)
        direct = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:  # e.g. tmpfs, which refuses O_DIRECT
        return None
    finally:
        os.close(fd)
        os.unlink(path)
    page = mmap.mmap(-1, 4096)  # O_DIRECT wants an aligned buffer
    pages = random.Random(seed).choices(range(size_mb * 256), k=reads)
    times = []
    try:
        for p in pages:
            t0 = time.perf_counter()
            os.preadv(direct, [page], p * 4096)
            times.append(time.perf_counter() - t0)
    except OSError:
        return None
    finally:
        os.close(direct)
    return 1e6 * statistics.median(times)


def bench_scale(*, ram_sizes: list[int], disk_sizes: list[int], ram_rows: int = 1_000_000,
                dim: int = 16, optimizer: str = "adagrad", batch: int = 65_536,
                steps: int = 20, warmup: int = 3, settle_max: int = 2000, repeats: int = 3,
                path: str | None = None, probe_mb: int = 1024, seed: int = 0) -> dict[str, Any]:
    """Every case of the run (built, then timed in ``repeats`` rounds, in alternating order),
    the ratios of the largest tiered case to the largest all-in-RAM one (``tiered_vs_ram``,
    the median of the rounds') and of RAM per row to the payload, and with a tier the disk's
    random read time (``disk_read_us``, :func:`disk_read_us` on a ``probe_mb`` MiB file)."""
    kw = {"dim": dim, "optimizer": optimizer, "batch": batch, "steps": steps,
          "warmup": warmup, "seed": seed}
    with contextlib.ExitStack() as stack:
        cases = []
        for n in ram_sizes + disk_sizes:
            tmp = (None if len(cases) < len(ram_sizes) else stack.enter_context(
                tempfile.TemporaryDirectory(dir=path, prefix="persimmon-scale-")))
            cases.append(Case(n, disk=tmp, ram_rows=ram_rows, settle_max=settle_max, **kw))
            print(f"  built: {cases[-1].info}", file=sys.stderr, flush=True)
        for r in track(range(repeats), description="timed rounds",
                       console=Console(stderr=True)):
            for case in cases if r % 2 == 0 else cases[::-1]:
                case.time_round()
        results = [c.result() for c in cases]
    result: dict[str, Any] = {"dim": dim, "optimizer": optimizer, "batch": batch,
                              "zipf_a": ZIPF_A, "steps": steps, "repeats": repeats,
                              "cases": results}
    if disk_sizes and probe_mb:
        result["disk_read_us"] = disk_read_us(path or tempfile.gettempdir(), probe_mb)
    ram = [c for c in cases if c.info["tier"] == "ram"]
    tiered = [c for c in cases if c.info["tier"] == "disk"]
    if ram:
        big = max(ram, key=lambda c: c.rows)
        top_ram = results[cases.index(big)]
        result["ram_bytes_per_row_ratio"] = (top_ram["ram_bytes_per_row"]
                                             / top_ram["payload_bytes_per_row"])
        if tiered:
            top = max(tiered, key=lambda c: c.rows)
            result["tiered_vs_ram"] = statistics.median(
                a / b for a, b in zip(top.round_rates, big.round_rates, strict=True))
            result["tiered_vs_ram_cases"] = [top.rows, big.rows]
    return result


def _print(result: dict[str, Any]) -> None:
    print(f"scale: one table, dim {result['dim']}, {result['optimizer']}, "
          f"Zipf({result['zipf_a']}) batches of {result['batch']:,} ids (unique), "
          f"{result['repeats']} rounds of {result['steps']} steps (rows/s: their median)")
    print(f"{'rows':>13} {'tier':>5} {'in RAM':>11} {'build s':>8} {'rows/s':>12} {'hit':>6} "
          f"{'RAM B/row':>10} {'disk B/row':>11} {'cold rows/s':>12}")
    for c in result["cases"]:
        cold = f"{c['cold_rows_per_s']:>12,.0f}" if "cold_rows_per_s" in c else ""
        print(f"{c['rows']:>13,} {c['tier']:>5} {c['ram_rows']:>11,} {c['build_s']:>8.1f} "
              f"{c['rows_per_s']:>12,.0f} {c['hit_ratio']:>6.3f} {c['ram_bytes_per_row']:>10.1f} "
              f"{c['disk_bytes_per_row']:>11.1f} {cold}")
    if "ram_bytes_per_row_ratio" in result:
        print(f"ram_bytes_per_row_ratio = {result['ram_bytes_per_row_ratio']:.2f} "
              f"(RAM per row over row + optimizer state, largest in-RAM table)")
    if result.get("disk_read_us") is not None:
        print(f"disk_read_us = {result['disk_read_us']:.0f} (a random 4 KiB read past the page "
              f"cache, one at a time, under the tier's directory)")
    if "tiered_vs_ram" in result:
        a, b = result["tiered_vs_ram_cases"]
        print(f"tiered_vs_ram = {result['tiered_vs_ram']:.2f} (rows/s, {a:,} rows tiered over "
              f"{b:,} in RAM, median of the rounds')")


def plot(result: dict[str, Any], png: str) -> None:
    """Rows/s and RAM bytes per row against table rows, one line per tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for tier, colour in (("ram", "tab:blue"), ("disk", "tab:orange")):
        pts = sorted((c for c in result["cases"] if c["tier"] == tier), key=lambda c: c["rows"])
        if pts:
            xs = [c["rows"] for c in pts]
            left.plot(xs, [c["rows_per_s"] for c in pts], "o-", color=colour, label=tier)
            right.plot(xs, [c["ram_bytes_per_row"] for c in pts], "o-", color=colour,
                       label=f"{tier}: RAM")
            if tier == "disk":
                right.plot(xs, [c["disk_bytes_per_row"] for c in pts], "s--", color=colour,
                           label="disk: disk")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.legend()
    left.set(xlabel="rows in the table", ylabel="lookup + push rows/s", title="throughput")
    right.set(xlabel="rows in the table", ylabel="bytes per row", title="memory")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(float(s)) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"sizes must be comma-separated numbers: {text!r}") from exc
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be >= 1: {text!r}")
    return sizes


def _main(args: argparse.Namespace) -> int:
    result = bench_scale(ram_sizes=args.ram_sizes, disk_sizes=args.disk_sizes,
                         ram_rows=args.ram_rows, dim=args.dim, optimizer=args.optimizer,
                         batch=args.batch,
                         steps=args.steps, warmup=args.warmup, settle_max=args.settle_max,
                         repeats=args.repeats, path=args.path, probe_mb=args.probe_mb, seed=args.seed)
    _print(result)
    print(f"cost against rows: {save_plot(plot, result, args.plot, 'scale')}")
    write_json(result, args.json)
    return 0


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("scale", help="one PS table's cost against its rows, "
                                                 "in RAM and with the disk tier")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--plot", help="PNG path (default: in the temp dir)")
    parser.add_argument("--ram-sizes", type=_sizes, default=[1_000_000, 10_000_000],
                        help="rows of the all-in-RAM tables (comma-separated, 1e6 allowed)")
    parser.add_argument("--disk-sizes", type=_sizes, default=[10_000_000],
                        help="rows of the tiered tables")
    parser.add_argument("--ram-rows", type=int_at_least(1), default=1_000_000,
                        help="storage.ram_rows of the tiered tables")
    parser.add_argument("--path", help="directory for the disk tier (default: the temp dir)")
    parser.add_argument("--dim", type=int_at_least(1), default=16)
    parser.add_argument("--optimizer", default="adagrad", choices=[k.value for k in OptimizerKind],
                        help="the table's optimizer (its state is part of the payload)")
    parser.add_argument("--batch", type=int_at_least(1), default=65_536, help="ids drawn per step")
    parser.add_argument("--steps", type=int_at_least(1), default=20, help="timed steps per case")
    parser.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed steps first")
    parser.add_argument("--repeats", type=int_at_least(1), default=3,
                        help="timed rounds per case, the cases alternating")
    parser.add_argument("--settle-max", type=int_at_least(0), default=2000,
                        help="most untimed steps a tiered table gets to turn its RAM tier over")
    parser.add_argument("--probe-mb", type=int_at_least(0), default=1024,
                        help="MiB of the file the disk's random reads are timed on (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_main)
