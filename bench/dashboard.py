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
from services.common.commands import float_at_least, int_at_least
from services.local.processes import free_port

__all__ = ["register_bench", "run"]

console = Console(stderr=True)
PAGE_ROUTES = ("/v1/progress", "/v1/curves", "/metrics")  # what the page polls


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return bytes(response.read())


def _progress(url: str) -> dict[str, Any]:
    return dict(json.loads(_get(url + "/v1/progress")))


@contextmanager
def _http_page(url: str, every_s: float) -> Iterator[None]:
    """A client polling like the page, in a thread of this process (not the job's)."""
    stop = threading.Event()

    def poll() -> None:
        _get(url + "/dashboard")
        while not stop.is_set():
            for route in PAGE_ROUTES:
                _get(url + route)
            stop.wait(every_s)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


@contextmanager
def _chromium_page(url: str, every_s: float) -> Iterator[None]:
    """The real page in headless Chromium."""
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


CLIENTS: dict[str, Callable[[str, float], Any]] = {"http": _http_page, "chromium": _chromium_page}


def _train_forever(port: int, batch_size: int) -> None:
    """A child process: one worker trains on planted batches (cycled) against 2 PS shards in
    its own process, its admin API on ``port``, until it is terminated."""
    from services.loader.synthetic import SyntheticConfig, SyntheticDataset
    from services.ps.inprocess import InProcessShards
    from services.worker import ModelConfig, Trainer, TrainerConfig, ps_table_configs

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
def _training_job(batch_size: int) -> Iterator[str]:
    """The training child process; yields its admin URL once it trains."""
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
        yield url
    finally:
        job.terminate()
        job.join(timeout=30)


def _phase(url: str, seconds: float) -> float:
    """Rank 0's samples/s over the next ``seconds``."""
    before, t0 = _progress(url), time.perf_counter()
    time.sleep(seconds)
    after, t1 = _progress(url), time.perf_counter()
    if after["state"] != "training":
        raise RuntimeError(f"the job stopped training during a phase: {after['state']}")
    return (after["samples"] - before["samples"]) / (t1 - t0)


def run(*, repeats: int = 15, phase_s: float = 2.0, every_s: float = 1.0, client: str = "http",
        batch_size: int = 256, warmup_s: float = 10.0) -> dict[str, Any]:
    """The JSON-ready figures (see the module docstring)."""
    page = CLIENTS[client]
    closed: list[float] = []
    opened: list[float] = []
    with _training_job(batch_size) as url:
        _phase(url, warmup_s)  # compilation and caches: not counted
        for i in range(repeats):
            for kind in (("closed", "open") if i % 2 == 0 else ("open", "closed")):
                if kind == "open":
                    with page(url, every_s):
                        opened.append(_phase(url, phase_s))
                else:
                    closed.append(_phase(url, phase_s))
            console.print(f"pair {i + 1}/{repeats}: closed {closed[-1]:,.0f}, "
                          f"open {opened[-1]:,.0f} samples/s")
    ratios = [o / c for o, c in zip(opened, closed, strict=True)]
    return {"client": client, "phase_s": phase_s, "every_s": every_s, "repeats": repeats,
            "warmup_s": warmup_s,
            "closed_samples_per_s": closed, "open_samples_per_s": opened,
            "closed_median": statistics.median(closed),
            "open_median": statistics.median(opened),
            "pair_ratios": ratios, "open_vs_closed": statistics.median(ratios)}


def _main(args: argparse.Namespace) -> int:
    result = run(repeats=args.repeats, phase_s=args.phase_s, every_s=args.every_s,
                 client=args.client, batch_size=args.batch_size, warmup_s=args.warmup_s)
    table = Table(title=f"training with the live page open ({args.client} client, polling "
                        f"every {args.every_s} s) vs closed, {args.repeats} paired phases")
    for column in ("page", "samples/s (median)", "ratio"):
        table.add_column(column, justify="right")
    table.add_row("closed (baseline)", f"{result['closed_median']:,.0f}", "1.000")
    table.add_row("open", f"{result['open_median']:,.0f}",
                  f"{result['open_vs_closed']:.3f} (median of pairs; goal >= 0.98)")
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
