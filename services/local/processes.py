"""Service processes on this machine's loopback ports, for the demo, ``train``, benchmarks
and tests: :class:`LocalPS` (PS shard processes, optionally supervised) and
:class:`LocalLoader` (one ``persimmon loader`` process).

Each process binds port 0 and writes the ports it got to a ready file
(:func:`start_service`), so that concurrent launchers never race for a port one of them picked.
A process's stderr is held back until it serves (then passed on): one that fails to start is
reported by its own last error line, once, as an :class:`~services.common.errors.Unavailable`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import IO, Any

from services.common.commands import debug_enabled
from services.common.errors import Unavailable
from services.local.supervise import Supervisor

__all__ = ["LocalLoader", "LocalPS", "StderrTail", "start_service",
           "start_services", "stop_processes", "stopping_children_on_sigterm", "wait_ready"]

# Each service runs as its own module (``python -m services.ps``): it starts without importing
# the CLI, torch or the benchmarks, which is what a supervisor's restart waits for.
_PS = [sys.executable, "-m", "services.ps", "--log-level", "WARNING"]
_LOADER = [sys.executable, "-m", "services.loader", "--log-level", "WARNING", "loader"]


class StderrTail:
    """A child's stderr read by a thread: its last lines are held back until :meth:`pass_on`
    (the child serves), then every line goes to this process's stderr as it comes."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self._held: collections.deque[str] = collections.deque(maxlen=200)
        self._passing = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True,
                                        name="stderr-tail")
        self._thread.start()

    def _read(self, pipe: IO[bytes]) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", "replace")
                with self._lock:
                    if self._passing:
                        sys.stderr.write(line)
                    else:
                        self._held.append(line)

    def pass_on(self) -> None:
        """Write the held lines and pass on every later one."""
        with self._lock:
            sys.stderr.writelines(self._held)
            self._held.clear()
            self._passing = True

    def last_error(self, timeout: float = 5.0) -> str:
        """The child's last non-blank line (after it exited), without its ``PROG: error:``
        prefix; with debugging on, every held line is written to stderr too."""
        self._thread.join(timeout)
        with self._lock:
            lines = [line.rstrip() for line in self._held if line.strip()]
            if debug_enabled():
                sys.stderr.writelines(self._held)
        return re.sub(r"^\S.*?: error: ", "", lines[-1]) if lines else "no error message"


def _failed(what: str, proc: subprocess.Popen[bytes], tail: StderrTail | None) -> Unavailable:
    cause = f": {tail.last_error()}" if tail is not None else ""
    return Unavailable(f"{what} exited with {proc.returncode} before serving{cause}")


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float = 60.0, *,
               what: str = "", tail: StderrTail | None = None) -> None:
    """Poll ``url/readyz`` until it answers 200; :class:`Unavailable` if ``proc`` exits
    (with its last error line when its ``tail`` is given) or time runs out."""
    what = what or f"the process serving {url}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None:
            raise _failed(what, proc, tail)
        if time.monotonic() > deadline:
            raise Unavailable(f"{what} did not become ready within {timeout:.0f} s")
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


