"""A PS shard process SIGKILLed again and again (also while it writes a checkpoint) and
restarted from its newest checkpoint, while a PSClient with retries keeps pushing to a
counting table. Push ``i`` adds 1 to its own marker id and to a few shared ids, so at the end:

- every marker row is 0 or 1: a push is lost with a crash (it was acknowledged after the
  checkpoint the shard restarted from; there is no write-ahead log), refused for its epoch
  (in flight across the restart: the client raises StaleEpoch, re-syncs and goes on) or
  applied once, never twice;
- every shared id's row is the number of surviving pushes (marker 1) that hold it: a push is
  applied whole or not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import sys

import httpx
import numpy as np
import yaml

from clients.ps_client import PSClient
from services.common.errors import StaleEpoch
from tests.conftest import free_port
from tests.unit.ps.counting import applied_counts, count_grads

PUSHES = 400  # of the lost-replies test
MAX_PUSHES = 4000  # of the SIGKILL test: a bound, not a goal (it stops after KILLS kills)
KILLS = 3
IN_FLIGHT = 4
CUT_EVERY = 10  # of the lost-replies test: every tenth group of pushes loses its replies
MARKERS = 1_000_000  # push i's own id: MARKERS + i
SHARED = 64


class Shard:
    """One ``persimmon ps`` process and how to kill and restart it."""

    def __init__(self, tmp_path) -> None:
        self.config = tmp_path / "ps.yaml"
        self.config.write_text(yaml.safe_dump({"tables": [
            {"name": "count", "dim": 2, "initializer": "zeros",
             "optimizer": {"kind": "sgd", "lr": 1.0}}]}))
        self.ckpt = tmp_path / "ckpt"
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = self.admin = ""
        self.kills = self.checkpoints = 0

    async def start(self, restore: str | None = None) -> None:
        grpc_port, admin_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "services.cli", "ps", "--grpc-port", str(grpc_port),
               "--admin-port", str(admin_port), "--config", str(self.config),
               "--checkpoint-dir", str(self.ckpt)]
        self.proc = subprocess.Popen([*cmd, *(["--restore", restore] if restore else [])],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.admin = f"http://127.0.0.1:{admin_port}"
        async with httpx.AsyncClient(timeout=1.0) as http:
            for _ in range(600):
                assert self.proc.poll() is None, "the shard did not start"
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(self.admin + "/readyz")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the shard was not ready within 60 s")
        self.address = f"127.0.0.1:{grpc_port}"

    async def checkpoint(self, http: httpx.AsyncClient) -> None:
        self.checkpoints += 1
        response = await http.post(self.admin + "/v1/checkpoints",
                                   json={"id": f"c{self.checkpoints:04d}"})
        assert response.status_code == 201, response.text

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.kills += 1

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def _chaos(shard: Shard, done: asyncio.Event, rng: random.Random) -> None:
    """Checkpoints and SIGKILLs (some in the middle of a checkpoint) until ``done``."""
    async with httpx.AsyncClient(timeout=30.0) as http:
        while not done.is_set():
            await asyncio.sleep(rng.uniform(0.05, 0.4))
            action = rng.choice(["checkpoint", "checkpoint", "kill", "kill_in_checkpoint"])
            if action == "checkpoint":
                with contextlib.suppress(httpx.HTTPError):
                    await shard.checkpoint(http)
                continue
            if action == "kill_in_checkpoint":
                writing = asyncio.ensure_future(shard.checkpoint(http))
                await asyncio.sleep(rng.uniform(0.0, 0.03))
                shard.kill()
                with contextlib.suppress(httpx.HTTPError, AssertionError):
                    await writing
            else:
                shard.kill()
            await shard.start(restore="latest")


async def test_pushes_survive_sigkills_whole_and_at_most_once(tmp_path):
    rng = random.Random(20)
    shard = Shard(tmp_path)
    await shard.start()
    try:
        async with httpx.AsyncClient(timeout=30.0) as http:
            await shard.checkpoint(http)  # something to restart from

        async def resolve() -> list[str]:
            return [shard.address]

        members = [rng.sample(range(SHARED), 8) for _ in range(MAX_PUSHES)]
        done = asyncio.Event()
        chaos = asyncio.ensure_future(_chaos(shard, done, rng))
        pushed = 0

        async def push(ps: PSClient, i: int) -> None:
            ids = np.array([MARKERS + i, *members[i]], dtype=np.uint64)
            try:
                ack = await ps.push("count", ids, count_grads(ids.size))
            except StaleEpoch:  # sent before the restart: refused whole (the restored state
                # holds it or not, as it held it before the restart or not)
                await ps.resync()
                return
            assert ack.applied == ids.size

        try:
            async with PSClient([], resolver=resolve, retry_s=60, timeout=10) as ps:
                while pushed < MAX_PUSHES and (shard.kills < KILLS or pushed < 40):
                    await asyncio.gather(*(push(ps, pushed + j) for j in range(IN_FLIGHT)))
                    pushed += IN_FLIGHT
                    await asyncio.sleep(0.01)
        finally:
            done.set()
            await chaos
        async with PSClient([], resolver=resolve, retry_s=60) as ps:
            # pushes after the last restart stay (every earlier one may have been rolled
            # back, if no checkpoint completed after it): the run is never vacuous
            await asyncio.gather(*(push(ps, pushed + j) for j in range(IN_FLIGHT)))
            pushed += IN_FLIGHT
            markers = applied_counts(await ps.lookup(
                "count", np.arange(MARKERS, MARKERS + pushed, dtype=np.uint64)))
            shared_rows = applied_counts(await ps.lookup(
                "count", np.arange(SHARED, dtype=np.uint64)))
    finally:
        shard.stop()
    assert shard.kills >= KILLS, "the chaos did not happen"
    assert set(markers.tolist()) <= {0.0, 1.0}, "a push was applied twice"
    expected = np.zeros(SHARED)
    for i in np.flatnonzero(markers):
        expected[members[i]] += 1
    np.testing.assert_array_equal(shared_rows, expected)  # whole pushes only
    assert markers.sum() > 0


class Proxy:
    """A TCP proxy that can drop the server's replies and then cut every connection: a
    request is served, its reply lost, and the client retries it on a new connection."""

    def __init__(self, upstream: str) -> None:
        self.host, port = upstream.rsplit(":", 1)
        self.port = int(port)
        self.blackhole = False
        self.cuts = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.address = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, replies: bool):
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    if not (replies and self.blackhole):
                        dst.write(data)
                        await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))

    async def cut(self, blackhole_s: float) -> None:
        """Lose the replies for ``blackhole_s`` seconds, then reset every connection."""
        self.blackhole = True
        await asyncio.sleep(blackhole_s)
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        self.blackhole = False
        self.cuts += 1

    async def close(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def test_pushes_whose_replies_are_lost_are_applied_exactly_once(tmp_path):
    """The shard stays up; replies are lost and connections reset under pushes in flight.
    Every push is retried until acknowledged, so each marker must be exactly 1 — and some
    retries must have been answered from the window (the case a shard without it applies
    twice)."""
    from services.ps.config import PSConfig
    from services.ps.service import PSService
    from tests.unit.ps.counting import counting_table

    service = PSService(PSConfig(grpc_port=0, admin_port=0, tables=[counting_table("count")]))
    await service.start()
    proxy = Proxy(service.address)
    await proxy.start()
    rng = random.Random(21)
    members = [rng.sample(range(SHARED), 8) for _ in range(PUSHES)]

    async def push(ps: PSClient, i: int) -> None:
        ids = np.array([MARKERS + i, *members[i]], dtype=np.uint64)
        assert (await ps.push("count", ids, count_grads(ids.size))).applied == ids.size

    try:
        async with PSClient([proxy.address], retry_s=60, timeout=5) as ps:
            for group, first in enumerate(range(0, PUSHES, IN_FLIGHT)):
                pushes = [push(ps, first + j) for j in range(IN_FLIGHT)]
                if group % CUT_EVERY == 0:
                    # The cut's task runs first: replies are already lost when these
                    # pushes reach the shard, so each is applied and then retried.
                    pushes.insert(0, proxy.cut(rng.uniform(0.01, 0.03)))
                await asyncio.gather(*pushes)
        table = service.shard.table("count")
        markers = applied_counts(table.lookup(np.arange(MARKERS, MARKERS + PUSHES,
                                                        dtype=np.uint64)))
        shared_rows = applied_counts(table.lookup(np.arange(SHARED, dtype=np.uint64)))
        retries = service.shard.pushes.stats().retries
    finally:
        await proxy.close()
        await service.close()
    assert proxy.cuts == PUSHES // IN_FLIGHT // CUT_EVERY
    assert markers.tolist() == [1.0] * PUSHES  # none lost, none applied twice
    expected = np.zeros(SHARED)
    for shared in members:
        expected[shared] += 1
    np.testing.assert_array_equal(shared_rows, expected)
    assert retries > 0, "no retry was answered from the window: the test missed its case"
