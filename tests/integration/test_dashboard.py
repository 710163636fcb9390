"""The live page of a worker's admin API in a real browser: headless Chromium (Debian's
``chromium`` and ``chromium-driver``) driven by Selenium opens ``/dashboard`` of a real uvicorn
server, waits for the curves to update while the counters move, and checks every figure it
shows against the JSON routes and ``/metrics`` it polls."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.admin import AdminServer
from services.common.auth import ServerSecurity
from services.common.codecs.streams import WireStatsCollector
from services.common.sharding import ShardedIds
from services.ps.inprocess import InProcessShards
from services.worker.admin import WorkerProgress, make_worker_admin
from services.worker.config import ps_table_configs

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
CODEC_ROWS = [{"stream": "ps_rows", "codec": "fp16", "direction": "received",
               "raw_bytes": 4096, "wire_bytes": 2048},
              {"stream": "ps_grads", "codec": "none", "direction": "sent",
               "raw_bytes": 1000, "wire_bytes": 1000}]


class LiveAdmin:
    """A worker's admin API on a real port, served by an event loop in a thread; the test
    changes the progress on that loop (as the Trainer does), never while a request reads it."""

    def __init__(self) -> None:
        self.progress = WorkerProgress(rank=0, world_size=2)
        self.progress.registry.register(WireStatsCollector(lambda: CODEC_ROWS))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.shards = InProcessShards(ps_table_configs({"a": 4, "b": 4}), num_shards=2)
        app = make_worker_admin(self.progress, config=dict, ready=lambda: True,
                                shards=self.shards.stats)
        self.server = AdminServer(app, "127.0.0.1", 0, security=ServerSecurity())
        port = self.call(self.server.start)
        self.url = f"http://127.0.0.1:{port}"

    def call(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            result = fn()
            return await result if asyncio.iscoroutine(result) else result
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    def train(self, steps: int, *, first_loss: float) -> None:
        def steps_() -> None:
            self.progress.training()
            for i in range(steps):
                self.progress.record_step(samples=64, loss=first_loss - 0.001 * i,
                                          staleness=i % 3)
                self.progress.lookup_seconds.observe(0.002 + 0.0001 * i)
            self.progress.record_eval({"step": self.progress.step, "auc": 0.6 + 0.01 * steps,
                                       "logloss": 0.5, "samples": self.progress.samples})
            self.progress.record_window({"step": self.progress.step, "window": 2 + steps % 3,
                                         "round_trip_ms": 0.5 + steps, "step_ms": 4.0})
        self.call(steps_)

    def get(self, path: str) -> httpx.Response:
        response = httpx.get(self.url + path)
        response.raise_for_status()
        return response

    def close(self) -> None:
        self.call(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


@pytest.fixture
def admin() -> Iterator[LiveAdmin]:
    live = LiveAdmin()
    yield live
    live.close()


@pytest.fixture
def browser() -> Iterator[Any]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if shutil.which(p) is None]
    if missing:  # CI installs them (.ci/run): a missing browser fails, it never skips
        pytest.fail(f"{missing} not found: apt-get install -y chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


_SNAPSHOT = """
const parse = v => v === undefined ? null : JSON.parse(v);
const shown = {};
for (const e of document.querySelectorAll("[data-value]")) shown[e.id] = parse(e.dataset.value);
for (const e of document.querySelectorAll("svg")) shown[e.id] = parse(e.dataset.points);
shown.bytes = [...document.querySelectorAll("#bytes tbody tr")].map(
    r => [r.dataset.stream, r.dataset.codec, r.dataset.direction, +r.dataset.raw, +r.dataset.wire]);
shown.shards = [...document.querySelectorAll("#shards tbody tr")].map(
    r => JSON.parse(r.dataset.shard));
