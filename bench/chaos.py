"""``python -m bench chaos``: every record's gradient applied exactly once under SIGKILLs.

A job reads a Kafka topic of ``--records`` records (librdkafka's mock cluster, held by this
process) through a loader process under ``--checkpoint-dir`` into 2 worker processes
(:mod:`bench.chaos_worker`), which push counting gradients to 2 PS shard processes: one
table, SGD with lr = 1 on zero rows, a gradient of -1 per id occurrence, so each row equals
the occurrences the PS applied. Each record carries a feature unique to it (its row counts
how many times the record's gradient was applied) and two drawn from small vocabularies.
The workers run no dense model: what is measured is the data path (loader, pushes, cuts),
not model quality. Every ``--cut-every`` steps the workers cut the job
(:class:`~services.worker.job_checkpoints.ConsistentCut`).

A seeded schedule of ``--kills`` faults cycles over four roles (seven with ``--wal``,
below), SIGKILLs of: a PS shard, the loader, a worker, and a PS shard while a cut is in
progress (after the workers' barrier, before the manifest); each lands after 0 to 2 complete
cuts of the current run and a random gap. After each kill the job restarts from its newest
complete cut, as an orchestrator would: the other workers and the loader are stopped, the
killed shard restarts with ``--restore job`` (with ``--wal``: from its log, then restored
over REST), the living shards restore the cut over their admin API, then the loader (at the
cut's positions; the first cut names every partition at 0) and the workers (at the cut's
step) start again. A process that dies by no fault also restarts the job:
``unplanned_restarts``, each with its cause in ``unplanned_causes`` (the process, its exit
code; a worker's exit file and the last line of its stderr, kept in the work directory).

Figures, from the final cut's PS files against the records produced (not the job's logs):
``records_lost`` (records whose row is 0), ``applied_twice`` (applications beyond the first,
summed over records), ``occurrences_off`` (every id: |row - occurrences|), ``finished`` (the
final cut is at the last step and its positions are the topic's end offsets),
``recovery_s`` per role (kill to both workers' first step after the restart).

``--wal``: the shards keep a write-ahead log (``--wal-fsync``, batch by default), each on a
tmpfs of its own (32 MiB, mounted by the bench: it must run as root, and a refused mount is
an error; everything is unmounted at the end, also on failure or SIGTERM). Every push of a
worker then also adds 1 to its run's *stamp* row on every shard (table ``stamp``, one row per
(run, shard), in the same message, so in the same log record): a shard's stamp row of run r
counts the pushes of run r it applied. One worker of each run reaches one shard through an
in-process TCP proxy (:class:`~bench.chaos_job.TcpProxy`). Three more roles join the seeded
schedule, and ``ps`` changes (:mod:`bench.chaos_faults`):

- ``ps``: no longer a job restart: right after a push of the bench's own (64 probe ids) to
  the shard is acknowledged, it is SIGKILLed and started again from its log (no
  ``--restore``) on the same ports while the loader and the workers go on (their pushes and
  the cuts' checkpoint calls wait for it, ``retry_s``). ``acked_lost_with_wal``: the probe's
  updates missing right after the restart; the next fault waits for a cut after the
  restart, so an acked push the log lost also shows in the counts.
- ``enospc``: right after a cut, a filler file fills the shard's tmpfs, so its next append
  is cut short (ENOSPC, a half-written record); it stays full until the shard's
  ``persimmon_ps_request_errors_total{method="Push",code="UNAVAILABLE"}`` rose and 0.3 s
  more while the workers' pushes are refused and retried; then the filler is removed, a
  probe push acked, the shard SIGKILLed and restarted from its log as in ``ps``.
  ``wal_fault_acked_lost``: the probe's updates missing after that restart;
  ``wal_fault_pushes_refused``: that counter's rise while full (> 0: the fault bit);
  ``wal_full_s``: seconds full. Acked pushes before the fault that the log lost would show
  in ``records_lost``.
- ``restore``: a living shard is restored over its admin REST to the newest complete cut
  while the workers push (its epoch moves on); their pushes are refused (StaleEpoch,
  FAILED_PRECONDITION) and they fail; the job restarts from the cut. A cut whose checkpoint
  call reaches that shard after the restore is refused too (each call carries the epoch the
  ranks pushed in, :class:`~services.worker.job_checkpoints.ConsistentCut`), so no cut holds
  the restored rows beside other shards' parts with the pushes the restore rolled back:
  ``cuts_refused``, the old run's cuts refused; ``inconsistent_cuts`` (must be 0), its
  complete cuts whose part of that shard was written after the restore anyway.
  ``stale_pushes_refused``: the shard's FAILED_PRECONDITION push refusals around the fault;
  ``workers_stale``: workers that ended with StaleEpoch (each writes how it ended to a
  file).
- ``partition``: the proxy of the current run stops forwarding (connections held) until one
  of the partitioned worker's pushes is held; the job restarts from the newest cut without
  that worker (the others and the loader SIGKILLed, every shard restored, fresh workers);
  once they stepped, the proxy breaks the held connections (the worker's client retries its
  push on a new one, held too), then heals: the retry reaches the shard in its new epoch.
  A worker that failed first (an ack to its killed loader) waits for its held push to end
  (:meth:`~bench.chaos_worker.PushWindow.settle`), so the retry is tried either way.
  ``partition_retries_refused``: partitioned workers that ended with StaleEpoch;
  ``partitioned_exited``: those that exited (both must equal the partitions).

``zombie_pushes_applied`` (pushes from before a restore applied after it), read off the
shards' stamp rows: with the WAL a killed shard keeps its state (an orchestrator's restart
first brings it back from its log, then restores it over REST like the living ones), so each
shard's rows are read live (read-only lookups) right before each of its restores and at the
end. Each restore to cut C for run R opens a window on that shard in which runs below R are
old; at its close, every old run's stamp row minus its row in C's files is a push of an old
run the shard applied after the restore. The sum over windows and shards is exact: rows only
grow within an epoch, and a window closes before the restore that would roll it back. A
zombie that survived into the final cut would also show in ``applied_twice``. Without
``--wal`` every ``--wal`` figure is null (``null_reasons``), as is one whose fault never ran.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import signal
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bench import write_json
from bench.chaos_faults import (
    enospc_fault,
    kill_with_wal,
    partition_fault,
    restore_fault,
    sigkill,
)
from bench.chaos_job import SHARDS, TABLE, WORLD, ChaosJob
from services.common.commands import float_at_least, int_at_least

__all__ = ["expected_counts", "produce_records", "register_bench", "run", "source_records"]

console = Console(stderr=True)
ROLES = ("ps", "loader", "worker", "ps-cut")
WAL_ROLES = (*ROLES, "enospc", "restore", "partition")  # with --wal
WAL_FAULTS = {"ps": kill_with_wal, "enospc": enospc_fault, "restore": restore_fault,
              "partition": partition_fault}


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

def _check(job: ChaosJob, record_ids: np.ndarray, expected: dict[int, int]) -> dict[str, Any]:
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


def _source(args: argparse.Namespace) -> tuple[Any, str, np.ndarray, dict[int, int]]:
    """Produce the records to a mock Kafka cluster: its client (the cluster lives as long),
    the source spec, each record's unique id and every id's occurrences."""
    from confluent_kafka.admin import AdminClient as KafkaAdmin

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
    return kafka, source, record_ids, expected


# The figures the --wal faults add up (null without --wal, or when no fault of theirs ran).
WAL_FIGURES = {"acked_lost_with_wal": "ps", "wal_fault_acked_lost": "enospc",
               "wal_fault_pushes_refused": "enospc", "stale_pushes_refused": "restore",
               "workers_stale": "restore", "cuts_refused": "restore",
               "inconsistent_cuts": "restore",
               "partition_retries_refused": "partition", "partitioned_exited": "partition"}


def _inject(job: ChaosJob, schedule: list[str], rng: random.Random) -> tuple[
        dict[str, int], dict[str, list[float]], dict[str, float]]:
    """Every fault of the schedule in turn: (faults by role, recovery seconds by role, the
    --wal faults' figures summed)."""
    args = job.args
    kills = dict.fromkeys(WAL_ROLES if args.wal else ROLES, 0)
    recovery: dict[str, list[float]] = {role: [] for role in kills}
    sums: dict[str, float] = dict.fromkeys(WAL_FIGURES, 0)
    for n, role in enumerate(schedule):
        job.restart_if_failed()
        fault = WAL_FAULTS.get(role, sigkill) if args.wal else sigkill
        got = fault(job, role, rng, args.max_gap, n)
        if got is None:
            break
        recovery[role].append(got.pop("recovery_s"))
        for key, value in got.items():
            sums[key] = sums.get(key, 0) + value
        kills[role] += 1
    return kills, recovery, sums


def _wal_figures(job: ChaosJob, kills: dict[str, int], sums: dict[str, float]
                 ) -> dict[str, Any]:
    """The --wal figures, each null (with its reason) where it was not measured."""
    if not job.args.wal:
        return {**dict.fromkeys([*WAL_FIGURES, "zombie_pushes_applied"]),
                "null_reasons": {"*": "measured with --wal only"}}
    for k in range(SHARDS):  # the last windows: every shard's stamp rows now
        job.zombies.close(k)
    out: dict[str, Any] = {"zombie_pushes_applied": job.zombies.applied, "null_reasons": {}}
    for key, role in WAL_FIGURES.items():
        out[key] = int(sums[key]) if kills.get(role) else None
        if not kills.get(role):
            out["null_reasons"][key] = f"no {role} fault ran"
    out["wal_full_s"] = round(sums.get("wal_full_s", 0.0), 3) if kills.get("enospc") else None
    return out


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt meanwhile, so that the processes are stopped and the
    tmpfs mounts undone (``finally``) also when the bench is terminated."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.records % (args.batch_size * WORLD):
        raise ValueError("--records must be a multiple of 2 x --batch-size (whole steps)")
    rng = random.Random(args.seed)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    kafka, source, record_ids, expected = _source(args)  # kafka: the cluster lives with it
    roles = WAL_ROLES if args.wal else ROLES
    schedule = [roles[i % len(roles)] for i in range(args.kills)]
    rng.shuffle(schedule)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="persimmon-chaos-") as work, _interruptible():
        job = ChaosJob(args, Path(work), source)
        try:
            job.root.mkdir()
            job.start_ps()
            job.first_cut()
            job.start_rest()
            kills, recovery, sums = _inject(job, schedule, rng)
            deadline = time.monotonic() + args.timeout
            while not job.finished():
                job.restart_if_failed()
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            result = _check(job, record_ids, expected)
            result.update(_wal_figures(job, kills, sums))
        finally:
            job.stop()
            unmounted = job.mounts.unmount()
            if unmounted:
                console.print(f"[red]chaos: could not unmount {unmounted}")
    return {"kills": sum(kills.values()), "kills_by_role": kills, **result,
            "wal": args.wal_fsync if args.wal else None, "unplanned_restarts": job.unplanned,
            "unplanned_causes": job.unplanned_causes,
            "recovery_s": {role: {"median": statistics.median(v), "max": max(v)}
                           for role, v in recovery.items() if v},
            "records": args.records, "steps": job.steps, "cut_every": args.cut_every,
            "seed": args.seed, "seconds": time.perf_counter() - started}


