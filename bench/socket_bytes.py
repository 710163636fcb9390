"""A byte-counting TCP proxy for benches: what really crossed a socket, framing included.

:class:`CountingProxy` listens on a loopback port per target in the running event loop and
copies each connection's bytes both ways, counting them as they are written. A client given
``proxy.addresses`` instead of the targets reaches the same servers; ``proxy.sent`` (client →
server) and ``proxy.received`` (server → client) are every byte of its connections: gRPC's
HTTP/2 frames and headers, msgpack bodies, codec payloads. It shares the event loop (and
the cores) with the client, so a bench that uses it reports bytes, never its speed.

Usage::

    async with CountingProxy(ps_addresses) as proxy:
        trainer = Trainer(ps_addresses=proxy.addresses, ...)
        before = proxy.total
        await trainer.fit(batches)
        print(proxy.total - before)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

__all__ = ["CountingProxy"]

_CHUNK = 1 << 16


class CountingProxy:
    """Forward ``targets`` (``host:port``); ``addresses[i]`` reaches ``targets[i]``."""

    def __init__(self, targets: Sequence[str]) -> None:
        self.targets = list(targets)
        self.addresses: list[str] = []
        self.sent = 0
        self.received = 0
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def total(self) -> int:
        """Bytes both ways so far."""
        return self.sent + self.received

    async def __aenter__(self) -> CountingProxy:
        for target in self.targets:
            host, _, port = target.rpartition(":")
            server = await asyncio.start_server(
                lambda r, w, h=host, p=int(port): self._connect(r, w, h, p), "127.0.0.1", 0)
            self._servers.append(server)
            self.addresses.append(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       host: str, port: int) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, port)
        for task in (self._copy(reader, up_writer, "sent"),
                     self._copy(up_reader, writer, "received")):
            owned = asyncio.create_task(task)
            self._tasks.add(owned)
            owned.add_done_callback(self._tasks.discard)

    async def _copy(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter,
                    counter: str) -> None:
        try:
            while chunk := await source.read(_CHUNK):
                setattr(self, counter, getattr(self, counter) + len(chunk))
                sink.write(chunk)
                await sink.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(Exception):
                sink.close()
