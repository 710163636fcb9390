"""Service processes on this machine's loopback ports, for the demo, ``train`` and benchmarks.

:func:`free_port` and :func:`wait_ready` are the two helpers every local launcher needs;
:class:`LocalLoader` runs one ``persimmon loader`` process (the PS shards are
:class:`services.demo.LocalPS`).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

__all__ = ["LocalLoader", "free_port", "stop_processes", "wait_ready"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float = 60.0) -> None:
    """Poll ``url/readyz`` until it answers 200; raise if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the process serving {url} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not become ready within {timeout:.0f} s")
        time.sleep(0.1)


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    """SIGTERM every live process, wait for each, SIGKILL those that do not exit in time."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class LocalLoader:
    """A ``persimmon loader`` process reading ``source`` (a loader spec such as
    ``synthetic:100000`` or ``criteo:data/*.gz``) for ``world_size`` worker ranks.

    ``settings`` are further loader flags by field name (``shuffle_buffer=4096``)."""

    def __init__(self, source: str, *, batch_size: int, world_size: int, seed: int = 0,
                 epochs: int = 1, **settings: Any) -> None:
        self.grpc_port, self.admin_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.grpc_port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        flags = {"source": source, "batch_size": batch_size, "world_size": world_size,
                 "seed": seed, "epochs": epochs, "grpc_port": self.grpc_port,
                 "admin_port": self.admin_port, **settings}
        self.command = [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "loader"]
        for name, value in flags.items():
            self.command += [f"--{name.replace('_', '-')}", str(value)]
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LocalLoader:
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL)
        try:
            wait_ready(self.proc, self.admin_url)
        except BaseException:
            stop_processes([self.proc])
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_processes([self.proc])
