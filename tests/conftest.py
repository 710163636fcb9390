"""Shared fixtures: a private redis-server per session, a column cache per session, free
ports, polling with a deadline, a call that loses a cancel the way redis-py can, tables
created on started shards."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from services.common.ports import free_port

__all__ = ["eventually", "free_port", "swallowing_first_cancel"]


async def eventually(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0,
                     interval: float = 0.02) -> None:
    """Poll ``predicate`` (plain or async) until true or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


def swallowing_first_cancel(call: Callable[..., Awaitable[Any]], entered: asyncio.Event,
                            delay_s: float = 0.2) -> Callable[..., Awaitable[Any]]:
    """``call`` as redis-py 8's asyncio client sometimes behaves: the first cancel that lands
    while it waits is lost (it returns None as if nothing happened). Each call sets
    ``entered`` and waits ``delay_s`` (a slow link) before the real command, so a test that
    cancels once ``entered`` is set lands its cancel inside the call."""
    lost = 0

    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal lost
        entered.set()
        try:
            await asyncio.sleep(delay_s)
            return await call(*args, **kwargs)
        except asyncio.CancelledError:
            if lost:
                raise
            lost += 1
            return None

    return wrapped


def _redis_pid(port: int) -> int | None:
    """The process id of the redis-server answering on ``port``, or None if none answers."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.settimeout(0.5)
            conn.sendall(b"INFO server\r\n")
            reply = b""
            while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    return None
                reply += chunk
    except OSError:
        return None
    match = re.search(rb"process_id:(\d+)", reply)
    return int(match.group(1)) if match else None


def _start_redis(binary: str, workdir: str) -> tuple[subprocess.Popen[bytes], int]:
    """A redis-server of our own on a free port; another port if one was taken meanwhile
    (pytest-xdist's workers each start one at the same moment)."""
    for _ in range(5):
        port = free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        # ours, not whatever else took the port: the server answering must have our pid
        while _redis_pid(port) != proc.pid:
            if proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        else:
            return proc, port
        proc.kill()
        proc.wait()
    raise RuntimeError("redis-server did not start on any of 5 free ports")


@pytest.fixture(scope="session", autouse=True)
def column_cache_dir() -> Iterator[str]:
    """The column cache of every ``persimmon train`` the tests run (their children inherit
    it): a directory of the session's, never the user's ``~/.cache``."""
    root = tempfile.mkdtemp(prefix="persimmon-columns-")
    os.environ["PERSIMMON_CACHE_DIR"] = root
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A redis:// URL: PERSIMMON_TEST_REDIS_URL if set, else a redis-server of our own."""
    url = os.environ.get("PERSIMMON_TEST_REDIS_URL")
    if url:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: the Redis-backed tests need it "
                    "(apt-get install redis-server, or set PERSIMMON_TEST_REDIS_URL)")
    workdir = tempfile.mkdtemp(prefix="persimmon-redis-")
    proc, port = _start_redis(binary, workdir)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI every test must run: a skipped test (e.g. a missing Redis or Kafka) fails CI."""
    if not os.environ.get("CI"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        names = ", ".join(r.nodeid for r in skipped[:10])
        reporter.write_line(f"CI: {len(skipped)} test(s) were skipped and must run: {names}",
                            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
