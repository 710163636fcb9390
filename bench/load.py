"""``persimmon bench load``: N concurrent clients doing lookups and pushes against a PS in
its own process for T seconds; throughput, latency percentiles and the PS's memory growth.

Warm-up first touches every id of the universe (so the timed phase creates no rows) and
runs the load for a while; the PS's resident memory is read from ``/proc/<pid>/status``
after the warm-up and at the end: ``rss_growth_mb`` is the difference (goal <= 50 MB).
The baseline, measured in the same run, is one client doing the same work: the ratio is
how throughput scales with clients. ``--soak`` runs 30 minutes and samples memory every
minute (``rss_samples_mb``); a leak shows as a steady climb.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bench import latency_quantiles, write_json
from bench.procstats import memory_mb
from clients.ps_client import PSClient
from services.common.commands import float_at_least, int_at_least
from services.local.processes import LocalPS

__all__ = ["register_bench", "run"]

DIM = 16
console = Console(stderr=True)


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (Linux ``/proc``)."""
    rss = memory_mb(pid, "VmRSS")
    if rss is None:
        raise RuntimeError(f"no resident memory of process {pid} in /proc (Linux only)")
    return rss


async def _client_loop(ps: PSClient, rng: np.random.Generator, universe: int, batch: int,
                       until: float, latencies: list[float]) -> None:
    """Alternate a lookup and a push of ``batch`` random ids until ``until``."""
    grads = rng.normal(scale=0.01, size=(batch, DIM)).astype(np.float32)
    while time.perf_counter() < until:
        ids = np.unique(rng.integers(0, universe, size=batch, dtype=np.uint64))
        start = time.perf_counter()
        await ps.lookup_unique("emb", ids)
        middle = time.perf_counter()
        await ps.push_unique("emb", ids, grads[: ids.size])
        end = time.perf_counter()
        latencies += [middle - start, end - middle]


async def _load(addresses: list[str], clients: int, seconds: float, universe: int, batch: int,
                seed: int) -> dict[str, float]:
    """Run ``clients`` clients for ``seconds``; ops/s and latency percentiles."""
    latencies: list[float] = []
    pss = [PSClient(addresses) for _ in range(clients)]
    try:
        await asyncio.gather(*(ps.connect() for ps in pss))
        start = time.perf_counter()
        await asyncio.gather(*(
            _client_loop(ps, np.random.default_rng(seed + i), universe, batch, start + seconds,
                         latencies) for i, ps in enumerate(pss)))
        elapsed = time.perf_counter() - start
    finally:
        await asyncio.gather(*(ps.close() for ps in pss))
    return {"ops": len(latencies), "ops_per_s": len(latencies) / elapsed,
            **latency_quantiles(latencies)}


async def _populate(addresses: list[str], universe: int) -> None:
    async with PSClient(addresses) as ps:
        for start in range(0, universe, 65_536):
            await ps.lookup_unique("emb", np.arange(start, min(universe, start + 65_536),
                                                    dtype=np.uint64))


def run(*, seconds: float = 20.0, clients: int = 8, universe: int = 200_000, batch: int = 1024,
        warmup_s: float | None = None, baseline_s: float | None = None,
        sample_every_s: float | None = None) -> dict[str, Any]:
    """Warm up, run the baseline (1 client) and the load (``clients``); figures as a dict."""
    warmup_s = min(10.0, seconds / 4) if warmup_s is None else warmup_s
    baseline_s = min(5.0, seconds / 4) if baseline_s is None else baseline_s
    table = {"name": "emb", "dim": DIM, "optimizer": {"kind": "adagrad", "lr": 0.05}}
    with LocalPS(1, [table]) as cluster:
        result, single = asyncio.run(_measure(
            cluster.procs[0].pid, cluster.addresses, seconds=seconds, clients=clients,
            universe=universe, batch=batch, warmup_s=warmup_s, baseline_s=baseline_s,
            sample_every_s=sample_every_s or seconds))
    _print_table(result, single)
    return result