shown.error = document.getElementById("error").textContent;
return shown;
"""


def _shown(driver: Any) -> dict[str, Any]:
    """Every figure the page shows, read at one instant (between two renders)."""
    return dict(driver.execute_script(_SNAPSHOT))


def _wait(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(None, timeout_s, poll_frequency=0.05).until(lambda _: condition(), what)


def test_the_page_shows_what_the_admin_api_serves(admin: LiveAdmin, browser: Any,
                                                  tmp_path: Path) -> None:
    ids = {"a": np.arange(300, dtype=np.uint64), "b": np.arange(50, dtype=np.uint64)}
    layout, _ = ShardedIds.of_tables(ids, 2)
    admin.shards.lookup_now(layout)  # 350 rows made: every id a miss
    admin.shards.lookup_now(layout)  # then none
    admin.train(5, first_loss=0.7)
    browser.get(admin.url + "/dashboard?every=100")
    _wait(lambda: _shown(browser).get("step") == 5, "the page shows the first steps")
    first_curve = _shown(browser)["loss-chart"]

    admin.train(30, first_loss=0.6)  # the curves must follow
    _wait(lambda: _shown(browser).get("step") == 35, "the page follows the training")
    shown = _shown(browser)
    progress, curves = admin.get("/v1/progress").json(), admin.get("/v1/curves").json()
    assert shown["loss-chart"] == curves["loss"] != first_curve
    assert len(curves["loss"]) == 35
    assert shown["auc-chart"] == [[e["step"], e["auc"]] for e in curves["evals"]]
    assert shown["staleness-chart"] == curves["staleness"] == [[0, 12], [1, 12], [2, 11]]
    for key in ("step", "samples", "loss", "state"):
        assert shown[key] == progress[key], key
    assert shown["world"] == progress["world_size"] == 2
    assert shown["auc"] == progress["eval"]["auc"]
    assert shown["staleness"] == [progress["staleness"], progress["staleness_max"]]
    assert shown["window"] == [progress["window"]["window"], progress["window"]["round_trip_ms"]]
    assert progress["window"]["round_trip_ms"] == 30.5  # the latest measurement, not the first

    metrics = {s.name: s.value for f in text_string_to_metric_families(admin.get("/metrics").text)
               for s in f.samples if not s.labels}
    lookup_ms = 1000 * metrics["persimmon_worker_lookup_seconds_sum"] \
        / metrics["persimmon_worker_lookup_seconds_count"]
    assert shown["latency"] == [pytest.approx(lookup_ms), None]  # no push timed yet
    assert shown["memory"] == pytest.approx(metrics["process_resident_memory_bytes"], rel=0.2)
    assert sorted(shown["bytes"]) == sorted(
        [c["stream"], c["codec"], c["direction"], c["raw_bytes"], c["wire_bytes"]]
        for c in CODEC_ROWS)
    served = admin.get("/v1/shards").json()["shards"]
    assert shown["shards"] == served and [s["shard_id"] for s in served] == [0, 1]
    assert sum(s["rows"] for s in served) == 350 and sum(s["misses"] for s in served) == 350
    assert all(s["miss_ratio"] == pytest.approx(0.5) for s in served)  # looked up twice
    assert shown["error"] == ""
    assert browser.save_screenshot(str(tmp_path / "dashboard.png"))
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000


def test_root_redirects_to_the_page_and_the_page_is_package_data(admin: LiveAdmin) -> None:
    response = httpx.get(admin.url + "/", follow_redirects=True)
    assert response.status_code == 200 and response.url.path == "/dashboard"
    assert "/v1/curves" in response.text and "<script" in response.text
    assert "http" not in response.text.replace("http://www.w3.org/2000/svg", "")  # no CDN


def test_curves_serve_a_diverged_loss_as_null(admin: LiveAdmin) -> None:
    admin.train(2, first_loss=float("nan"))
    curves = admin.get("/v1/curves").json()  # strict JSON: the page skips nulls when drawing
    assert [loss for _, loss in curves["loss"]] == [None, None]
    assert curves["evals"][0]["auc"] == pytest.approx(0.62)
