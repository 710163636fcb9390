"""A latency-injecting TCP proxy for benches: the network a PS would sit across, in user space.

There is no kernel netem on the bench machine, so :class:`LatencyProxy` forwards each target
address through a child process that holds every chunk it reads for ``rtt_ms / 2`` before
writing it on (each direction, order kept), optionally paced to ``bandwidth_mbps``. It runs
in its own process so that its work is not charged to the trainer's GIL; it still uses CPU
on the same cores, which a real network would not (a bench says so).

``measured_rtt_ms()`` times small round trips through the proxy against the same ones
without it: asyncio's timers are ~1 ms grained, so the delay it adds is measured, not assumed.

Usage::

    with LatencyProxy(cluster.addresses, rtt_ms=2.0) as proxy:
        train(ps_addresses=proxy.addresses)
        print(proxy.measured_rtt_ms())
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["LatencyProxy"]

_CHUNK = 1 << 16


class LatencyProxy:
    """Forward ``targets`` (``host:port``) through one proxy process adding ``rtt_ms`` of
    round-trip delay; ``addresses[i]`` reaches ``targets[i]``."""

    def __init__(self, targets: Sequence[str], *, rtt_ms: float,
                 bandwidth_mbps: float | None = None) -> None:
        if rtt_ms < 0:
            raise ValueError(f"rtt_ms must be >= 0, got {rtt_ms}")
        if bandwidth_mbps is not None and bandwidth_mbps <= 0:
            raise ValueError(f"bandwidth_mbps must be > 0, got {bandwidth_mbps}")
        self.targets = list(targets)
        self.rtt_ms = rtt_ms
        self.bandwidth_mbps = bandwidth_mbps
        self.addresses: list[str] = []
        self._echo: tuple[str, str] | None = None  # (direct, proxied) echo addresses
        self._proc: Any = None

    def __enter__(self) -> LatencyProxy:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        bytes_per_s = self.bandwidth_mbps * 1e6 / 8 if self.bandwidth_mbps else None
        self._proc = ctx.Process(target=_run, args=(self.targets, self.rtt_ms / 2e3,
                                                    bytes_per_s, child), daemon=True)
        self._proc.start()
        if not parent.poll(30):
            self.__exit__()
            raise RuntimeError("the latency proxy did not start within 30 s")
        ports, echo_port, echo_proxied = parent.recv()
        self.addresses = [f"127.0.0.1:{p}" for p in ports]
        self._echo = (f"127.0.0.1:{echo_port}", f"127.0.0.1:{echo_proxied}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.join(10)
            self._proc = None

    def measured_rtt_ms(self, trips: int = 50) -> float:
        """Median added round-trip time of a 64-byte message, in ms (proxied minus direct)."""
        if self._echo is None:
            raise RuntimeError("the proxy is not running")
        direct, proxied = (_round_trips(address, trips) for address in self._echo)
        return statistics.median(p - d for p, d in zip(sorted(proxied), sorted(direct),
                                                       strict=True)) * 1e3


def _round_trips(address: str, trips: int) -> list[float]:
    host, port = address.rsplit(":", 1)
    out = []
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(trips):
            started = time.perf_counter()
            s.sendall(b"x" * 64)
            got = 0
            while got < 64:
                got += len(s.recv(64 - got))
            out.append(time.perf_counter() - started)
    return out


def _run(targets: list[str], one_way_s: float, bytes_per_s: float | None,
         conn: Connection) -> None:
    """The proxy process: a listener thread per route, two pump threads per connection
    (threads, not asyncio: ``time.sleep`` holds sub-millisecond delays, asyncio's timers do
    not)."""
    echo = _listen()
    threading.Thread(target=_accept, args=(echo, _echo), daemon=True).start()
    echo_port = echo.getsockname()[1]
    ports = []
    for target in [*targets, f"127.0.0.1:{echo_port}"]:
        host, port = target.rsplit(":", 1)
        listener = _listen()
        ports.append(listener.getsockname()[1])
        threading.Thread(target=_accept, daemon=True, args=(
            listener, partial(_forward, (host, int(port)), one_way_s, bytes_per_s))).start()
    conn.send((ports[:-1], echo_port, ports[-1]))
    threading.Event().wait()  # until terminated


def _listen() -> socket.socket:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.listen(64)
    return listener


def _accept(listener: socket.socket, handle: Callable[[socket.socket], None]) -> None:
    while True:
        client, _ = listener.accept()
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=handle, args=(client,), daemon=True).start()


def _echo(client: socket.socket) -> None:
    with client:
        while data := client.recv(_CHUNK):
            client.sendall(data)


def _forward(target: tuple[str, int], one_way_s: float, bytes_per_s: float | None,
             client: socket.socket) -> None:
    upstream = socket.create_connection(target)
    upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pipe, args=(upstream, client, one_way_s, bytes_per_s),
                            daemon=True)
    back.start()
    _pipe(client, upstream, one_way_s, bytes_per_s)
    back.join()


def _pipe(source: socket.socket, sink: socket.socket, one_way_s: float,
          bytes_per_s: float | None) -> None:
    """Copy ``source`` to ``sink``, each chunk written ``one_way_s`` after it was read (and
    no sooner than the bandwidth allows), in order; half-close ``sink`` at the end."""
    chunks: queue.SimpleQueue[tuple[float, bytes] | None] = queue.SimpleQueue()

    def send() -> None:
        line_free_at = 0.0
        while (item := chunks.get()) is not None:
            due, data = item
            if bytes_per_s:
                line_free_at = max(line_free_at, time.perf_counter()) + len(data) / bytes_per_s
                due = max(due, line_free_at)
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            try:
                sink.sendall(data)
            except OSError:
                return
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        while data := source.recv(_CHUNK):
            chunks.put((time.perf_counter() + one_way_s, data))
    except OSError:
        pass
    finally:
        chunks.put(None)
        sender.join()