# (figure, goal) rows of the table; the --wal ones are null without --wal
_ROWS = (("kills", "all planned"), ("records_lost", "0"), ("applied_twice", "0"),
         ("occurrences_off", "0"), ("finished", "True"), ("unplanned_restarts", "0"),
         ("acked_lost_with_wal", "0"), ("wal_fault_acked_lost", "0"),
         ("zombie_pushes_applied", "0"), ("wal_fault_pushes_refused", "> 0 (the fault bit)"),
         ("stale_pushes_refused", "> 0 (fenced)"), ("workers_stale", "> 0"),
         ("partition_retries_refused", "= partitions"), ("partitioned_exited", "= partitions"),
         ("inconsistent_cuts", "0"), ("cuts_refused", ""))
_ZERO = ("records_lost", "applied_twice", "occurrences_off", "acked_lost_with_wal",
         "wal_fault_acked_lost", "zombie_pushes_applied", "inconsistent_cuts")


def _print(result: dict[str, Any]) -> None:
    table = Table(title=f"chaos: {result['kills']} faults {result['kills_by_role']}, seed "
                        f"{result['seed']}, {result['records']} Kafka records")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("goal", justify="right")
    for key, goal in _ROWS:
        table.add_row(key, str(result[key]), goal)
    for role, r in result["recovery_s"].items():
        table.add_row(f"recovery {role} (median / max)",
                      f"{r['median']:.2f} / {r['max']:.2f} s", "")
    table.add_row("wall time", f"{result['seconds']:.1f} s", "")
    console.print(table)


def _ok(result: dict[str, Any], kills: int) -> bool:
    """Every planned fault ran, the job finished, each must-be-zero figure is 0 (or null
    without --wal), and every partitioned worker was refused and exited."""
    partitions = result["kills_by_role"].get("partition", 0)
    return bool(result["finished"] and result["kills"] == kills
                and not any(result[key] for key in _ZERO)
                and (result["partition_retries_refused"] or 0) == partitions
                and (result["partitioned_exited"] or 0) == partitions)


def _main(args: argparse.Namespace) -> int:
    result = run(args)
    _print(result)
    write_json(result, args.json)
    return 0 if _ok(result, args.kills) else 1


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
                        help="PS shards keep a write-ahead log (each on a tmpfs of its own: "
                             "needs root); a killed shard (role ps) restarts from it and the "
                             "job goes on, no rollback; adds the faults enospc, restore and "
                             "partition")
    parser.add_argument("--wal-fsync", default="batch", choices=["always", "batch", "never"],
                        help="the shards' WAL fsync policy (with --wal)")
    parser.add_argument("--timeout", type=float_at_least(0, inclusive=False), default=300.0,
                        help="seconds the job may take after the last kill")
    parser.set_defaults(func=_main)

