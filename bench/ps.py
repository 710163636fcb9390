"""``persimmon bench ps``: the PS against its baselines, measured in one run.

1. store: lookup+gather of 1M ids (half new) and an Adagrad push, vs a Python-dict store.
2. gRPC: a PS in its own process, dim 16, fp16 rows, 64k-id batches, vs a Redis-backed store
   (pipelined MGET/MSET of row bytes against a redis-server this bench starts).
3. loopback: a 1 MiB echo over the same gRPC stack; the PS's bytes/s (fp32 lookups of 64k-id
   batches, so the figure measures the serving path, not float conversion) as a fraction of it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import multiprocessing
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import msgpack
import numpy as np
from rich.console import Console
from rich.table import Table

from bench import write_json
from bench.store import bench_store
from clients.ps_client import PSClient
from services.common.commands import float_at_least, int_at_least
from services.common.ports import free_port
from services.common.rpc import channel_options, generic_service, make_server
from services.local.processes import LocalPS

__all__ = ["register_bench", "run"]

DIM = 16
BATCH = 65_536
console = Console(stderr=True)


def _wait_port(port: int, proc: subprocess.Popen | multiprocessing.Process, what: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            alive = proc.poll() is None if isinstance(proc, subprocess.Popen) else proc.is_alive()
            if not alive or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.05)


async def _timed(step: Callable[[int], Awaitable[int]], seconds: float, depth: int) -> tuple[float, int]:
    """Run ``step(i)`` with ``depth`` calls in flight for about ``seconds``; returns (s, units)."""
    units = 0
    i = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        results = await asyncio.gather(*(step(i + d) for d in range(depth)))
        units += sum(results)
        i += depth
    return time.perf_counter() - start, units


# ---- 2. gRPC PS vs Redis ------------------------------------------------------------------------

_BATCHES: dict[tuple[int, int], np.ndarray] = {}


def _batch_ids(i: int, universe: int, distinct: int = 16) -> np.ndarray:
    """One of ``distinct`` precomputed batches of unique ids (made outside the timed loops)."""
    key = (i % distinct, universe)
    if key not in _BATCHES:
        rng = np.random.default_rng(key[0])
        _BATCHES[key] = np.unique(rng.integers(0, universe, size=BATCH, dtype=np.uint64))
    return _BATCHES[key]


async def _bench_grpc_ps(seconds: float, universe: int) -> dict[str, float]:
    with LocalPS(1, [{"name": "emb", "dim": DIM,
                      "optimizer": {"kind": "adagrad", "lr": 0.05}}]) as cluster:
        for i in range(16):
            _batch_ids(i, universe)
        async with PSClient(cluster.addresses, rows_codec="fp16", grads_codec="fp16") as ps, \
                PSClient(cluster.addresses) as ps32:
            grads = np.random.default_rng(0).normal(size=(BATCH, DIM)).astype(np.float32)
            await ps.lookup_unique("emb", _batch_ids(0, universe))  # warm-up

            async def lookup(i: int) -> int:
                ids = _batch_ids(i, universe)
                await ps.lookup_unique("emb", ids)
                return ids.size

            async def push(i: int) -> int:
                ids = _batch_ids(i, universe)
                await ps.push_unique("emb", ids, grads[: ids.size])
                return ids.size

            async def lookup32(i: int) -> int:
                ids = _batch_ids(i, universe)
                await ps32.lookup_unique("emb", ids)
                return ids.size

            before = ps.wire_bytes()
            lookup_s, lookup_rows = await _timed(lookup, seconds, depth=2)
            push_s, push_rows = await _timed(push, seconds, depth=2)
            after = ps.wire_bytes()
            await ps32.lookup_unique("emb", _batch_ids(0, universe))
            before32 = sum(ps32.wire_bytes().values())
            lookup32_s, _ = await _timed(lookup32, seconds, depth=4)
            moved32 = sum(ps32.wire_bytes().values()) - before32
        moved = sum(after.values()) - sum(before.values())
        return {"lookup_rows_per_s": lookup_rows / lookup_s, "push_rows_per_s": push_rows / push_s,
                "fp16_bytes_per_s": moved / (lookup_s + push_s),
                "bytes_per_s": moved32 / lookup32_s}


def _bench_redis(seconds: float, universe: int) -> dict[str, float]:
    """The same work on Redis: rows as fp16 bytes, created on first sight, Adagrad on push."""
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is needed for the Redis baseline")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="persimmon-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, proc, "redis-server")
        r = redis.Redis(port=port)
        grads = np.random.default_rng(0).normal(size=(BATCH, DIM)).astype(np.float32)
        rng = np.random.default_rng(1)

        def fetch(ids: np.ndarray) -> np.ndarray:
            keys = [b"e:%d" % i for i in ids.tolist()]
            values = r.mget(keys)
            missing = [k for k, v in enumerate(values) if v is None]
            rows = np.empty((ids.size, DIM), dtype=np.float16)
            if missing:
                fresh = rng.uniform(-0.01, 0.01, size=(len(missing), DIM)).astype(np.float16)
                r.mset({keys[k]: fresh[j].tobytes() for j, k in enumerate(missing)})
                for j, k in enumerate(missing):
                    values[k] = fresh[j].tobytes()
            rows[:] = np.frombuffer(b"".join(values), dtype=np.float16).reshape(-1, DIM)
            return rows

        def lookup(i: int) -> int:
            ids = _batch_ids(i, universe)
            fetch(ids)
            return ids.size

        def push(i: int) -> int:
            ids = _batch_ids(i, universe)
            keys = [b"e:%d" % i for i in ids.tolist()]
            akeys = [b"a:%d" % i for i in ids.tolist()]
            rows = fetch(ids).astype(np.float32)
            acc_raw = r.mget(akeys)
            acc = np.array([np.frombuffer(a, np.float32) if a else np.zeros(DIM, np.float32)
                            for a in acc_raw])
            g = grads[: ids.size]
            acc += g * g
            rows -= 0.05 * g / (np.sqrt(acc) + 1e-8)
            pipe = r.pipeline(transaction=False)
            pipe.mset(dict(zip(keys, (row.tobytes() for row in rows.astype(np.float16)), strict=True)))
            pipe.mset(dict(zip(akeys, (a.tobytes() for a in acc), strict=True)))
            pipe.execute()
            return ids.size

        lookup(0)

        def timed(step: Callable[[int], int]) -> tuple[float, int]:
            units, i, start = 0, 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                units += step(i)
                i += 1
            return time.perf_counter() - start, units

        lookup_s, lookup_rows = timed(lookup)
        push_s, push_rows = timed(push)
        return {"lookup_rows_per_s": lookup_rows / lookup_s, "push_rows_per_s": push_rows / push_s}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


# ---- 3. the loopback limit: 1 MiB echo over the same stack ---------------------------------------

def _echo_server(port: int) -> None:
    async def echo(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for raw in requests:
            body = msgpack.unpackb(raw)
            yield msgpack.packb({"rid": body["rid"], "data": body["data"]})

    async def serve() -> None:
        handler = generic_service("bench.Echo", {
            "Echo": grpc.stream_stream_rpc_method_handler(echo)})
        server, _ = make_server([handler], "127.0.0.1", port)
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


class EchoStream:
    """Requests in flight on one bidirectional gRPC stream (msgpack bodies), answered in the
    order they were written: the echo server keeps it."""

    def __init__(self, channel: grpc.aio.Channel, method: str) -> None:
        self._call = channel.stream_stream(method)()
        self._waiting: collections.deque[asyncio.Future[bytes]] = collections.deque()
        self._write = asyncio.Lock()
        self._rids = itertools.count()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while (raw := await self._call.read()) is not grpc.aio.EOF:
            self._waiting.popleft().set_result(raw)

    async def request(self, body: dict[str, Any]) -> dict[str, Any]:
        future = asyncio.get_running_loop().create_future()
        async with self._write:  # one writer at a time; the order of writes is the order of answers
            self._waiting.append(future)
            await self._call.write(msgpack.packb({"rid": next(self._rids), **body}))
        return msgpack.unpackb(await future)

    async def close(self) -> None:
        await self._call.done_writing()
        await self._reader


async def _bench_echo(seconds: float) -> dict[str, float]:
    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(target=_echo_server, args=(port,),
                                                        daemon=True)
    proc.start()
    try:
        _wait_port(port, proc, "echo server")
        payload = np.random.default_rng(0).bytes(1 << 20)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             options=channel_options()) as channel:
            stream = EchoStream(channel, "/bench.Echo/Echo")
            await stream.request({"data": payload})

            async def step(_: int) -> int:
                await stream.request({"data": payload})
                return 2 * len(payload)

            elapsed, moved = await _timed(step, seconds, depth=4)
            await stream.close()
        return {"bytes_per_s": moved / elapsed}
    finally:
        proc.terminate()
        proc.join(timeout=10)


# ---- the table ----------------------------------------------------------------------------------

def run(*, seconds: float = 3.0, store_ids: int = 1_000_000, universe: int = 2_000_000) -> dict[str, Any]:
    console.log(f"store: {store_ids:,} ids, EmbeddingTable vs Python dict")
    store = bench_store(num_ids=store_ids, dim=DIM)
    console.log(f"gRPC PS: {BATCH:,}-id batches, dim {DIM}, fp16, {seconds}s per phase")
    ps = asyncio.run(_bench_grpc_ps(seconds, universe))
    console.log("Redis baseline: pipelined MGET/MSET")
    rds = _bench_redis(seconds, universe)
    console.log("loopback: 1 MiB echo over grpc.aio + msgpack")
    echo = asyncio.run(_bench_echo(seconds))

    ps_rows = 2 / (1 / ps["lookup_rows_per_s"] + 1 / ps["push_rows_per_s"])
    redis_rows = 2 / (1 / rds["lookup_rows_per_s"] + 1 / rds["push_rows_per_s"])
    result = {
        "store_vs_dict": store["store_vs_dict"],
        "grpc_vs_redis": ps_rows / redis_rows,
        "grpc_vs_loopback": ps["bytes_per_s"] / echo["bytes_per_s"],
        "store": store,
        "grpc_ps": ps,
        "redis": rds,
        "echo": echo,
    }
    _print_table(result)
    return result


def _print_table(r: dict[str, Any]) -> None:
    table = Table(title="persimmon bench ps")
    for col in ("measure", "persimmon", "baseline", "ratio", "goal"):
        table.add_column(col, justify="right" if col != "measure" else "left")
    s, ps, rds, echo = r["store"], r["grpc_ps"], r["redis"], r["echo"]
    table.add_row("store: 1M lookup + Adagrad push", f"{s['store_s']:.3f} s",
                  f"{s['dict_s']:.3f} s (dict)", f"{r['store_vs_dict']:.1f}x", ">= 25")
    table.add_row("gRPC lookup rows/s", f"{ps['lookup_rows_per_s']:,.0f}",
                  f"{rds['lookup_rows_per_s']:,.0f} (Redis)",
                  f"{ps['lookup_rows_per_s'] / rds['lookup_rows_per_s']:.1f}x", "")
    table.add_row("gRPC push rows/s", f"{ps['push_rows_per_s']:,.0f}",
                  f"{rds['push_rows_per_s']:,.0f} (Redis)",
                  f"{ps['push_rows_per_s'] / rds['push_rows_per_s']:.1f}x", "")
    table.add_row("gRPC vs Redis (harmonic mean)", "", "", f"{r['grpc_vs_redis']:.1f}x", ">= 3")
    table.add_row("fp16 lookup+push bytes/s", f"{ps['fp16_bytes_per_s'] / 2**20:,.0f} MiB/s",
                  "", "", "")
    table.add_row("fp32 lookup bytes/s vs 1 MiB echo", f"{ps['bytes_per_s'] / 2**20:,.0f} MiB/s",
                  f"{echo['bytes_per_s'] / 2**20:,.0f} MiB/s (echo)",
                  f"{r['grpc_vs_loopback']:.2f}", ">= 0.8")
    Console().print(table)


def _main(args: argparse.Namespace) -> int:
    result = run(seconds=args.seconds, store_ids=args.store_ids)
    write_json(result, args.json)
    return 0


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ps", help="PS store, gRPC and loopback figures")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--seconds", type=float_at_least(0, inclusive=False), default=3.0,
                        help="seconds per timed phase")
    parser.add_argument("--store-ids", type=int_at_least(1), default=1_000_000,
                        help="ids in the store test")
    parser.set_defaults(func=_main)
