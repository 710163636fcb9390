"""The job ``python -m bench chaos`` puts under fire, and the real parts its faults use.

- :class:`ChaosJob`: the PS shard, loader and worker processes of the job, and its restart
  from the newest complete cut as an orchestrator would do it.
- :class:`WalMounts`: with ``--wal`` each shard's ``--wal-dir`` is a small tmpfs of its own
  (``mount -t tmpfs``: the bench must run as root; a refused mount is an error, never a
  skip), so that a filler file makes the next append fail part-way with a real ENOSPC.
- :class:`TcpProxy`: an in-process TCP proxy between one worker and one shard; ``hold()``
  stops forwarding (the connections stay open, what the worker sends waits in the proxy),
  ``reset()`` breaks the open connections (the worker's client retries on a new one, held
  too), ``heal()`` forwards again.
- :class:`ZombieCount`: pushes of a run applied by a shard after a restore that began a
  later run there, read off the shard's ``stamp`` rows (see :mod:`bench.chaos`).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["PROBE", "RETRY_S", "SHARDS", "STAMP", "TABLE", "WORLD", "ChaosJob", "TcpProxy",
           "WalMounts", "ZombieCount", "stamp_ids", "wait"]

TABLE = "count"  # the counting table: each row equals the occurrences the PS applied
WORLD = 2
PROBE = "probe"  # the bench's own pushes, acked right before a shard is killed
STAMP = "stamp"  # one row per (run, shard): every push of a run adds 1 to its shard's row
RETRY_S = 300.0  # how long the workers' pushes and cuts wait for a shard (--wal)
SHARDS = 2
WAL_TMPFS_MB = 32


_SERVICE = [sys.executable, "-m"]


def wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.002)


def stamp_ids(runs: int) -> np.ndarray:
    """``(runs, SHARDS)`` uint64 ids: row ``r`` holds run ``r``'s stamp id on each shard."""
    from services.common.sharding import shard_of

    out = np.empty((runs, SHARDS), dtype=np.uint64)
    for r in range(runs):
        candidates = np.arange(r * 256, (r + 1) * 256, dtype=np.uint64)
        owner = shard_of(candidates, SHARDS)
        out[r] = [candidates[owner == k][0] for k in range(SHARDS)]
    return out


# ---- real parts: tmpfs WAL directories, a TCP proxy -------------------------------------------