async def _measure(pid: int, addresses: list[str], *, seconds: float, clients: int,
                   universe: int, batch: int, warmup_s: float, baseline_s: float,
                   sample_every_s: float) -> tuple[dict[str, Any], dict[str, float]]:
    console.log(f"warm-up: {universe:,} ids, then {warmup_s:.0f} s of load")
    await _populate(addresses, universe)
    await _load(addresses, clients, warmup_s, universe, batch, seed=1000)
    rss_start = rss_mb(pid)
    console.log(f"baseline: 1 client, {baseline_s:.0f} s")
    single = await _load(addresses, 1, baseline_s, universe, batch, seed=2000)
    console.log(f"load: {clients} clients x {batch}-id lookups and pushes, {seconds:.0f} s")
    samples, done = [rss_start], 0.0
    phases: list[dict[str, float]] = []
    while done < seconds:
        chunk = min(sample_every_s, seconds - done)
        phases.append(await _load(addresses, clients, chunk, universe, batch,
                                  seed=3000 + len(phases) * clients))
        samples.append(rss_mb(pid))
        done += chunk
        console.log(f"{done:.0f} s: {phases[-1]['ops_per_s']:,.0f} ops/s, PS RSS "
                    f"{samples[-1]:.1f} MiB ({samples[-1] - rss_start:+.1f})")
    load = _merge(phases)
    return {"ops_per_s": load["ops_per_s"], "p50_ms": load["p50_ms"], "p99_ms": load["p99_ms"],
            "rss_growth_mb": samples[-1] - rss_start, "rss_after_warmup_mb": rss_start,
            "rss_samples_mb": samples, "clients": clients, "seconds": seconds,
            "batch": batch, "universe": universe, "baseline_ops_per_s": single["ops_per_s"],
            "scaling": load["ops_per_s"] / single["ops_per_s"]}, single


def _merge(phases: list[dict[str, float]]) -> dict[str, float]:
    """Throughput over all phases; percentiles weighted by each phase's op count."""
    ops = sum(p["ops"] for p in phases)
    seconds = sum(p["ops"] / p["ops_per_s"] for p in phases)
    return {"ops_per_s": ops / seconds,
            "p50_ms": float(np.average([p["p50_ms"] for p in phases],
                                       weights=[p["ops"] for p in phases])),
            "p99_ms": max(p["p99_ms"] for p in phases)}


def _print_table(r: dict[str, Any], single: dict[str, float]) -> None:
    table = Table(title="persimmon bench load")
    for col in ("measure", f"{r['clients']} clients", "1 client (baseline)", "ratio", "goal"):
        table.add_column(col, justify="right" if col != "measure" else "left")
    table.add_row("ops/s (lookups + pushes)", f"{r['ops_per_s']:,.0f}", f"{single['ops_per_s']:,.0f}",
                  f"{r['scaling']:.2f}x", "")
    table.add_row("p50 latency", f"{r['p50_ms']:.2f} ms", f"{single['p50_ms']:.2f} ms", "", "")
    table.add_row("p99 latency", f"{r['p99_ms']:.2f} ms", f"{single['p99_ms']:.2f} ms", "", "")
    table.add_row("PS RSS growth after warm-up", f"{r['rss_growth_mb']:+.1f} MiB", "", "",
                  "<= 50 MiB")
    Console().print(table)


def _main(args: argparse.Namespace) -> int:
    if args.soak:
        result = run(seconds=args.seconds or 1800.0, clients=args.clients, sample_every_s=60.0)
    else:
        result = run(seconds=args.seconds or 20.0, clients=args.clients)
    write_json(result, args.json)
    return 0


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("load", help="concurrent clients against a PS: ops/s, "
                                                "latency, memory growth")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--seconds", type=float_at_least(0, inclusive=False), default=None,
                        help="seconds of load (default 20; 1800 with --soak)")
    parser.add_argument("--clients", type=int_at_least(1), default=8, help="concurrent clients")
    parser.add_argument("--soak", action="store_true",
                        help="a 30-minute soak sampling the PS's memory every minute")
    parser.set_defaults(func=_main)
