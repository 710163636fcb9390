"""``persimmon bench dashboard``: what the live page costs a training job.

One training job runs in a child process (a DLRM worker in hybrid mode, S = 4, on planted
batches it cycles through, 2 PS shards in its process: steady, with no loader to stall it,
and its admin API served on the training event loop as a worker's is) while the bench
alternates phases of ``--phase-s`` seconds: *closed* (nobody polls the worker's admin API) and *open* (a client does what the
page ``/dashboard`` does: loads it, then fetches ``/v1/progress``, ``/v1/curves`` and
``/metrics`` every ``--every-s`` seconds). ``--client chromium`` opens the real page in
headless Chromium instead (Debian's ``chromium`` and ``chromium-driver``, Selenium): the
browser then also competes for this machine's cores, as it would not on a viewer's laptop.

Each repeat is a pair of one closed and one open phase, in alternating order (closed first,
then open first) so that a drift of the job's speed cancels out. A phase's samples/s is the
growth of rank 0's ``samples`` over its wall time, read from ``/v1/progress`` at both ends
(one request per phase, in both kinds of phase). Figures: the median samples/s of each kind
and ``open_vs_closed``, the median of the per-pair ratios open / closed (goal >= 0.98).

On cores shared with other work the wall-clock rate of a phase swings several-fold with the
neighbours' load, more than the page could cost; ``open_vs_closed_cpu`` is the same median of
pairs of samples per CPU second of the training process (its user + system time, from
``/proc``, Linux): the page's requests are served on the training event loop, so what they
cost is CPU time of that process (torch runs one intra-op thread here, so that idle threads
spinning on contended cores do not count). ``page_busy_fraction`` bounds the page's cost from
above: the wall time of its requests (queueing included) over the open phases' time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import write_json
from bench.procstats import cpu_seconds
from services.common.commands import float_at_least, int_at_least
from services.common.ports import free_port

__all__ = ["register_bench", "run"]

console = Console(stderr=True)
PAGE_ROUTES = ("/v1/progress", "/v1/curves", "/metrics")  # what the page polls


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return bytes(response.read())


def _progress(url: str) -> dict[str, Any]:
    return dict(json.loads(_get(url + "/v1/progress")))


@contextmanager
def _http_page(url: str, every_s: float, busy: list[float]) -> Iterator[None]:
    """A client polling like the page, in a thread of this process (not the job's); appends
    the wall seconds of each request to ``busy``."""
    stop = threading.Event()

    def poll() -> None:
        _get(url + "/dashboard")
        while not stop.is_set():
            for route in PAGE_ROUTES:
                t0 = time.perf_counter()
                _get(url + route)
                busy.append(time.perf_counter() - t0)
            stop.wait(every_s)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


@contextmanager
def _chromium_page(url: str, every_s: float, busy: list[float]) -> Iterator[None]:
    """The real page in headless Chromium (``busy`` stays empty: the browser's requests are
    not timed)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    try:
        driver.get(f"{url}/dashboard?every={int(every_s * 1000)}")
        yield
    finally:
        driver.quit()


CLIENTS: dict[str, Callable[[str, float, list[float]], Any]] = {"http": _http_page, "chromium": _chromium_page}


def _train_forever(port: int, batch_size: int) -> None:
    """A child process: one worker trains on planted batches (cycled) against 2 PS shards in
    its own process, its admin API on ``port``, until it is terminated."""
    import torch

    from services.loader.planted import SyntheticConfig, SyntheticDataset
    from services.ps.inprocess import InProcessShards
    from services.worker import ModelConfig, Trainer, TrainerConfig, ps_table_configs

    torch.set_num_threads(1)  # no idle intra-op threads spinning on contended cores

    async def train() -> None:
        data = SyntheticDataset(SyntheticConfig(seed=0))
        batches = list(data.batches(batch_size, batch_size * 200))
        shards = InProcessShards(ps_table_configs({n: 16 for n in data.config.sparse_names}),
                                 num_shards=2)
        config = TrainerConfig(mode="hybrid", staleness=4, lr=3e-3, admin_port=port)
        async with Trainer(model=ModelConfig(name="dlrm"), rows_client=shards,
                           config=config) as trainer:
            await trainer.fit(itertools.chain.from_iterable(itertools.repeat(batches)))

    asyncio.run(train())


@contextmanager
def _training_job(batch_size: int) -> Iterator[tuple[str, int]]:
    """The training child process; yields its admin URL and pid once it trains."""
    port = free_port()
    job = multiprocessing.get_context("spawn").Process(
        target=_train_forever, args=(port, batch_size), daemon=True)
    job.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if not job.is_alive():
                raise RuntimeError(f"the training process exited with {job.exitcode}")
            try:
                if _progress(url)["step"] > 0:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the training process did not train within 300 s")
            time.sleep(0.5)
        yield url, int(job.pid or 0)
    finally:
        job.terminate()
        job.join(timeout=30)


def _phase(url: str, pid: int, seconds: float) -> tuple[float, float]:
    """The job's samples per second and per CPU second over the next ``seconds``."""
    before, t0, c0 = _progress(url), time.perf_counter(), cpu_seconds(pid)
    time.sleep(seconds)
    after, t1, c1 = _progress(url), time.perf_counter(), cpu_seconds(pid)
    if after["state"] != "training":
        raise RuntimeError(f"the job stopped training during a phase: {after['state']}")
    if c0 is None or c1 is None:
        raise RuntimeError(f"no CPU time of the job (process {pid}) in /proc (Linux only)")
    samples = after["samples"] - before["samples"]
    return samples / (t1 - t0), samples / max(c1 - c0, 1e-9)


def _quartiles(values: list[float]) -> list[float]:
    """The first and third quartiles (the value itself when there is one)."""
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def run(*, repeats: int = 15, phase_s: float = 2.0, every_s: float = 1.0, client: str = "http",
        batch_size: int = 256, warmup_s: float = 10.0) -> dict[str, Any]:
    """The JSON-ready figures (see the module docstring)."""
    page = CLIENTS[client]
    phases: dict[str, list[tuple[float, float]]] = {"closed": [], "open": []}
    busy: list[float] = []  # wall seconds of the page's requests
    with _training_job(batch_size) as (url, pid):
        _phase(url, pid, warmup_s)  # compilation and caches: not counted
        for i in range(repeats):
            for kind in (("closed", "open") if i % 2 == 0 else ("open", "closed")):
                if kind == "open":
                    with page(url, every_s, busy):
                        phases["open"].append(_phase(url, pid, phase_s))
                else:
                    phases["closed"].append(_phase(url, pid, phase_s))
            console.print(f"pair {i + 1}/{repeats}: samples/s closed "
                          f"{phases['closed'][-1][0]:,.0f}, open {phases['open'][-1][0]:,.0f}; "
                          f"per CPU s closed {phases['closed'][-1][1]:,.0f}, "
                          f"open {phases['open'][-1][1]:,.0f}")
    result: dict[str, Any] = {"client": client, "phase_s": phase_s, "every_s": every_s,
                              "repeats": repeats, "warmup_s": warmup_s,
                              "page_request_ms_median": 1e3 * statistics.median(busy)
                              if busy else None,
                              "page_busy_fraction": sum(busy) / (repeats * phase_s)}
    for k, suffix in ((0, ""), (1, "_cpu")):
        closed = [p[k] for p in phases["closed"]]
        opened = [p[k] for p in phases["open"]]
        ratios = [o / c for o, c in zip(opened, closed, strict=True)]
        unit = "samples_per_s" if k == 0 else "samples_per_cpu_s"
        result.update({f"closed_{unit}": closed, f"open_{unit}": opened,
                       f"closed_median{suffix}": statistics.median(closed),
                       f"open_median{suffix}": statistics.median(opened),
                       f"pair_ratios{suffix}": ratios,
                       f"open_vs_closed{suffix}": statistics.median(ratios),
                       f"open_vs_closed{suffix}_iqr": _quartiles(ratios)})
    return result


def _main(args: argparse.Namespace) -> int:
    result = run(repeats=args.repeats, phase_s=args.phase_s, every_s=args.every_s,
                 client=args.client, batch_size=args.batch_size, warmup_s=args.warmup_s)
    table = Table(title=f"training with the live page open ({args.client} client, polling "
                        f"every {args.every_s} s) vs closed, {args.repeats} paired phases")
    for column in ("page", "samples/s", "ratio (goal >= 0.98)", "samples/CPU s", "ratio"):
        table.add_column(column, justify="right")
    table.add_row("closed (baseline)", f"{result['closed_median']:,.0f}", "1.000",
                  f"{result['closed_median_cpu']:,.0f}", "1.000")
    iqr, iqr_cpu = result["open_vs_closed_iqr"], result["open_vs_closed_cpu_iqr"]
    table.add_row("open", f"{result['open_median']:,.0f}",
                  f"{result['open_vs_closed']:.3f} ({iqr[0]:.2f}-{iqr[1]:.2f})",
                  f"{result['open_median_cpu']:,.0f}",
                  f"{result['open_vs_closed_cpu']:.3f} ({iqr_cpu[0]:.2f}-{iqr_cpu[1]:.2f})")
    console.print("medians; ratios: medians of the per-pair ratios (interquartile range); "
                  "the page's requests took "
                  f"{result['page_busy_fraction']:.2%} of the open phases' wall time")
    Console().print(table)
    write_json(result, args.json)
    return 0


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("dashboard", help="training samples/s, live page open vs closed")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--repeats", type=int_at_least(1), default=15,
                        help="pairs of a closed and an open phase")
    parser.add_argument("--phase-s", type=float_at_least(0, inclusive=False), default=2.0,
                        help="seconds of one phase")
    parser.add_argument("--warmup-s", type=float_at_least(0, inclusive=False), default=10.0,
                        help="seconds of training before the first phase (not counted)")
    parser.add_argument("--every-s", type=float_at_least(0, inclusive=False), default=1.0,
                        help="the page's polling interval")
    parser.add_argument("--client", choices=sorted(CLIENTS), default="http",
                        help="http: poll like the page; chromium: the real page, headless")
    parser.add_argument("--batch-size", type=int_at_least(1), default=256)
    parser.set_defaults(func=_main)
