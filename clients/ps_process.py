"""A :class:`PSClient` in a process of its own: PERSIA's embedding worker beside the NN worker.

A trainer's process runs its dense compute in a thread; the PS traffic of every step (grpc.aio,
msgpack, codecs) would otherwise run on the same interpreter and take the GIL from compute.
:class:`PSClientProcess` starts a child process that holds a real :class:`PSClient` and serves
the step's three calls (``lookup_sharded``, ``push_sharded``, ``push_then_lookup``),
``lookup_state_sharded`` (a replica's seed rows), ``report_loss`` (the adaquant grads codec's s) and ``tables`` over a socket pair: each request
is one length-prefixed pickle (protocol 5; arrays travel as raw buffers), answered in any order by request id, many in flight. Errors come back as the
Persimmon error the child raised. The child's byte counters come back with every answer, so
``wire_bytes()`` and ``codec_stats`` read as a :class:`PSClient`'s: it is a
worker's ``RowsClient`` (and a ``ProcessCPU``, :mod:`services.worker.embedding.rows`). The
child runs at a lower priority (``nice``, default 10): in hybrid mode its work is off the
step's critical path, and it must not take the core the dense compute runs on.

Usage::

    async with PSClientProcess(addresses, rows_codec="fp16") as ps:
        rows = await ps.lookup_sharded(layout)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from clients.ps_client import PSClient, PushAck
from services.common.codecs import WireStats
from services.common.codecs.masked import REFRESH as DCT_MP_REFRESH
from services.common.codecs.masked import PooledMasks
from services.common.errors import InvalidArgument, PersimmonError, Unavailable
from services.common.lifecycle import freeze_startup_objects
from services.common.messages import TableInfo
from services.common.sharding import ShardedIds

__all__ = ["PSClientProcess"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")
# PSClient's step calls, and its table configs
_SERVED = ("lookup_sharded", "lookup_state_sharded", "push_sharded", "push_then_lookup",
           "pooled_lookup", "pooled_lookup_masked", "pooled_push", "tables", "report_loss")
_START_TIMEOUT_S = 120.0  # a spawned interpreter imports numpy, numba and grpc first


async def _send(writer: asyncio.StreamWriter, message: Any) -> None:
    payload = pickle.dumps(message, protocol=5)
    writer.write(_HEADER.pack(len(payload)) + payload)
    await writer.drain()


async def _receive(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(size))


async def _serve(sock: socket.socket) -> None:
    """The child: read the client's settings, connect a PSClient, then answer requests until
    the parent hangs up."""
    reader, writer = await asyncio.open_connection(sock=sock)
    addresses, registry, options, nice = await _receive(reader)
    if nice and hasattr(os, "nice"):
        os.nice(nice)
    try:
        client = await (PSClient.from_registry(registry, **options) if registry
                        else PSClient(addresses, **options)).connect()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        await _send(writer, ("failed", exc))
        return
    freeze_startup_objects()
    await _send(writer, ("ready", (client.addresses, client.dims)))
    write_lock = asyncio.Lock()
    tasks: set[asyncio.Task[None]] = set()

    async def answer(rid: int, method: str, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> None:
        try:
            if method == "cpu_seconds":
                result: Any = time.process_time()
            elif method in _SERVED:
                result = await getattr(client, method)(*args, **kwargs)
            else:
                raise InvalidArgument(f"the PS client process serves {_SERVED}, not {method!r}")
            reply = (rid, True, result, client.wire_bytes(), client.codec_stats)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to its caller
            reply = (rid, False, exc, client.wire_bytes(), client.codec_stats)
        async with write_lock:
            try:
                await _send(writer, reply)
            except ConnectionError:  # the parent hung up; the read loop ends too
                pass

    try:
        while True:
            try:
                rid, method, args, kwargs = await _receive(reader)
            except asyncio.IncompleteReadError:
                return  # the parent closed its end
            task = asyncio.create_task(answer(rid, method, args, kwargs))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        writer.close()


def _child_main(fd: int) -> None:
    asyncio.run(_serve(socket.socket(fileno=fd)))


class PSClientProcess:
    """The step calls of a :class:`PSClient` served by a child process (see the module doc).

    ``options`` are :class:`PSClient`'s keywords (codecs, timeout, retry_s, token, tls); they
    must pickle. With ``registry`` (a URL) the child discovers the shards there, as
    :meth:`PSClient.from_registry`, and finds them again after a shard moves. ``nice``: how
    much lower the child's priority is. ``num_shards``, the shard ``addresses`` and the tables'
    ``dims`` are known once connected; ``pid`` while the child runs, ``returncode`` once it
    exited.
    """

    def __init__(self, addresses: Sequence[str] = (), *, registry: str | None = None,
                 nice: int = 10, **options: Any) -> None:
        if not addresses and registry is None:
            raise InvalidArgument("PSClientProcess needs the PS shard addresses or a registry")
        self.addresses = list(addresses)
        self._registry = registry
        self._options = options
        self._nice = nice
        self._process: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None  # the child's exit status, once closed
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._answers: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._rids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._wire_bytes: dict[str, int] = {}
        self.codec_stats = WireStats()
        self.dims: dict[str, int] = {}

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs (None before :meth:`connect` and once
        closed)."""
        return self._process.pid if self._process is not None else None

    async def connect(self) -> PSClientProcess:
        """Start the child and wait until its PSClient is connected (idempotent)."""
        if self._process is not None:
            return self
        ours, theirs = socket.socketpair()
        # a fresh interpreter (no fork of a process with threads; unlike multiprocessing's
        # spawn it never re-imports the caller's __main__) that imports the caller's modules:
        # its path is the caller's (-P: no working directory in front of it)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
        self._process = subprocess.Popen(
            [sys.executable, "-P", "-m", "clients.ps_process", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self._reader, self._writer = await asyncio.open_connection(sock=ours)
        try:
            await _send(self._writer, (self.addresses, self._registry, self._options,
                                       self._nice))
            status, detail = await asyncio.wait_for(_receive(self._reader), _START_TIMEOUT_S)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError) as exc:
            await self.close()
            raise Unavailable("the PS client process did not start") from exc
        if status != "ready":
            await self.close()
            raise detail
        addresses, dims = detail
        self.addresses = list(addresses)
        self.dims.update(dims)
        self._answers = asyncio.create_task(self._read_answers(self._reader),
                                            name="ps client process answers")
        return self

    async def _read_answers(self, reader: asyncio.StreamReader) -> None:
        error: PersimmonError = Unavailable("the PS client process exited")
        try:
            while True:
                rid, ok, result, self._wire_bytes, self.codec_stats = await _receive(reader)
                future = self._pending.pop(rid, None)
                if future is None or future.done():
                    continue
                if ok:
                    future.set_result(result)
                else:
                    future.set_exception(result)
        except asyncio.IncompleteReadError:
            pass
        except asyncio.CancelledError:
            error = Unavailable("the PS client process was closed")
            raise
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(error)
            self._pending.clear()

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._writer is None or self._answers is None or self._answers.done():
            raise Unavailable("the PS client process is not running; connect() first")
        rid = next(self._rids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            async with self._write_lock:
                await _send(self._writer, (rid, method, args, kwargs))
        except (ConnectionError, RuntimeError) as exc:
            self._pending.pop(rid, None)
            raise Unavailable("the PS client process is gone") from exc
        return await future

    async def lookup_sharded(self, layout: ShardedIds) -> np.ndarray:
        """:meth:`PSClient.lookup_sharded`, in the child."""
        return await self._call("lookup_sharded", layout)

    async def lookup_state_sharded(self, layout: ShardedIds
                                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """:meth:`PSClient.lookup_state_sharded`, in the child."""
        return await self._call("lookup_state_sharded", layout)  # type: ignore[no-any-return]

    async def push_sharded(self, layout: ShardedIds, grads: np.ndarray) -> PushAck:
        """:meth:`PSClient.push_sharded`, in the child."""
        return await self._call("push_sharded", layout, grads)

    async def push_then_lookup(self, layout: ShardedIds, grads: np.ndarray,
                               then: ShardedIds) -> tuple[PushAck, np.ndarray]:
        """:meth:`PSClient.push_then_lookup`, in the child."""
        return await self._call("push_then_lookup", layout, grads, then)

    async def pooled_lookup(self, table: str, ids: Any, lengths: Any,
                            mode: str = "sum") -> np.ndarray:
        """:meth:`PSClient.pooled_lookup`, in the child."""
        return await self._call("pooled_lookup", table, ids, lengths, mode)

    async def pooled_lookup_masked(self, table: str, ids: Any, lengths: Any, mode: str = "sum",
                                   *, keep: float, refresh: int = DCT_MP_REFRESH
                                   ) -> tuple[np.ndarray, PooledMasks]:
        """:meth:`PSClient.pooled_lookup_masked`, in the child."""
        return await self._call(  # type: ignore[no-any-return]
            "pooled_lookup_masked", table, ids, lengths, mode, keep=keep, refresh=refresh)

    async def pooled_push(self, table: str, ids: Any, lengths: Any, grads: Any,
                          mode: str = "sum", *, masks: PooledMasks | None = None) -> PushAck:
        """:meth:`PSClient.pooled_push`, in the child."""
        return await self._call("pooled_push", table, ids, lengths, grads, mode, masks=masks)

    async def tables(self) -> list[TableInfo]:
        """:meth:`PSClient.tables`, in the child; refreshes ``dims``."""
        tables: list[TableInfo] = await self._call("tables")
        self.dims.update({t.name: t.dim for t in tables})
        return tables

    async def report_loss(self, loss: float) -> int | None:
        """:meth:`PSClient.report_loss`, in the child: requests are handled in the order they
        are sent, so every push sent after it uses the new s."""
        return await self._call("report_loss", loss)

    async def cpu_seconds(self) -> float:
        """CPU seconds the child process has used so far."""
        return float(await self._call("cpu_seconds"))

    def wire_bytes(self) -> dict[str, int]:
        """The child's bytes sent and received per stream, as of its latest answer."""
        return dict(self._wire_bytes)

    async def close(self) -> None:
        """Hang up; the child closes its PSClient and exits."""
        if self._answers is not None:
            self._answers.cancel()
            await asyncio.gather(self._answers, return_exceptions=True)
            self._answers = None
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except ConnectionError:
                pass
            self._writer = None
        if self._process is not None:
            process, self._process = self._process, None
            try:
                await asyncio.to_thread(process.wait, 10.0)
            except subprocess.TimeoutExpired:
                log.warning("the PS client process did not exit; killing it")
                process.kill()
                await asyncio.to_thread(process.wait)
            self.returncode = process.returncode

    async def __aenter__(self) -> PSClientProcess:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
