"""``persimmon bench serve``: a prediction server (``persimmon serve``, its own process) against
the same model predicting in process, hot swaps under load, and export sizes.

The model is a DLRM over Criteo-layout lines (13 dense, 26 sparse features, dim 16), each
table holding the ids of the bench's lines plus random ones up to ``--rows``. Clients send
raw lines; the baseline featurizes the same lines and runs the same version's forward pass
in this process (:class:`~services.serve.predictor.Predictor`, no server), in a worker thread
with the server's default of one BLAS thread (``--forward-threads 1``).

- ``rest_vs_inprocess`` / ``grpc_vs_inprocess``: records/s at batch 256 with 4 concurrent
  clients over REST (``POST /v1/predict``) and gRPC (``persimmon.Serve/Predict``), divided by
  the in-process records/s (floors 0.5 and 0.7): ``--rounds`` (5) alternating rounds of each, ``--seconds``
  long; each ratio is the median of the rounds' ratios (the cores are shared).
- ``latency``: p50/p99 ms of batch-1 REST requests with 1 and 8 concurrent clients.
- ``swap_*``: 8 clients send batches of 8 lines while a new version appears every
  ``--swap-every`` s for ``--swap-seconds`` s in all (written beforehand, renamed into the
  model directory), in 3 windows that alternate with 3 steady windows as long (the load of
  shared cores drifts: both sides see it). Versions differ in their output bias only (so
  every answer tells its version): an answer whose probabilities are not its version's own
  is a mixed one. ``swap_p99_ratio`` is p99 during swaps over steady p99.
- ``incremental_export_ratio``: bytes of an incremental export after 1% of a
  ``--export-rows`` table's rows changed, over the full export's bytes (goal <= 0.05).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from threadpoolctl import threadpool_limits

from bench import latency_quantiles, write_json
from bench.loader import write_criteo_file
from services.common.config import config_to_dict
from services.common.messages import decode, encode
from services.common.rpc import open_channel
from services.loader.schema import criteo_layout
from services.local.processes import start_service, stop_processes
from services.local.train import ps_initial_rows
from services.ps.tables import TableConfig
from services.serve import FeatureSpec, Predictor, TableRows, write_version
from services.serve.server import SERVICE_NAME, PredictReply, PredictRequest
from services.worker.models import ModelConfig

__all__ = ["register_bench", "run"]

DENSE, SPARSE, DIM = 13, 26, 16
BATCH, CLIENTS, SWAP_CLIENTS, SWAP_BATCH, SWAP_WINDOWS = 256, 4, 8, 8, 3
SPEC = FeatureSpec.from_layout(criteo_layout(DENSE, SPARSE), kind="criteo")
MODEL = ModelConfig(name="dlrm")
console = Console(stderr=True)


def _lines(n: int, seed: int = 0) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lines.txt"
        write_criteo_file(path, n, seed=seed)
        return path.read_text().splitlines()


def _tables(lines: list[str], rows: int, rng: np.random.Generator) -> dict[str, TableRows]:
    """Per sparse feature: the ids of ``lines`` and random ones, ``rows`` at least."""
    features = SPEC.lines(lines)
    out = {}
    for i, name in enumerate(SPEC.sparse):
        ids = np.unique(features.sparse[name].values)
        extra = max(rows - ids.size, 0)
        ids = np.unique(np.concatenate([ids, rng.integers(0, 2**63, extra, dtype=np.uint64)]))
        config = config_to_dict(TableConfig(name=name, dim=DIM, seed=i))
        out[name] = TableRows(name=name, ids=ids, config=config,
                              rows=rng.normal(0, 0.1, (ids.size, DIM)).astype(np.float32))
    return out


def _state(bias: float) -> dict[str, torch.Tensor]:
    """The bench model's weights (seed 0) with output bias ``bias``."""
    torch.manual_seed(0)
    state = MODEL.build(sparse_dims=dict.fromkeys(SPEC.sparse, DIM),
                        num_dense=DENSE).state_dict()
    last = max(k for k in state if k.startswith("top.") and k.endswith(".bias"))
    state[last] = torch.full_like(state[last], bias)
    return state


def _write(models: Path, step: int, tables: dict[str, TableRows], *, bias: float = 0.0,
           base: str | None = None, keep: int | None = None) -> dict[str, Any]:
    return write_version(models, step=step, model=MODEL, state=_state(bias),
                         features={f: f for f in SPEC.sparse}, num_dense=DENSE, tables=tables,
                         spec=SPEC, base=base, keep=keep)


