"""The admin API against hostile requests, on real servers and real ports: a chunked body past
the cap, a peek that waits on a checkpoint's lock, a table that names a path outside the
shard's data directory or sizes past its bounds; and the worker's and the loader's apps
guarded by the same code."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from clients.ps_client import PSClient
from services.common.admin import MAX_BODY_BYTES, AdminServer
from services.common.auth import ServerSecurity
from services.loader.config import LoaderConfig
from services.loader.service import LoaderService
from services.worker.admin import WorkerProgress, make_worker_admin
from tests.integration.security.conftest import TOKEN, table_state

MiB = 1 << 20


async def _chunked_post(port: int, path: str, chunks: int, *, headers: str = "",
                        timeout: float = 10.0) -> tuple[bytes, bool]:
    """POST ``chunks`` chunks of 1 MiB with ``Transfer-Encoding: chunked`` and never the end
    of the body; returns the server's answer and whether it then closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     f"Transfer-Encoding: chunked\r\n{headers}\r\n".encode())
        block = b"%x\r\n" % MiB + b" " * MiB + b"\r\n"
        for _ in range(chunks):
            writer.write(block)
            await writer.drain()
        answer = b""
        while b"\r\n\r\n" not in answer:
            more = await asyncio.wait_for(reader.read(65536), timeout)
            if not more:
                break
            answer += more
        try:
            rest = await asyncio.wait_for(reader.read(), timeout)
            closed = True
        except ConnectionResetError:
            rest, closed = b"", True
        return answer + rest, closed
    finally:
        writer.close()