class WalMounts:
    """A tmpfs of ``WAL_TMPFS_MB`` MiB per shard under ``work`` (``wal-<k>``)."""

    def __init__(self, work: Path) -> None:
        self.dirs = [work / f"wal-{k}" for k in range(SHARDS)]
        self.mounted: list[Path] = []

    def mount(self) -> None:
        for d in self.dirs:
            d.mkdir()
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={WAL_TMPFS_MB}m",
                                   "tmpfs", str(d)], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(
                    f"bench chaos --wal mounts a tmpfs per shard for its WAL (to fail appends "
                    f"with a real ENOSPC), and mounting {d} was refused: "
                    f"{done.stderr.strip() or done.returncode} (run it as root, or where "
                    "tmpfs mounts are allowed)")
            self.mounted.append(d)

    def fill(self, k: int) -> Path:
        """Fill shard ``k``'s tmpfs with a filler file until ENOSPC: the shard's next append
        is cut short (the last page of its segment has room for part of a record)."""
        filler = self.dirs[k] / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for size in (1 << 20, 4096, 1):
                chunk = b"\xff" * size
                try:
                    while True:
                        os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
        finally:
            os.close(fd)
        return filler

    def unmount(self) -> list[str]:
        """Unmount every tmpfs (lazily when busy); the errors, if any."""
        errors = []
        for d in reversed(self.mounted):
            done = subprocess.run(["umount", str(d)], capture_output=True, text=True)
            if done.returncode:
                lazy = subprocess.run(["umount", "-l", str(d)], capture_output=True, text=True)
                if lazy.returncode:
                    errors.append(f"{d}: {done.stderr.strip()} / {lazy.stderr.strip()}")
        self.mounted.clear()
        return errors


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``target`` from a thread of its own (its event loop)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-proxy",
                                        daemon=True)
        self._thread.start()
        self._transports: set[asyncio.WriteTransport] = set()
        self.held_bytes = 0  # what the worker sent while held (its pushes, queued)
        self.port = self._call(self._start())
        self.address = f"127.0.0.1:{self.port}"

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    async def _start(self) -> int:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        pair = {writer.transport, up_writer.transport}
        self._transports |= pair
        try:
            await asyncio.gather(self._pump(reader, up_writer, count=True),
                                 self._pump(up_reader, writer, count=False))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for transport in pair:
                transport.abort()
            self._transports -= pair

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *,
                    count: bool) -> None:
        """Read ``src`` always, forward to ``dst`` only while flowing (held data queued)."""
        queue: asyncio.Queue[bytes] = asyncio.Queue()

        async def forward() -> None:
            while data := await queue.get():
                await self._flowing.wait()
                dst.write(data)
                await dst.drain()
            dst.transport.abort()  # one side closed: so is the other (as a broken link)

        task = asyncio.ensure_future(forward())
        try:
            while data := await src.read(1 << 16):
                if count and not self._flowing.is_set():
                    self.held_bytes += len(data)
                queue.put_nowait(data)
            queue.put_nowait(b"")
            await task
        finally:
            task.cancel()

    def hold(self) -> None:
        """Stop forwarding, both ways; connections stay open (new ones are held too)."""
        self._loop.call_soon_threadsafe(self._flowing.clear)

    def heal(self) -> None:
        """Forward again, what was held first."""
        self._loop.call_soon_threadsafe(self._flowing.set)

    def reset(self) -> None:
        """Break the connections open now (what they held is dropped)."""
        async def abort() -> None:
            for transport in list(self._transports):
                transport.abort()
        self._call(abort())

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for transport in list(self._transports):
                transport.abort()
            self._flowing.set()
            # the connections' tasks end here, not destroyed pending with the loop
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self._call(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()


# ---- zombie pushes, read off the stamp rows ------------------------------------------------------

class ZombieCount:
    """Per shard, a window opens when the shard is restored to a cut: from then on, pushes of
    runs below ``first_run`` (the run it was restored for) are zombies. Closing a window reads
    the shard's stamp rows of those runs (live) against the cut's: every unit above the cut's
    row is one push of an old run applied after the restore."""

    def __init__(self, job: ChaosJob) -> None:
        self.job = job
        self.windows: list[tuple[str, int]] = [("cut-start", 0)] * SHARDS
        self.applied = 0

    def open(self, k: int, cut_id: str, first_run: int) -> None:
        self.windows[k] = (cut_id, first_run)

    def close(self, k: int) -> None:
        from clients.ps_client import PSClient
        from services.ps.checkpoint import read_checkpoint

        cut_id, first_run = self.windows[k]
        if first_run == 0:
            return
        ids = stamp_ids(first_run)[:, k]
        (snap,) = read_checkpoint(self.job.root, cut_id, shard_id=k, num_shards=SHARDS)[STAMP]
        at_cut = dict(zip(snap.ids.tolist(), snap.rows[:, 0].tolist(), strict=True))

        async def live() -> np.ndarray:
            async with PSClient(self.job.ps_addresses, retry_s=RETRY_S) as client:
                return await client.lookup(STAMP, ids, read_only=True)

        now = self.job.loop.run_until_complete(live())[:, 0]
        base = np.array([at_cut.get(i, 0.0) for i in ids.tolist()])
        self.applied += int(np.rint(now - base).sum())



# ---- the job --------------------------------------------------------------------------------

class ChaosJob:
    """The processes of the job and the restart from its newest complete cut."""

    def __init__(self, args: argparse.Namespace, work: Path, source: str) -> None:
        self.args, self.work, self.source = args, work, source
        self.root = work / "checkpoints"
        self.ps: list[subprocess.Popen[bytes]] = []
        self.ps_commands: list[list[str]] = []
        self.ps_addresses: list[str] = []
        self.ps_admin: list[str] = []
        self.loader: subprocess.Popen[bytes] | None = None
        self.loader_address = self.loader_admin = ""
        self.workers: list[subprocess.Popen[bytes]] = []
        self.run = 0
        self.unplanned = 0  # restarts after a failure no fault caused
        self.unplanned_causes: list[str] = []  # what failed, each (exit code, last words)
        self.loop = asyncio.new_event_loop()  # the probes' (--wal): gRPC keeps to one loop
        self.mounts = WalMounts(work)  # --wal: a tmpfs per shard's log
        self.zombies = ZombieCount(self)
        self.proxy: TcpProxy | None = None  # --wal: this run's worker-to-shard proxy
        self.proxied = (0, 0)  # (rank, shard) it stands between

    def start_ps(self) -> None:
        """The shard processes, started side by side (one failing stops them all)."""
        import yaml

        from services.local.processes import start_services

        config = self.work / "ps.yaml"
        config.write_text(yaml.safe_dump({"tables": [
            {"name": name, "dim": 1, "initializer": "zeros",
             "optimizer": {"kind": "sgd", "lr": 1.0}} for name in (TABLE, PROBE, STAMP)]}))
        if self.args.wal:
            self.mounts.mount()

        def wal(k: int) -> list[str]:
            return ["--wal-dir", str(self.mounts.dirs[k]), "--wal-fsync",
                    self.args.wal_fsync] if self.args.wal else []
        commands = [[*_SERVICE, "services.ps", "--log-level", "ERROR", "--config",
                     str(config), "--shard-id", str(k), "--num-shards", str(SHARDS),
                     "--checkpoint-dir", str(self.root), *wal(k)] for k in range(SHARDS)]
        started = start_services([(cmd, str(self.work / f"ps-{k}.ready"))
                                  for k, cmd in enumerate(commands)], timeout=300)
        for cmd, (proc, grpc_port, admin_port) in zip(commands, started, strict=True):
            self.ps.append(proc)
            self.ps_commands.append([*cmd, "--grpc-port", str(grpc_port),
                                     "--admin-port", str(admin_port)])
            self.ps_addresses.append(f"127.0.0.1:{grpc_port}")
            self.ps_admin.append(f"http://127.0.0.1:{admin_port}")

    def first_cut(self) -> None:
        """The job's start as a cut (empty rows, every partition at 0): every restart has a
        cut, and every cut names every partition (none is read from the group's offsets,
        which the commits of cuts may have moved)."""
        from services.common.checkpoints.positions import POSITIONS_PART, encode_positions
        from services.worker.job_checkpoints import JobCheckpointer

        start = {f"kafka:{self.args.topic}:{p}": 0 for p in range(self.args.partitions)}
        asyncio.run(JobCheckpointer(self.root, admin_urls=self.ps_admin).checkpoint(
            0, "cut-start", parts={POSITIONS_PART: encode_positions(start)}))

    def start_rest(self) -> None:
        """The loader (at the newest cut) and the workers of a new run."""
        from services.local.processes import start_service

        a = self.args
        self.loader, grpc_port, admin_port = start_service(
            [*_SERVICE, "services.loader", "--log-level", "ERROR", "loader", "--source",
             self.source, "--batch-size", str(a.batch_size), "--world-size", str(WORLD),
             "--checkpoint-dir", str(self.root), "--poll-timeout-ms", "20"],
            str(self.work / "loader.ready"), timeout=300)
        self.loader_address = f"127.0.0.1:{grpc_port}"
        self.loader_admin = f"http://127.0.0.1:{admin_port}"
        ps = [list(self.ps_addresses) for _ in range(WORLD)]
        if a.wal:  # one worker reaches one shard through a proxy (partition_fault)
            rank, k = self.proxied = (self.run % WORLD, (self.run // WORLD) % SHARDS)
            self.proxy = TcpProxy(self.ps_addresses[k])
            ps[rank][k] = self.proxy.address
        self.workers = [self._start_worker(r, ps[r]) for r in range(WORLD)]

    def _start_worker(self, rank: int, ps: list[str]) -> subprocess.Popen[bytes]:
        """Rank ``rank`` of this run, its stderr kept in :meth:`log_file`."""
        a = self.args
        with open(self.log_file(self.run, rank), "wb") as log:
            return subprocess.Popen(
                [*_SERVICE, "bench.chaos_worker", "--root", str(self.root),
                 "--run", str(self.run), "--ps", ",".join(ps),
                 "--ps-admin", ",".join(self.ps_admin),
                 "--loader", self.loader_address, "--loader-admin", self.loader_admin,
                 "--started", str(self.started_file(rank)),
                 "--exit-file", str(self.exit_file(self.run, rank)), "--rank", str(rank),
                 "--steps", str(self.steps), "--cut-every", str(a.cut_every),
                 "--window", str(a.window), "--step-ms", str(a.step_ms),
                 "--retry-s", str(RETRY_S if a.wal else 0.0)],
                stdout=subprocess.DEVNULL, stderr=log)

    @property
    def steps(self) -> int:
        return self.args.records // (self.args.batch_size * WORLD)

    def started_file(self, rank: int) -> Path:
        return self.work / f"run-{self.run}-rank-{rank}.started"

    def exit_file(self, run: int, rank: int) -> Path:
        return self.work / f"run-{run}-rank-{rank}.exit"

    def log_file(self, run: int, rank: int) -> Path:
        return self.work / f"run-{run}-rank-{rank}.log"

    def started(self) -> bool:
        return all(self.started_file(r).exists() for r in range(WORLD))

    def finished(self) -> bool:
        return all(w.poll() == 0 for w in self.workers)

    def failed(self) -> bool:
        """A process died that was not killed on purpose (a worker's error, a crash)."""
        return any(p.poll() not in (None, 0) for p in self.workers) or any(
            p.poll() is not None for p in [*self.ps, self.loader] if p is not None)

    def restart_if_failed(self) -> bool:
        """Restart the job when a process died that no fault killed (a worker's error, a
        crash), counting it in ``unplanned``; True if it did."""
        if not self.failed():
            return False
        self.unplanned += 1
        self.unplanned_causes.append(self.failure())
        self.restart()
        return True

    def failure(self) -> str:
        """What died that no fault killed: each process, its exit code and, for a worker,
        how it ended (its exit file) and its log's last line (a living worker's too: what
        it was waiting for)."""
        died = []
        for rank, proc in enumerate(self.workers):
            lines = self.log_file(self.run, rank).read_text(errors="replace").splitlines()
            last = lines[-1] if lines else "no log"
            if proc.poll() is None:
                died.append(f"run {self.run} rank {rank} alive: {last}")
            elif proc.poll() != 0:
                ended = self.exit_file(self.run, rank)
                died.append(f"run {self.run} rank {rank} exited {proc.poll()} "
                            f"({ended.read_text() if ended.exists() else 'no exit file'}): "
                            f"{last}")
        for name, proc in [*((f"ps {k}", p) for k, p in enumerate(self.ps)),
                           ("loader", self.loader)]:
            if proc is not None and proc.poll() is not None:
                died.append(f"{name} exited {proc.poll()}")
        return "; ".join(died)

    def cuts_done(self) -> int:
        """Complete cuts of the current run."""
        return sum(1 for d in self.root.glob(f"cut-{self.run}-*") if (d / "job.json").exists())

    def cut_in_progress(self) -> bool:
        prefix = f"cut-{self.run}-"
        return any(d.name.startswith(prefix) and (d / "ranks").is_dir()
                   and not (d / "job.json").exists() for d in self.root.iterdir())

    def pid_of(self, role: str, rng: random.Random) -> subprocess.Popen[bytes]:
        if role == "loader":
            assert self.loader is not None
            return self.loader
        if role == "worker":
            return self.workers[rng.randrange(WORLD)]
        return self.ps[rng.randrange(SHARDS)]

    def restart(self, spare: subprocess.Popen[bytes] | None = None) -> None:
        """Stop the loader and the workers (but ``spare``, a partitioned one), bring every PS
        shard to the newest complete cut, start the loader and the workers of the next run.
        With ``--wal`` a dead shard first comes back from its log, so that the zombie count
        reads every shard's rows before the restore."""
        from clients.admin_client import AdminClient
        from services.common.checkpoints import latest_complete
        from services.local.processes import wait_ready

        for proc in [*self.workers, self.loader]:
            if proc is not None and proc is not spare and proc.poll() is None:
                proc.kill()
            if proc is not None and proc is not spare:
                proc.wait()
        if self.proxy is not None and spare is None:
            self.proxy.close()
        self.proxy = None
        cut = latest_complete(self.root)
        assert cut is not None
        at_cut = set()  # without --wal a dead shard restarts at the cut (--restore job)
        for k, proc in enumerate(self.ps):
            if proc.poll() is not None:
                self.ps[k] = subprocess.Popen(
                    [*self.ps_commands[k], *([] if self.args.wal else ["--restore", "job"])],
                    stdout=subprocess.DEVNULL)
                wait_ready(self.ps[k], self.ps_admin[k], timeout=300)
                if not self.args.wal:
                    at_cut.add(k)

        async def restore(url: str) -> None:
            async with AdminClient(url) as admin:
                await admin.restore(cut["checkpoint_id"])

        for k in range(SHARDS):
            if self.args.wal:
                self.zombies.close(k)
            if k not in at_cut:
                asyncio.run(restore(self.ps_admin[k]))
            self.zombies.open(k, cut["checkpoint_id"], self.run + 1)
        self.run += 1
        self.start_rest()

    def stop(self) -> None:
        for proc in [*self.workers, self.loader, *self.ps]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.proxy is not None:
            self.proxy.close()
        self.loop.close()