async def _load(call: Callable[[], Awaitable[Any]], clients: int, seconds: float,
                on_answer: Callable[[Any], None] | None = None,
                until: Callable[[], bool] | None = None) -> tuple[list[float], int, float]:
    """``clients`` loops calling ``call`` for ``seconds`` (and then, with ``until``, until it
    is true, 60 s more at most); (latencies, failures, seconds until the last answer)."""
    latencies: list[float] = []
    failures = 0
    started = time.monotonic()
    deadline = started + seconds

    async def loop() -> None:
        nonlocal failures
        while time.monotonic() < deadline or (
                until is not None and not until() and time.monotonic() < deadline + 60):
            started = time.perf_counter()
            try:
                answer = await call()
            except Exception:  # a failed request is counted, whatever its kind
                failures += 1
                continue
            latencies.append(time.perf_counter() - started)
            if on_answer is not None:
                on_answer(answer)

    await asyncio.gather(*(loop() for _ in range(clients)))
    return latencies, failures, time.monotonic() - started


def _rest(http: httpx.AsyncClient, lines: list[str]) -> Callable[[], Awaitable[Any]]:
    async def call() -> dict[str, Any]:
        response = await http.post("/v1/predict", json={"lines": lines})
        response.raise_for_status()
        return response.json()
    return call


def _inprocess(predictor: Predictor, batches: list[list[str]], seconds: float) -> float:
    """Records/s of featurize + forward in this process, one batch after another, on one BLAS
    thread as the server's forward runs by default."""
    done, started = 0, time.perf_counter()
    with threadpool_limits(1, user_api="blas"):
        while time.perf_counter() - started < seconds:
            for lines in batches:
                predictor.predict(predictor.featurize({"lines": lines}))
                done += len(lines)
    return done / (time.perf_counter() - started)


async def _throughput(url: str, address: str, batches: list[list[str]], seconds: float,
                      rounds: int,
                      inprocess: Callable[[], float]) -> dict[str, Any]:
    """Records/s in process, over REST and over gRPC, in ``rounds`` alternating rounds (the
    cores are shared: load comes and goes): medians of the rounds, and each ratio the median
    of the rounds' own ratios (each round's transport against the in-process run beside it)."""
    runs: dict[str, list[float]] = {"inprocess": [], "rest": [], "grpc": []}
    failed = {"rest": 0, "grpc": 0}
    channel = open_channel(address)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            predict = channel.unary_unary(f"/{SERVICE_NAME}/Predict")
            bodies = [encode(PredictRequest(lines=b)) for b in batches]
            turn = iter(range(10**12))

            async def rest_call() -> dict[str, Any]:
                return await _rest(http, batches[next(turn) % len(batches)])()

            async def grpc_call() -> PredictReply:
                return decode(PredictReply, await predict(bodies[next(turn) % len(bodies)]))

            for _ in batches:  # warm-up: the server's numba kernels
                await rest_call()
                await grpc_call()
            for _ in range(rounds):
                runs["inprocess"].append(await asyncio.to_thread(inprocess))
                for kind, call in (("rest", rest_call), ("grpc", grpc_call)):
                    latencies, fails, elapsed = await _load(call, CLIENTS, seconds)
                    runs[kind].append(len(latencies) * BATCH / elapsed)
                    failed[kind] += fails
    finally:
        await channel.close()
    return {**{f"{k}_records_per_s": statistics.median(v) for k, v in runs.items()},
            **{f"{k}_vs_inprocess": statistics.median(
                r / i for r, i in zip(runs[k], runs["inprocess"], strict=True))
               for k in ("rest", "grpc")},
            **{f"{k}_failed": n for k, n in failed.items()}, "throughput_rounds": runs}


async def _latency(url: str, lines: list[str], seconds: float) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        out = {}
        for clients in (1, 8):
            latencies, failed, _ = await _load(_rest(http, lines[:1]), clients, seconds)
            out[f"clients_{clients}"] = {**latency_quantiles(latencies),
                                         "requests": len(latencies), "failed": failed}
        return out