async def test_a_chunked_body_past_the_cap_is_413_before_the_rest_is_sent(start_ps):
    """20 MiB announced by no Content-Length: once 17 MiB are in (past the 16 MiB cap) the
    server answers 413 and closes, without waiting for the other 3 MiB and the end."""
    ps = await start_ps()
    before = table_state(ps)
    started = time.monotonic()
    answer, closed = await _chunked_post(ps.admin_port, "/v1/tables", MAX_BODY_BYTES // MiB + 1)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"exceeds the limit of 16777216 bytes" in answer
    assert closed and time.monotonic() - started < 10
    assert table_state(ps) == before


async def test_a_chunked_body_under_the_cap_is_served(start_ps):
    ps = await start_ps()
    body = b'{"name": "chunked", "dim": 4}'
    reader, writer = await asyncio.open_connection("127.0.0.1", ps.admin_port)
    writer.write(b"POST /v1/tables HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body
                 + b"\r\n0\r\n\r\n")
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 201"), answer
    assert "chunked" in ps.shard.tables


async def test_a_peek_waiting_on_a_checkpoint_lock_leaves_the_loop_serving(start_ps):
    """A checkpoint holds every table's lock while it writes; a peek of such a table waits
    in a thread: /healthz and gRPC lookups of the server go on answering meanwhile."""
    ps = await start_ps()
    hold_s = 1.5
    held = threading.Event()

    def checkpointing() -> None:
        with ps.shard.holding(["user"]):  # as Shard.checkpoint holds it while it writes
            held.set()
            time.sleep(hold_s)

    holder = threading.Thread(target=checkpointing)
    holder.start()
    held.wait(5)
    stalls, lookups = [], []
    try:
        async with httpx.AsyncClient(base_url=ps.admin_url, timeout=10) as http, \
                PSClient([ps.address]) as client:
            peek = asyncio.create_task(http.get("/v1/tables/user/rows/3"))
            deadline = time.monotonic() + 0.7 * hold_s
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                assert (await http.get("/healthz")).status_code == 200
                stalls.append(time.monotonic() - t0)
                t0 = time.monotonic()
                await client.lookup("item", np.arange(4, dtype=np.uint64))
                lookups.append(time.monotonic() - t0)
            waited = not peek.done()  # still waiting for the lock, in its thread
            answer = await peek
    finally:
        holder.join()
    # A loop blocked by the peek answers nothing until the lock is released: one probe
    # would take about hold_s and few would fit before the deadline. A busy machine may
    # stall one probe for a while, so the bound is on the typical probe and on none
    # coming near the hold.
    assert len(stalls) >= 5, stalls
    for probes in (stalls, lookups):
        assert statistics.median(probes) < hold_s / 10 and max(probes) < 0.7 * hold_s, probes
    assert waited and answer.status_code == 200 and answer.json()["present"] is False


@pytest.mark.parametrize("path, why", [
    ("{outside}", "outside"),
    ("../outside/t", "outside"),
    ("link/t", "outside"),  # a symlink inside the data directory that leads out
])
async def test_a_storage_path_outside_the_data_dir_is_refused(start_ps, tmp_path, path, why):
    data = tmp_path / "data"
    outside = tmp_path / "outside"
    data.mkdir()
    outside.mkdir()
    (data / "link").symlink_to(outside)
    ps = await start_ps(data_dir=str(data))
    before = table_state(ps)
    body = {"name": "cold", "dim": 4,
            "storage": {"tier": "disk", "path": path.format(outside=outside / "t"),
                        "ram_rows": 10}}
    async with httpx.AsyncClient(base_url=ps.admin_url, timeout=10) as http:
        answer = await http.post("/v1/tables", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == "InvalidArgument"
    assert answer.json()["message"].startswith("storage.path:") and why in answer.json()["message"]
    assert table_state(ps) == before and list(outside.iterdir()) == []


async def test_a_storage_path_needs_a_data_dir_and_one_under_it_is_taken(start_ps, tmp_path):
    body = {"name": "cold", "dim": 4, "storage": {"tier": "disk", "path": "cold",
                                                  "ram_rows": 10}}
    bare = await start_ps()
    async with httpx.AsyncClient(base_url=bare.admin_url, timeout=10) as http:
        answer = await http.post("/v1/tables", json=body)
    assert answer.status_code == 400 and "no data directory (data_dir)" in answer.json()["message"]
    assert "cold" not in bare.shard.tables
    data = tmp_path / "data"
    data.mkdir()
    ps = await start_ps(data_dir=str(data))
    async with httpx.AsyncClient(base_url=ps.admin_url, timeout=10) as http:
        assert (await http.post("/v1/tables", json=body)).status_code == 201
        described = (await http.get("/v1/tables/cold")).json()
    assert Path(described["config"]["storage"]["path"]) == (data / "cold").resolve()


@pytest.mark.parametrize("field, value, limit", [
    ("initial_capacity", 1 << 20, "max_initial_capacity"),
    ("dim", 2048, "max_table_dim"),
])
async def test_a_table_past_the_shards_bounds_is_refused(start_ps, field, value, limit):
    ps = await start_ps()
    before = table_state(ps)
    body = {"name": "huge", "dim": 4, field: value}
    async with httpx.AsyncClient(base_url=ps.admin_url, timeout=10) as http:
        started = time.monotonic()
        answer = await http.post("/v1/tables", json=body)
    assert time.monotonic() - started < 1.0
    assert answer.status_code == 400, answer.text
    message = answer.json()["message"]
    assert message.startswith(f"{field}: {value}") and limit in message
    assert table_state(ps) == before


async def _guarded(url: str, read: str) -> None:
    """``read`` needs the token; /healthz does not; a chunked body past the cap is a 413."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get(read)).status_code == 401
        ok = await http.get(read, headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200


async def test_the_worker_and_loader_apps_are_guarded_by_the_same_code(monkeypatch):
    monkeypatch.setenv("PERSIMMON_TOKEN", TOKEN)  # read as each app is made
    app = make_worker_admin(WorkerProgress(), config=dict, ready=lambda: True)
    worker = AdminServer(app, "127.0.0.1", 0, security=ServerSecurity())
    port = await worker.start()
    loader = LoaderService(LoaderConfig(source="synthetic:1000", grpc_port=0, admin_port=0,
                                        batch_size=100))
    await loader.start()
    monkeypatch.delenv("PERSIMMON_TOKEN")
    try:
        for url, read, admin_port in ((f"http://127.0.0.1:{port}", "/v1/progress", port),
                                      (loader.admin_url, "/v1/stats", loader.admin_port)):
            await _guarded(url, read)
            answer, closed = await _chunked_post(
                admin_port, "/v1/anything", MAX_BODY_BYTES // MiB + 1,
                headers=f"Authorization: Bearer {TOKEN}\r\n")
            assert answer.startswith(b"HTTP/1.1 413") and closed, answer[:200]
    finally:
        await worker.close()
        await loader.close()
