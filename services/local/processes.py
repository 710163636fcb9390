"""Service processes on this machine's loopback ports, for the demo, ``train``, benchmarks
and tests: :class:`LocalPS` (PS shard processes, optionally supervised) and
:class:`LocalLoader` (one ``persimmon loader`` process).

Each process binds port 0 and writes the ports it got to a ready file
(:func:`start_service`), so that concurrent launchers never race for a port one of them picked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from services.local.supervise import Supervisor

__all__ = ["LocalLoader", "LocalPS", "free_port", "start_service", "stop_processes",
           "wait_ready"]

# Each service runs as its own module (``python -m services.ps``): it starts without importing
# the CLI, torch or the benchmarks, which is what a supervisor's restart waits for.
_PS = [sys.executable, "-m", "services.ps", "--log-level", "WARNING"]
_LOADER = [sys.executable, "-m", "services.loader", "--log-level", "WARNING", "loader"]


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


def start_service(command: list[str], ready_file: str, timeout: float = 60.0, *,
                  nice: int = 0) -> tuple[subprocess.Popen[bytes], int, int]:
    """Start a ``persimmon ps|loader`` command on ports 0 (at ``nice``, see :func:`renice`);
    wait for its ready file and its ``/readyz``; return the process and its (gRPC, admin)
    ports."""
    if os.path.exists(ready_file):
        os.remove(ready_file)
    what = command[2] if len(command) > 2 else command[0]  # the module: services.ps
    proc = subprocess.Popen([*command, "--grpc-port", "0", "--admin-port", "0",
                             "--ready-file", ready_file], stdout=subprocess.DEVNULL)
    renice(proc, nice)
    deadline = time.monotonic() + timeout
    try:
        while not os.path.exists(ready_file):
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode} "
                                   "before serving")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start within "
                                   f"{timeout:.0f} s")
            time.sleep(0.05)
        with open(ready_file) as f:
            ports = json.load(f)
        wait_ready(proc, f"http://127.0.0.1:{ports['admin_port']}",
                   max(deadline - time.monotonic(), 5.0))
    except BaseException:
        stop_processes([proc])
        raise
    return proc, int(ports["grpc_port"]), int(ports["admin_port"])


def renice(proc: subprocess.Popen[bytes], nice: int) -> None:
    """Lower ``proc``'s scheduling priority by ``nice`` (0: leave it): background services
    beside a trainer then take the cores its compute does not use (no-op where the OS has no
    ``setpriority``)."""
    if nice and hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, proc.pid,
                       min(os.getpriority(os.PRIO_PROCESS, proc.pid) + nice, 19))


class LocalPS:
    """``num_shards`` PS processes on loopback ports; a context manager that stops them.

    ``registry``: the shards register there. ``supervise=True``: a shard that dies is started
    again on the same ports from the newest complete job checkpoint in ``checkpoint_dir``
    (``--restore job``; with ``wal_dir``, from its write-ahead log there instead, back to
    its state at the crash); ``supervisor.restarts`` records each restart. ``nice``: the shards
    run at that lower priority (beside a trainer whose compute should keep its core).
    """

    def __init__(self, num_shards: int, tables: list[dict[str, Any]],
                 checkpoint_dir: str | None = None, *, registry: str | None = None,
                 supervise: bool = False, nice: int = 0, wal_dir: str | None = None) -> None:
        if supervise and not checkpoint_dir:
            raise ValueError("supervise=True needs a checkpoint_dir to restart from")
        self.num_shards = num_shards
        self.tables = tables
        self.checkpoint_dir = checkpoint_dir
        self.registry = registry
        self.procs: list[subprocess.Popen[bytes]] = []
        self.commands: list[list[str]] = []  # with the ports each shard got (for restarts)
        self.addresses: list[str] = []
        self.admin_urls: list[str] = []
        self.supervisor: Supervisor | None = None
        self._supervise = supervise
        self._nice = nice
        self._wal = ["--wal-dir", wal_dir] if wal_dir else []
        self._tmp = tempfile.TemporaryDirectory(prefix="persimmon-ps-")

    def __enter__(self) -> LocalPS:
        import yaml

        config = os.path.join(self._tmp.name, "ps.yaml")
        with open(config, "w") as f:
            yaml.safe_dump({"tables": self.tables}, f)
        try:
            for k in range(self.num_shards):
                cmd = [*_PS, "--config", config, "--shard-id", str(k),
                       "--num-shards", str(self.num_shards)]
                if self.checkpoint_dir:
                    cmd += ["--checkpoint-dir", self.checkpoint_dir]
                if self.registry:
                    cmd += ["--registry", self.registry]
                cmd += self._wal
                proc, grpc_port, admin_port = start_service(
                    cmd, os.path.join(self._tmp.name, f"shard-{k}.ready"), nice=self._nice)
                self.procs.append(proc)
                self.commands.append([*cmd, "--grpc-port", str(grpc_port),
                                      "--admin-port", str(admin_port)])
                self.addresses.append(f"127.0.0.1:{grpc_port}")
                self.admin_urls.append(f"http://127.0.0.1:{admin_port}")
        except BaseException:
            self.__exit__()
            raise
        if self._supervise:
            self.supervisor = Supervisor(self.procs, self._restart).start()
        return self

    def _restart(self, k: int) -> subprocess.Popen[bytes]:
        restore = [] if self._wal else ["--restore", "job"]
        proc = subprocess.Popen([*self.commands[k], *restore], stdout=subprocess.DEVNULL)
        renice(proc, self._nice)
        wait_ready(proc, self.admin_urls[k])
        return proc

    def __exit__(self, *exc: object) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        stop_processes(self.procs)
        self._tmp.cleanup()


class LocalLoader:
    """A ``persimmon loader`` process reading ``source`` (a loader spec such as
    ``synthetic:100000`` or ``criteo:data/*.gz``) for ``world_size`` worker ranks.

    ``settings`` are further loader flags by field name (``shuffle_buffer=4096``)."""

    def __init__(self, source: str, *, batch_size: int, world_size: int, seed: int = 0,
                 epochs: int = 1, **settings: Any) -> None:
        flags = {"source": source, "batch_size": batch_size, "world_size": world_size,
                 "seed": seed, "epochs": epochs, **settings}
        self.command = list(_LOADER)
        for name, value in flags.items():
            self.command += [f"--{name.replace('_', '-')}", str(value)]
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = self.admin_url = ""
        self._tmp = tempfile.TemporaryDirectory(prefix="persimmon-loader-")

    def __enter__(self) -> LocalLoader:
        self.proc, grpc_port, admin_port = start_service(
            self.command, os.path.join(self._tmp.name, "loader.ready"))
        self.address = f"127.0.0.1:{grpc_port}"
        self.admin_url = f"http://127.0.0.1:{admin_port}"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_processes([self.proc])
        self._tmp.cleanup()