@contextlib.contextmanager
def stopping_children_on_sigterm() -> Iterator[None]:
    """A SIGTERM to this command ends it as Ctrl-C does (KeyboardInterrupt), so the
    with-blocks that own its child processes stop them on the way out (Python's default
    ends at once and leaves them running). The previous handler comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def start_service(command: list[str], ready_file: str, timeout: float = 60.0, *,
                  nice: int = 0) -> tuple[subprocess.Popen[bytes], int, int]:
    """Start a ``persimmon ps|loader`` command on ports 0 (at ``nice``, see :func:`renice`);
    wait for its ready file and its ``/readyz``; return the process and its (gRPC, admin)
    ports. A process that exits first is an :class:`Unavailable` naming its last error
    line."""
    return start_services([(command, ready_file)], timeout, nice=nice)[0]


def start_services(commands: Sequence[tuple[list[str], str]], timeout: float = 60.0, *,
                   nice: int = 0) -> list[tuple[subprocess.Popen[bytes], int, int]]:
    """:func:`start_service` of several ``(command, ready_file)`` at once: all start
    together, then each is waited for; if one fails, all are stopped."""
    started: list[_Starting] = []
    try:
        for command, ready_file in commands:
            started.append(_Starting(command, ready_file, nice))
        deadline = time.monotonic() + timeout
        ports = [s.wait(deadline, timeout) for s in started]
    except BaseException:
        stop_processes([s.proc for s in started])
        raise
    for s in started:
        s.tail.pass_on()
    return [(s.proc, grpc, admin) for s, (grpc, admin) in zip(started, ports, strict=True)]


class _Starting:
    """A service process started on ports 0, its stderr held until it serves."""

    def __init__(self, command: list[str], ready_file: str, nice: int) -> None:
        if os.path.exists(ready_file):
            os.remove(ready_file)
        self.ready_file = ready_file
        self.what = command[2].rpartition(".")[2] if len(command) > 2 else command[0]  # ps
        self.proc = subprocess.Popen([*command, "--grpc-port", "0", "--admin-port", "0",
                                      "--ready-file", ready_file], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        assert self.proc.stderr is not None  # Popen with stderr=PIPE
        self.tail = StderrTail(self.proc.stderr)
        renice(self.proc, nice)

    def wait(self, deadline: float, timeout: float) -> tuple[int, int]:
        """Its (gRPC, admin) ports once its ready file is written and ``/readyz`` answers."""
        while not os.path.exists(self.ready_file):
            if self.proc.poll() is not None:
                raise _failed(self.what, self.proc, self.tail)
            if time.monotonic() > deadline:
                raise Unavailable(f"{self.what} did not start within {timeout:.0f} s")
            time.sleep(0.05)
        with open(self.ready_file) as f:
            ports = json.load(f)
        wait_ready(self.proc, f"http://127.0.0.1:{ports['admin_port']}",
                   max(deadline - time.monotonic(), 5.0), what=self.what, tail=self.tail)
        return int(ports["grpc_port"]), int(ports["admin_port"])


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
        commands = []
        for k in range(self.num_shards):
            cmd = [*_PS, "--config", config, "--shard-id", str(k),
                   "--num-shards", str(self.num_shards)]
            if self.checkpoint_dir:
                cmd += ["--checkpoint-dir", self.checkpoint_dir]
            if self.registry:
                cmd += ["--registry", self.registry]
            cmd += self._wal
            commands.append((cmd, os.path.join(self._tmp.name, f"shard-{k}.ready")))
        try:
            started = start_services(commands, nice=self._nice)
        except BaseException:
            self._tmp.cleanup()
            raise
        for (cmd, _), (proc, grpc_port, admin_port) in zip(commands, started, strict=True):
            self.procs.append(proc)
            self.commands.append([*cmd, "--grpc-port", str(grpc_port),
                                  "--admin-port", str(admin_port)])
            self.addresses.append(f"127.0.0.1:{grpc_port}")
            self.admin_urls.append(f"http://127.0.0.1:{admin_port}")
        if self._supervise:
            self.supervisor = Supervisor(self.procs, self._restart).start()
        return self

    def create_tables(self, tables: Sequence[dict[str, Any]]) -> None:
        """Create ``tables`` on every shard through its admin API (once started, from outside
        an event loop). A shard loads at its start the kernels of one request of all its
        tables of a dim, and numba compiles each request size anew: start the shards with the
        tables one request names and create the others with this, or where numba's cache is
        cold (a fresh checkout, CI) each shard compiles a request nobody sends, for tens of
        seconds."""
        from clients.admin_client import AdminClient

        async def create() -> None:
            for url in self.admin_urls:
                async with AdminClient(url) as admin:
                    for table in tables:
                        await admin.create_table(table)

        asyncio.run(create())

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