async def _swaps(url: str, models: Path, base: dict[str, Any], probe: list[str],
                 tables: dict[str, TableRows], swap_seconds: float, swap_every: float
                 ) -> dict[str, Any]:
    """Steady p99, and p99, failures and mixed answers while versions are swapped in
    (written beforehand on the base, only the bias differs, and renamed into the model
    directory every ``swap_every`` s), in alternating windows (``SWAP_WINDOWS`` of each)."""
    answers: dict[str, list[list[float]]] = {}

    def keep(answer: dict[str, Any]) -> None:
        answers.setdefault(answer["version"], []).append(answer["probabilities"])

    written: list[str] = [base["version_id"]]
    staging = models.parent / "staging"
    staging.mkdir()
    (staging / base["version_id"]).symlink_to(models / base["version_id"])
    staged = [_write(staging, base["step"] + i, tables, bias=0.25 + 0.05 * i,
                     base=base["version_id"])["version_id"]
              for i in range(1, max(round(swap_seconds / swap_every), 1) + 1)]

    async def write_versions(versions: list[str]) -> None:
        for version in versions:
            await asyncio.sleep(swap_every)
            os.rename(staging / version, models / version)  # complete, at once
            written.append(version)

    steady: list[float] = []
    swapping: list[float] = []
    steady_failed = failed = 0
    window = swap_seconds / SWAP_WINDOWS
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for w in range(SWAP_WINDOWS):
            latencies, fails, _ = await _load(_rest(http, probe), SWAP_CLIENTS, window, keep)
            steady += latencies
            steady_failed += fails
            chunk = staged[len(staged) * w // SWAP_WINDOWS:len(staged) * (w + 1) // SWAP_WINDOWS]
            writer = asyncio.ensure_future(write_versions(chunk))  # in order: newest last
            latencies, fails, _ = await _load(  # until the last version written answered
                _rest(http, probe), SWAP_CLIENTS, window, keep,
                until=lambda: writer.done() and written[-1] in answers)  # noqa: B023
            swapping += latencies
            failed += fails
            await writer
    mixed = 0
    for version, seen in answers.items():
        want = np.array(_predict(models, version, probe))
        mixed += int(np.sum(np.abs(np.array(seen) - want).max(axis=1) > 1e-5))
    during, before = latency_quantiles(swapping), latency_quantiles(steady)
    return {"swap_versions_written": len(written) - 1, "swap_versions_seen": len(answers),
            "swap_failed_requests": failed + steady_failed, "swap_mixed_responses": mixed,
            "swap_steady": {**before, "requests": len(steady)},
            "swap_during": {**during, "requests": len(swapping)},
            "swap_p99_ratio": during["p99_ms"] / before["p99_ms"]}


def _predict(models: Path, version: str, lines: list[str]) -> list[float]:
    predictor = Predictor.load(models / version, initial_rows=ps_initial_rows)
    return predictor.predict(predictor.featurize({"lines": lines})).tolist()


def _export_sizes(workdir: Path, rows: int, rng: np.random.Generator) -> dict[str, Any]:
    """Seconds and bytes of a full export of one ``rows``-row table, then of an incremental
    one after 1% of its rows changed."""
    models = workdir / "export"
    small = _tables(_lines(4, seed=9), 1, rng)
    ids = np.unique(rng.integers(0, 2**63, rows, dtype=np.uint64))
    big = TableRows(name="C1", ids=ids, config=small["C1"].config,
                    rows=rng.normal(0, 0.1, (ids.size, DIM)).astype(np.float32))
    started = time.perf_counter()
    full = _write(models, 1, {**small, "C1": big})
    full_s = time.perf_counter() - started
    changed = rng.choice(ids.size, ids.size // 100, replace=False)
    big.rows[changed] += 0.01
    started = time.perf_counter()
    incremental = _write(models, 2, {**small, "C1": big}, base=full["version_id"])
    incremental_s = time.perf_counter() - started

    def size(m: dict[str, Any]) -> int:
        return sum(f["bytes"] for f in m["files"].values())

    return {"export_rows": int(ids.size), "full_export_s": full_s,
            "full_export_bytes": size(full), "incremental_export_s": incremental_s,
            "incremental_export_bytes": size(incremental),
            "incremental_export_ratio": size(incremental) / size(full)}


def run(*, rows: int = 100_000, seconds: float = 5.0, rounds: int = 5, swap_seconds: float = 60.0,
        swap_every: float = 2.0, export_rows: int = 10_000_000, workdir: str | None = None
        ) -> dict[str, Any]:
    """Every figure of the module docstring, measured in this run."""
    rng = np.random.default_rng(0)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        root = Path(tmp)
        models = root / "models"
        lines = _lines(BATCH * 8)
        tables = _tables(lines, rows, rng)
        base = _write(models, 1, tables, bias=0.25)
        batches = [lines[i:i + BATCH] for i in range(0, len(lines), BATCH)]
        predictor = Predictor.load(models / base["version_id"], initial_rows=ps_initial_rows)
        for lines_of_batch in batches:  # warm-up: numba kernels compiled or loaded
            predictor.predict(predictor.featurize({"lines": lines_of_batch}))
        console.log("starting persimmon serve")
        proc, grpc_port, admin_port = start_service(
            [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "serve",
             "--model-dir", str(models), "--watch-interval-s", "0.2"],
            str(root / "serve.ready"), timeout=120)
        try:
            url = f"http://127.0.0.1:{admin_port}"
            result: dict[str, Any] = {"rows_per_table": rows, "batch": BATCH,
                                      "clients": CLIENTS}
            result.update(asyncio.run(_throughput(
                url, f"127.0.0.1:{grpc_port}", batches, seconds, rounds,
                lambda: _inprocess(predictor, batches, seconds))))
            result["latency"] = asyncio.run(_latency(url, lines, seconds))
            console.log("hot swaps under load")
            result.update(asyncio.run(_swaps(url, models, base, lines[:SWAP_BATCH], tables,
                                             swap_seconds, swap_every)))
        finally:
            stop_processes([proc])
        console.log(f"exports of a {export_rows:,}-row table")
        result.update(_export_sizes(root, export_rows, rng))
    result["goals"] = {"rest_vs_inprocess": 0.5, "grpc_vs_inprocess": 0.7,
                       "swap_p99_ratio": 2.0, "incremental_export_ratio": 0.05}
    _print_table(result)
    return result


def _print_table(r: dict[str, Any]) -> None:
    table = Table(title=f"persimmon bench serve (DLRM, {SPARSE} tables of {r['rows_per_table']:,}"
                        f" rows; {os.cpu_count()} cores)")
    for col in ("figure", "value", "goal"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    goals = r["goals"]
    table.add_row("in-process records/s (batch 256)", f"{r['inprocess_records_per_s']:,.0f}", "")
    for kind in ("rest", "grpc"):
        table.add_row(f"{kind} records/s (batch 256, {r['clients']} clients)",
                      f"{r[f'{kind}_records_per_s']:,.0f}", "")
        table.add_row(f"{kind}_vs_inprocess ({r[f'{kind}_failed']} failed)",
                      f"{r[f'{kind}_vs_inprocess']:.2f}x", f">= {goals[f'{kind}_vs_inprocess']}")
    for clients, q in r["latency"].items():
        table.add_row(f"REST batch 1, {clients.replace('_', ' ')}: p50 / p99 ms",
                      f"{q['p50_ms']:.1f} / {q['p99_ms']:.1f}", "")
    table.add_row("swap: versions written / answered",
                  f"{r['swap_versions_written']} / {r['swap_versions_seen']}", "")
    table.add_row("swap_failed_requests", str(r["swap_failed_requests"]), "0")
    table.add_row("swap_mixed_responses", str(r["swap_mixed_responses"]), "0")
    table.add_row("swap_p99_ratio (during / steady)", f"{r['swap_p99_ratio']:.2f}", "<= 2")
    table.add_row(f"full export of {r['export_rows']:,} rows: s / MB",
                  f"{r['full_export_s']:.2f} / {r['full_export_bytes'] / 1e6:,.1f}", "")
    table.add_row("incremental export (1% changed): s / MB",
                  f"{r['incremental_export_s']:.2f} / "
                  f"{r['incremental_export_bytes'] / 1e6:,.1f}", "")
    table.add_row("incremental_export_ratio", f"{r['incremental_export_ratio']:.4f}", "<= 0.05")
    Console().print(table)


def _main(args: argparse.Namespace) -> int:
    result = run(rows=args.rows, seconds=args.seconds, rounds=args.rounds,
                 swap_seconds=args.swap_seconds,
                 swap_every=args.swap_every, export_rows=args.export_rows)
    write_json(result, args.json)
    return 0


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="prediction server vs in-process predict, "
                                   "hot swaps under load, export sizes")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--rows", type=int, default=100_000, help="rows of each served table")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="seconds of each throughput and latency measurement")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating throughput rounds (in process, REST, gRPC)")
    parser.add_argument("--swap-seconds", type=float, default=60.0,
                        help="seconds of hot swaps under load")
    parser.add_argument("--swap-every", type=float, default=2.0,
                        help="seconds between two versions during the swaps")
    parser.add_argument("--export-rows", type=int, default=10_000_000,
                        help="rows of the exported table")
    parser.set_defaults(func=_main)
