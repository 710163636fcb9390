"""The faults of ``python -m bench chaos`` (:mod:`bench.chaos` says what each measures).

Each takes the job, the schedule's random source, the longest gap before a fault and the
fault's number, waits for a random point of the job (:func:`kill_point`), and returns its
figures (``recovery_s`` and counts) or None when the job finished before that point:
:func:`sigkill` (a process of a role, then a restart from the newest cut), and with ``--wal``
:func:`kill_with_wal`, :func:`enospc_fault`, :func:`restore_fault`, :func:`partition_fault`.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import time

import numpy as np

from bench.chaos_job import PROBE, RETRY_S, SHARDS, ChaosJob, wait

PUSH_BYTES = 512  # held past this: a push (HTTP/2 control frames are far smaller)

__all__ = ["enospc_fault", "kill_point", "kill_with_wal", "partition_fault", "restore_fault",
           "shard_errors", "sigkill"]


def kill_point(job: ChaosJob, role: str, rng: random.Random, max_gap: float) -> bool:
    """Wait for a random point to fault ``role`` at (after 0 to 2 cuts of this run and a
    random gap; ``ps-cut``: then a cut in progress); False when the job finished first."""
    cuts = rng.randint(0, 2)
    wait(lambda: job.cuts_done() >= cuts or job.finished() or job.failed(), 300,
         f"{cuts} cuts of run {job.run}")
    if job.restart_if_failed():
        return kill_point(job, role, rng, max_gap)
    if job.finished():
        return False
    time.sleep(rng.uniform(0.0, max_gap))
    if role == "ps-cut":
        wait(lambda: job.cut_in_progress() or job.finished() or job.failed(), 120,
             "a cut in progress")
    return not job.finished()


def sigkill(job: ChaosJob, role: str, rng: random.Random, max_gap: float, n: int
            ) -> dict[str, float] | None:
    """SIGKILL one process of ``role`` at a random point, then restart the job from its
    newest complete cut (``recovery_s``: the kill to both new workers' first step)."""
    if not kill_point(job, role, rng, max_gap):
        return None
    job.pid_of(role, rng).send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    job.restart()
    wait(lambda: job.started() or job.finished() or job.failed(), 120,
         "the restarted workers' first step")
    return {"recovery_s": time.monotonic() - killed_at}


def shard_errors(admin_url: str, code: str) -> int:
    """Push requests the shard refused with gRPC status ``code`` since it started (its
    ``persimmon_ps_request_errors`` counter on /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    from clients.admin_client import AdminClient

    async def scrape() -> str:
        async with AdminClient(admin_url) as admin:
            return await admin.metrics()

    total = 0.0
    for family in text_string_to_metric_families(asyncio.run(scrape())):
        for sample in family.samples:
            if (sample.name == "persimmon_ps_request_errors_total"
                    and sample.labels.get("method") == "Push"
                    and sample.labels.get("code") == code):
                total += sample.value
    return int(total)


# ---- the faults --------------------------------------------------------------------------------

def _probe_kill_restart(job: ChaosJob, k: int, n: int) -> tuple[int, float]:
    """Push the bench's own probe (64 ids of shard ``k``, -1 each), SIGKILL shard ``k`` once it
    is acknowledged, restart it from its log and count the probe's updates it lacks; wait for
    a cut after the restart (so a later rollback cannot re-push what the kill lost). Returns
    (updates lost, seconds from the kill to serving again)."""
    from clients.ps_client import PSClient
    from services.common.sharding import shard_of
    from services.local.processes import wait_ready

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
    try:
        wait(lambda: job.cuts_done() > cuts or job.finished() or job.failed(), 300,
             "a cut after the shard's restart")
    except RuntimeError as exc:  # the job hangs: say what each worker last logged
        raise RuntimeError(f"{exc}; {job.failure()}") from exc
    return lost, recovered


def kill_with_wal(job: ChaosJob, role: str, rng: random.Random, max_gap: float,
                  n: int
                  ) -> dict[str, float] | None:
    """Role ``ps`` with ``--wal``: SIGKILL a shard right after an acked probe push, restart it
    from its log (no rollback; the job's pushes and cuts wait for it)."""
    if not kill_point(job, "ps", rng, max_gap):
        return None
    lost, recovered = _probe_kill_restart(job, rng.randrange(SHARDS), n)
    return {"recovery_s": recovered, "acked_lost_with_wal": lost}


def enospc_fault(job: ChaosJob, role: str, rng: random.Random, max_gap: float,
                 n: int
                 ) -> dict[str, float] | None:
    """Fill a shard's WAL tmpfs (its next append is cut short: ENOSPC), keep it full until the
    shard has refused pushes (UNAVAILABLE, the workers retry) and a moment more, remove the
    filler, then an acked probe push, a SIGKILL and a restart from the log."""
    if not kill_point(job, "enospc", rng, max_gap):
        return None
    k = rng.randrange(SHARDS)
    refused = shard_errors(job.ps_admin[k], "UNAVAILABLE")
    cuts = job.cuts_done()  # filled right after a cut: the next one needs acked pushes first
    wait(lambda: job.cuts_done() > cuts or job.finished() or job.failed(), 120, "a cut")
    if job.restart_if_failed() or job.finished():
        return enospc_fault(job, role, rng, max_gap, n)
    started = time.monotonic()
    filler = job.mounts.fill(k)
    try:
        wait(lambda: shard_errors(job.ps_admin[k], "UNAVAILABLE") > refused
             or job.finished() or job.failed(), 60, "a push refused for the full log")
        time.sleep(0.3)  # full a moment more: the workers' retries are refused too
    finally:
        filler.unlink()
        full_s = time.monotonic() - started
    refused = shard_errors(job.ps_admin[k], "UNAVAILABLE") - refused
    lost, recovered = _probe_kill_restart(job, k, n)
    return {"recovery_s": recovered, "wal_full_s": full_s,
            "wal_fault_acked_lost": lost, "wal_fault_pushes_refused": refused}


def _exit_reason(job: ChaosJob, run: int, rank: int) -> str:
    path = job.exit_file(run, rank)
    return path.read_text().strip() if path.exists() else ""


def _cuts_after_restore(job: ChaosJob, run: int, k: int, epoch: int) -> tuple[int, int]:
    """Cuts of ``run`` (its workers stopped): (refused, inconsistent). Refused: a shard (or the
    ranks) refused the cut's epochs, so it never completed. Inconsistent: complete, yet its
    shard-``k`` part was written in ``epoch`` or later (after the restore, so without the
    pushes the restore rolled back, beside the other shards' parts that hold them): a cut the
    epoch fence let through, which a restart could pick."""
    from services.common.checkpoints import JOB_MANIFEST
    from services.worker.job_checkpoints import CUT_REFUSED

    refused = inconsistent = 0
    for d in job.root.glob(f"cut-{run}-*"):
        part = d / f"shard-{k}-of-{SHARDS}" / "manifest.json"
        refused += (d / CUT_REFUSED).exists()
        inconsistent += (d / JOB_MANIFEST).exists() and part.exists() \
            and int(json.loads(part.read_text()).get("epoch", 0)) >= epoch
    return refused, inconsistent


def restore_fault(job: ChaosJob, role: str, rng: random.Random, max_gap: float,
                  n: int
                  ) -> dict[str, float] | None:
    """Restore a living shard over its admin REST to the newest complete cut while the
    workers push; their pushes are refused (StaleEpoch), so is a cut whose call reaches the
    shard after the restore, and they fail; the job restarts from that cut
    (:meth:`ChaosJob.restart`)."""
    from clients.admin_client import AdminClient
    from services.common.checkpoints import latest_complete

    if not kill_point(job, "restore", rng, max_gap):
        return None
    k = rng.randrange(SHARDS)
    refused = shard_errors(job.ps_admin[k], "FAILED_PRECONDITION")
    cut = latest_complete(job.root)
    assert cut is not None
    job.zombies.close(k)
    started = time.monotonic()

    async def restore() -> int:
        async with AdminClient(job.ps_admin[k]) as admin:
            return (await admin.restore(cut["checkpoint_id"])).epoch

    epoch = asyncio.run(restore())
    job.zombies.open(k, cut["checkpoint_id"], job.run + 1)
    wait(lambda: any(w.poll() is not None for w in job.workers) or job.finished(), 120,
         "a worker failing on its refused push")
    refused = shard_errors(job.ps_admin[k], "FAILED_PRECONDITION") - refused
    old_run = job.run
    stale = sum(_exit_reason(job, old_run, r) == "StaleEpoch" for r in range(len(job.workers)))
    job.restart()
    wait(lambda: job.started() or job.finished() or job.failed(), 120,
         "the restarted workers' first step")
    recovered = time.monotonic() - started
    cuts_refused, inconsistent = _cuts_after_restore(job, old_run, k, epoch)
    return {"recovery_s": recovered, "stale_pushes_refused": refused,
            "workers_stale": stale, "cuts_refused": cuts_refused,
            "inconsistent_cuts": inconsistent}


def partition_fault(job: ChaosJob, role: str, rng: random.Random, max_gap: float,
                    n: int
                    ) -> dict[str, float] | None:
    """Hold one worker's traffic to one shard (its proxy), restart the job from the newest cut
    without it (the other worker and the loader killed, every shard restored, fresh workers),
    break its held connections so that its client retries (held too), heal: the retry reaches
    the shard in its new epoch and must be refused; the old worker must then exit."""
    if not kill_point(job, "partition", rng, max_gap):
        return None
    assert job.proxy is not None
    proxy, (rank, k) = job.proxy, job.proxied
    old_run, old = job.run, job.workers[rank]
    started = time.monotonic()
    proxy.hold()
    wait(lambda: proxy.held_bytes > PUSH_BYTES or old.poll() is not None or job.finished(),
         120, "a push of the partitioned worker held")
    if job.finished():
        proxy.heal()
        return None
    job.restart(spare=old)
    wait(lambda: job.started() or job.finished() or job.failed(), 120,
         "the restarted workers' first step")
    recovered = time.monotonic() - started
    refused = shard_errors(job.ps_admin[k], "FAILED_PRECONDITION")
    held = proxy.held_bytes
    proxy.reset()  # the held push fails (UNAVAILABLE) and its retry waits on a new connection
    wait(lambda: proxy.held_bytes > held or old.poll() is not None, 60,
         "the partitioned worker's retry")
    proxy.heal()
    wait(lambda: old.poll() is not None, 120, "the partitioned worker's exit")
    proxy.close()
    return {"recovery_s": recovered, "partitioned_exited": 1,
            "partition_retries_refused": int(_exit_reason(job, old_run, rank) == "StaleEpoch"),
            "stale_pushes_refused": shard_errors(job.ps_admin[k], "FAILED_PRECONDITION")
            - refused}
