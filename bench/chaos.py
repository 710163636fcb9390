"""``python -m bench chaos``: every record's gradient applied exactly once under SIGKILLs.

A job reads a Kafka topic of ``--records`` records (librdkafka's mock cluster, held by this
process) through a loader process under ``--checkpoint-dir`` into 2 worker processes, which
push counting gradients to 2 PS shard processes: one table, SGD with lr = 1 on zero rows, a
gradient of -1 per id occurrence, so each row equals the occurrences the PS applied. Each
record carries a feature unique to it (its row counts how many times the record's gradient
was applied) and two drawn from small vocabularies. The workers run no dense model: what is
measured is the data path (loader, pushes, cuts), not model quality. Every ``--cut-every``
steps the workers cut the job (:class:`~services.worker.job_checkpoints.ConsistentCut`).

A seeded schedule of ``--kills`` SIGKILLs cycles over four roles: a PS shard, the loader, a
worker, and a PS shard while a cut is in progress (after the workers' barrier, before the
manifest); each lands after 0 to 2 complete cuts of the current run and a random gap. After each kill the job restarts from its newest complete cut, as an
orchestrator would: the other workers and the loader are stopped, the killed shard restarts
with ``--restore job``, the living shards restore the cut over their admin API, then the
loader (at the cut's positions) and the workers (at the cut's step) start again.

Figures, from the final cut's PS files against the records produced (not the job's logs):
``records_lost`` (records whose row is 0), ``applied_twice`` (applications beyond the first,
summed over records), ``occurrences_off`` (every id: |row - occurrences|), ``finished`` (the
final cut is at the last step and its positions are the topic's end offsets),
``recovery_s`` per role (kill to both workers' first step after the restart).

``--wal``: the shards keep a write-ahead log (``--wal-fsync``, batch by default), and a PS
shard killed in role ``ps`` is no longer a job restart: right after a push of the bench's
own (64 probe ids) to it is acknowledged, the shard is SIGKILLed and started again from its
log (no ``--restore``) on the same ports, while the loader and the workers go on (their
pushes and the cuts' checkpoint calls wait for it, ``retry_s``). ``acked_lost_with_wal``
counts the probe's updates missing right after the restart; the next kill waits for a cut
after the restart, so an acked push the log lost also shows in the counts (a rollback to an
older cut would re-push it). ``recovery_s`` of ``ps`` is then kill to serving again. The
other roles recover by the rollback above. Without ``--wal``, ``acked_lost_with_wal`` is null.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bench import write_json
from services.common.commands import float_at_least, int_at_least

__all__ = ["counting_worker", "expected_counts", "produce_records", "register_bench", "run",
           "source_records"]

console = Console(stderr=True)
TABLE = "count"
PROBE = "probe"  # the bench's own pushes, acked right before a shard is killed (--wal)
RETRY_S = 300.0  # with --wal, how long pushes and cuts wait for a shard restarting
WORLD = 2
SHARDS = 2
ROLES = ("ps", "loader", "worker", "ps-cut")
_SERVICE = [sys.executable, "-m"]


# ---- a worker process: python -m bench.chaos --rank R ... -----------------------------------

async def counting_worker(*, root: str, run: str, rank: int, ps: list[str], ps_admin: list[str],
                          loader: str, loader_admin: str | None, steps: int, cut_every: int,
                          window: int = 4, step_ms: int = 0, started: str | None = None,
                          leave_after: int | None = None, retry_s: float = 0.0) -> int:
    """Rank ``rank`` of the job from the newest complete cut under ``root``: push counting
    gradients of every batch (``window`` pushes in flight), cut every ``cut_every`` steps and
    at ``steps``; ``leave_after``: stop after that step with no cut, as a crash would;
    ``retry_s``: pushes and the cut's checkpoint calls wait that long for a shard that is
    down (one restarting from its write-ahead log). Returns the step reached."""
    from clients.loader_client import LoaderClient
    from clients.ps_client import PSClient
    from services.common.checkpoints import latest_complete
    from services.common.checkpoints.positions import cut_positions
    from services.worker.job_checkpoints import ConsistentCut, JobCheckpointer

    manifest = latest_complete(root)
    step = int(manifest["step"]) if manifest else 0
    checkpointer = JobCheckpointer(root, admin_urls=ps_admin,
                                   retry_s=retry_s) if rank == 0 else None
    cut = ConsistentCut(root, rank=rank, world=WORLD, run=run, checkpointer=checkpointer,
                        positions=cut_positions(root), loader_admin_url=loader_admin)
    pushes: set[asyncio.Task[None]] = set()
    async with PSClient(ps, retry_s=retry_s) as client, LoaderClient(
            loader, rank=rank, world_size=WORLD, credits=window + 2) as batches:

        async def push(batch: Any) -> None:
            ids = np.concatenate([f.values for f in batch.sparse.values()])
            await client.push(TABLE, ids, np.full((ids.size, 1), -1.0, np.float32))
            await batches.ack(batch)

        async def drain() -> None:
            await asyncio.gather(*pushes)
            pushes.clear()

        stream = batches.batches()
        while step < steps:
            batch = await anext(stream)
            while len(pushes) >= window:
                done, _ = await asyncio.wait(pushes, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
                pushes.difference_update(done)
            pushes.add(asyncio.create_task(push(batch)))
            cut.trained(batch.positions)
            step += 1
            if step_ms:
                await asyncio.sleep(step_ms / 1000)
            if started is not None and not os.path.exists(started):
                Path(started).touch()
            if step == leave_after:
                await drain()
                break
            if step % cut_every == 0 or step == steps:
                await cut.cut(step, drain=drain, dense=json.dumps({"step": step}).encode())
    return step


def _worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos")
    for name in ("--root", "--run", "--ps", "--ps-admin", "--loader", "--loader-admin",
                 "--started"):
        parser.add_argument(name, required=True)
    for name in ("--rank", "--steps", "--cut-every", "--window", "--step-ms"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--retry-s", type=float, default=0.0)
    a = parser.parse_args(argv)
    asyncio.run(counting_worker(
        root=a.root, run=a.run, rank=a.rank, ps=a.ps.split(","), ps_admin=a.ps_admin.split(","),
        loader=a.loader, loader_admin=a.loader_admin, steps=a.steps, cut_every=a.cut_every,
        window=a.window, step_ms=a.step_ms, started=a.started, retry_s=a.retry_s))
    return 0


# ---- the source: records produced to the mock cluster, and their expected counts -------------

def source_records(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    a = rng.zipf(1.3, n) % 500
    b = rng.integers(0, 50, n)
    return [f"{i % 2}\t{i % 7}\tr{i:x}\ta{x}\tb{y}".encode()
            for i, (x, y) in enumerate(zip(a.tolist(), b.tolist(), strict=True))]


def expected_counts(spec: str, records: list[bytes]) -> tuple[np.ndarray, dict[int, int]]:
    """(each record's unique id, occurrences of every id), parsed as the loader parses."""
    from services.loader.config import LoaderConfig, SourceSpec
    from services.loader.sources.messages import MessageParser

    parser = MessageParser(SourceSpec.parse(spec), LoaderConfig(source=spec).dense_transform())
    parsed = parser.parse([*records])
    if parsed.bad:
        raise RuntimeError(f"{len(parsed.bad)} produced records do not parse")
    ids = np.concatenate([f.values for f in parsed.sparse.values()])
    uniq, counts = np.unique(ids, return_counts=True)
    return parsed.sparse["C1"].values, dict(zip(uniq.tolist(), counts.tolist(), strict=True))


def produce_records(bootstrap: str, topic: str, records: list[bytes], partitions: int) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i, record in enumerate(records):
        while True:
            try:
                producer.produce(topic, record, partition=i % partitions)
                break
            except BufferError:
                producer.poll(0.05)
    if producer.flush(30):
        raise RuntimeError("records were not all delivered to the mock cluster")


# ---- the job under fire ---------------------------------------------------------------------

class _Job:
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
        self.loop = asyncio.new_event_loop()  # the probes' (--wal): gRPC keeps to one loop

    def start_ps(self) -> None:
        """The shard processes, started side by side (one failing stops them all)."""
        import yaml

        from services.local.processes import start_services

        config = self.work / "ps.yaml"
        config.write_text(yaml.safe_dump({"tables": [
            {"name": name, "dim": 1, "initializer": "zeros",
             "optimizer": {"kind": "sgd", "lr": 1.0}} for name in (TABLE, PROBE)]}))
        wal = ["--wal-dir", str(self.work / "wal"), "--wal-fsync", self.args.wal_fsync]
        commands = [[*_SERVICE, "services.ps", "--log-level", "ERROR", "--config", str(config),
                     "--shard-id", str(k), "--num-shards", str(SHARDS),
                     "--checkpoint-dir", str(self.root), *(wal if self.args.wal else [])]
                    for k in range(SHARDS)]
        started = start_services([(cmd, str(self.work / f"ps-{k}.ready"))
                                  for k, cmd in enumerate(commands)], timeout=300)
        for cmd, (proc, grpc_port, admin_port) in zip(commands, started, strict=True):
            self.ps.append(proc)
            self.ps_commands.append([*cmd, "--grpc-port", str(grpc_port),
                                     "--admin-port", str(admin_port)])
            self.ps_addresses.append(f"127.0.0.1:{grpc_port}")
            self.ps_admin.append(f"http://127.0.0.1:{admin_port}")

    def first_cut(self) -> None:
        """The job's start as a cut (empty rows, no positions): every restart has a cut."""
        from services.common.checkpoints.positions import POSITIONS_PART, encode_positions
        from services.worker.job_checkpoints import JobCheckpointer

        asyncio.run(JobCheckpointer(self.root, admin_urls=self.ps_admin).checkpoint(
            0, "cut-start", parts={POSITIONS_PART: encode_positions({})}))

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
        self.workers = [subprocess.Popen(
            [*_SERVICE, "bench.chaos", "--root", str(self.root), "--run", str(self.run),
             "--ps", ",".join(self.ps_addresses), "--ps-admin", ",".join(self.ps_admin),
             "--loader", self.loader_address, "--loader-admin", self.loader_admin,
             "--started", str(self.started_file(r)), "--rank", str(r),
             "--steps", str(self.steps), "--cut-every", str(a.cut_every),
             "--window", str(a.window), "--step-ms", str(a.step_ms),
             "--retry-s", str(RETRY_S if a.wal else 0.0)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(WORLD)]

    @property
    def steps(self) -> int:
        return self.args.records // (self.args.batch_size * WORLD)

    def started_file(self, rank: int) -> Path:
        return self.work / f"run-{self.run}-rank-{rank}.started"

    def started(self) -> bool:
        return all(self.started_file(r).exists() for r in range(WORLD))

    def finished(self) -> bool:
        return all(w.poll() == 0 for w in self.workers)

    def failed(self) -> bool:
        """A process died that was not killed on purpose (a worker's error, a crash)."""
        return any(p.poll() not in (None, 0) for p in self.workers) or any(
            p.poll() is not None for p in [*self.ps, self.loader] if p is not None)

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

    def restart(self) -> None:
        """Stop the loader and the workers, bring every PS shard to the newest complete cut,
        start the loader and the workers of the next run."""
        from clients.admin_client import AdminClient
        from services.common.checkpoints import latest_complete
        from services.local.processes import wait_ready

        for proc in [*self.workers, self.loader]:
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait()
        cut = latest_complete(self.root)
        assert cut is not None
        for k, proc in enumerate(self.ps):
            if proc.poll() is None:
                async def restore(url: str) -> None:
                    async with AdminClient(url) as admin:
                        await admin.restore(cut["checkpoint_id"])
                asyncio.run(restore(self.ps_admin[k]))
            else:
                self.ps[k] = subprocess.Popen([*self.ps_commands[k], "--restore", "job"],
                                              stdout=subprocess.DEVNULL)
                wait_ready(self.ps[k], self.ps_admin[k], timeout=300)
        self.run += 1
        self.start_rest()

    def stop(self) -> None:
        for proc in [*self.workers, self.loader, *self.ps]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        self.loop.close()


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.002)


def _kill(job: _Job, role: str, rng: random.Random, max_gap: float) -> bool:
    """SIGKILL one process of ``role`` at a random point (:func:`_kill_point`); False when the
    job finished first."""
    if not _kill_point(job, role, rng, max_gap):
        return False
    job.pid_of(role, rng).send_signal(signal.SIGKILL)
    return True


def _kill_point(job: _Job, role: str, rng: random.Random, max_gap: float) -> bool:
    """Wait for a random point to kill ``role`` at (after 0 to 2 cuts of this run and a
    random gap; ``ps-cut``: then a cut in progress); False when the job finished first."""
    cuts = rng.randint(0, 2)
    _wait(lambda: job.cuts_done() >= cuts or job.finished() or job.failed(), 300,
          f"{cuts} cuts of run {job.run}")
    if job.finished():
        return False
    time.sleep(rng.uniform(0.0, max_gap))
    if role == "ps-cut":
        _wait(lambda: job.cut_in_progress() or job.finished() or job.failed(), 120,
              "a cut in progress")
    return not job.finished()


def _kill_with_wal(job: _Job, rng: random.Random, max_gap: float, n: int
                   ) -> tuple[int, float] | None:
    """SIGKILL a PS shard at a random point, right after the bench's own probe push to it
    (64 ids, -1 each) was acknowledged, and restart it from its write-ahead log (no
    ``--restore``; the job goes on, its pushes and cuts wait for the shard). Returns the
    probe's updates the restarted shard lacks and the seconds from the kill to serving
    again, once the job completed a cut after the kill (so that a later rollback cannot
    re-push what the kill lost: the counting check sees it too); None when the job finished
    first."""
    from clients.ps_client import PSClient
    from services.common.sharding import shard_of
    from services.local.processes import wait_ready

    if not _kill_point(job, "ps", rng, max_gap):
        return None
    k = rng.randrange(SHARDS)
    ids = np.arange(n * 4096, (n + 1) * 4096, dtype=np.uint64)
    ids = ids[shard_of(ids, SHARDS) == k][:64]

    async def probe(push: bool) -> np.ndarray:
        async with PSClient(job.ps_addresses, retry_s=RETRY_S) as client:
            if push:
                await client.push(PROBE, ids, np.full((ids.size, 1), -1.0, np.float32))
            return await client.lookup(PROBE, ids)

    job.loop.run_until_complete(probe(push=True))
    cuts = job.cuts_done()
    job.ps[k].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    job.ps[k].wait()
    job.ps[k] = subprocess.Popen(job.ps_commands[k], stdout=subprocess.DEVNULL)
    wait_ready(job.ps[k], job.ps_admin[k], timeout=300)
    recovered = time.monotonic() - killed_at
    lost = int((job.loop.run_until_complete(probe(push=False))[:, 0] < 1).sum())
    _wait(lambda: job.cuts_done() > cuts or job.finished() or job.failed(), 300,
          "a cut after the shard's restart")
    return lost, recovered


def _check(job: _Job, record_ids: np.ndarray, expected: dict[int, int]) -> dict[str, Any]:
    """Rows of the final cut's PS parts against the occurrences counted from the source."""
    from services.common.checkpoints import latest_complete
    from services.common.checkpoints.positions import cut_positions
    from services.ps.checkpoint import read_checkpoint

    cut = latest_complete(job.root)
    assert cut is not None
    got: dict[int, int] = {}
    for k in range(SHARDS):
        (snap,) = read_checkpoint(job.root, cut["checkpoint_id"], shard_id=k,
                                  num_shards=SHARDS)[TABLE]
        got.update(zip(snap.ids.tolist(), snap.rows[:, 0].astype(np.int64).tolist(),
                       strict=True))
    applied = np.array([got.get(i, 0) for i in record_ids.tolist()], dtype=np.int64)
    off = sum(abs(got.get(i, 0) - n) for i, n in expected.items())
    off += sum(abs(v) for i, v in got.items() if i not in expected)
    positions = cut_positions(job.root, cut["checkpoint_id"])
    n, parts = job.args.records, job.args.partitions  # record i went to partition i % parts
    topic_end = all(positions.get(f"kafka:{job.args.topic}:{p}", 0) == n // parts + (p < n % parts)
                    for p in range(parts))
    return {"records_lost": int((applied == 0).sum()),
            "applied_twice": int(np.maximum(applied - 1, 0).sum()),
            "occurrences_off": int(off),
            "finished": bool(job.finished() and cut["step"] == job.steps and topic_end),
            "final_step": int(cut["step"])}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from confluent_kafka.admin import AdminClient as KafkaAdmin

    if args.records % (args.batch_size * WORLD):
        raise ValueError("--records must be a multiple of 2 x --batch-size (whole steps)")
    rng = random.Random(args.seed)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    kafka = KafkaAdmin({"test.mock.num.brokers": 1, "log_level": 3})
    broker = next(iter(kafka.list_topics(timeout=10).brokers.values()))
    bootstrap = f"{broker.host}:{broker.port}"
    args.topic = f"chaos-{args.seed}"
    args.partitions = len(kafka.list_topics(topic=args.topic, timeout=10)
                          .topics[args.topic].partitions)
    source = f"kafka://{bootstrap}/{args.topic}?group=chaos&dense=1&sparse=3"
    records = source_records(args.records, args.seed)
    record_ids, expected = expected_counts(source, records)
    produce_records(bootstrap, args.topic, records, args.partitions)
    schedule = [ROLES[i % len(ROLES)] for i in range(args.kills)]
    rng.shuffle(schedule)
    recovery: dict[str, list[float]] = {role: [] for role in ROLES}
    kills: dict[str, int] = dict.fromkeys(ROLES, 0)
    unplanned = 0
    acked_lost = 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="persimmon-chaos-") as work:
        job = _Job(args, Path(work), source)
        try:
            job.root.mkdir()
            job.start_ps()
            job.first_cut()
            job.start_rest()
            for n, role in enumerate(schedule):
                if args.wal and role == "ps":
                    got = _kill_with_wal(job, rng, args.max_gap, n)
                    if got is None:
                        break
                    acked_lost += got[0]
                    kills[role] += 1
                    recovery[role].append(got[1])
                    continue
                if not _kill(job, role, rng, args.max_gap):
                    break
                killed_at = time.monotonic()
                kills[role] += 1
                job.restart()
                _wait(lambda: job.started() or job.finished() or job.failed(), 120,
                      "the restarted workers' first step")
                recovery[role].append(time.monotonic() - killed_at)
            deadline = time.monotonic() + args.timeout
            while not job.finished():
                if job.failed():  # not killed on purpose: restart all the same, and say so
                    unplanned += 1
                    job.restart()
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            result = _check(job, record_ids, expected)
        finally:
            job.stop()
    return {"kills": sum(kills.values()), "kills_by_role": kills,
            **result, "acked_lost_with_wal": acked_lost if args.wal else None,
            "wal": args.wal_fsync if args.wal else None, "unplanned_restarts": unplanned,
            "recovery_s": {role: {"median": statistics.median(v), "max": max(v)}
                           for role, v in recovery.items() if v},
            "records": args.records, "steps": job.steps, "cut_every": args.cut_every,
            "seed": args.seed, "seconds": time.perf_counter() - started}


def _print(result: dict[str, Any]) -> None:
    table = Table(title=f"chaos: {result['kills']} SIGKILLs, seed {result['seed']}, "
                        f"{result['records']} Kafka records")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("goal", justify="right")
    for key, goal in (("kills", "all planned"), ("records_lost", "0"), ("applied_twice", "0"),
                      ("occurrences_off", "0"), ("finished", "True"),
                      ("acked_lost_with_wal", "0 (with --wal)"), ("unplanned_restarts", "0")):
        table.add_row(key, str(result[key]), goal)
    for role, r in result["recovery_s"].items():
        table.add_row(f"recovery {role} (median / max)",
                      f"{r['median']:.2f} / {r['max']:.2f} s", "")
    table.add_row("wall time", f"{result['seconds']:.1f} s", "")
    console.print(table)


def _main(args: argparse.Namespace) -> int:
    result = run(args)
    _print(result)
    write_json(result, args.json)
    ok = result["finished"] and result["kills"] == args.kills and not (
        result["records_lost"] or result["applied_twice"] or result["occurrences_off"]
        or result["acked_lost_with_wal"])
    return 0 if ok else 1


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("chaos", help="SIGKILL every role; count each record once")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--seed", type=int, default=0, help="seeds the records and the kills")
    parser.add_argument("--kills", type=int_at_least(0), default=20, help="SIGKILLs over the roles")
    parser.add_argument("--records", type=int_at_least(1), default=80000,
                        help="Kafka records: enough that the job outlasts the kills (the "
                             "bench fails when it ends first)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=100)
    parser.add_argument("--cut-every", type=int_at_least(1), default=10, help="steps between cuts")
    parser.add_argument("--window", type=int_at_least(0), default=4,
                        help="pushes in flight per worker")
    parser.add_argument("--step-ms", type=int, default=5,
                        help="pause per worker step, so that kills land throughout the job")
    parser.add_argument("--max-gap", type=float_at_least(0), default=0.5,
                        help="most seconds from a restart's first step to the next kill")
    parser.add_argument("--wal", action="store_true",
                        help="PS shards keep a write-ahead log; a killed shard (role ps) "
                             "restarts from it and the job goes on, no rollback")
    parser.add_argument("--wal-fsync", default="batch", choices=["always", "batch", "never"],
                        help="the shards' WAL fsync policy (with --wal)")
    parser.add_argument("--timeout", type=float_at_least(0, inclusive=False), default=300.0,
                        help="seconds the job may take after the last kill")
    parser.set_defaults(func=_main)


if __name__ == "__main__":
    raise SystemExit(_worker_main(sys.argv[1:]))
