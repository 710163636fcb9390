"""A worker of the ``python -m bench chaos`` job: ``python -m bench.chaos_worker --rank R ...``.

:func:`counting_worker` pushes counting gradients of its loader's batches and cuts the job
(:mod:`bench.chaos` says what is measured); :class:`PushWindow` holds its pushes in flight.
How the process ended goes to its ``--exit-file`` (the error's class name, or ``done``): the
bench reads ``StaleEpoch`` there as a worker fenced by a restore.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import numpy as np

from bench.chaos_job import SHARDS, STAMP, TABLE, WORLD, stamp_ids
from services.common.errors import StaleEpoch

__all__ = ["PushWindow", "counting_worker"]


class PushWindow:
    """A worker's pushes in flight, at most ``size`` (0: one at a time): each a task that pushes
    a batch and acks it to the loader. A failed push raises from whichever method sees it first; then
    :meth:`settle` lets the others end and names the error the worker ends on."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._tasks: set[asyncio.Task[None]] = set()

    def add(self, push: Coroutine[Any, Any, None]) -> None:
        self._tasks.add(asyncio.ensure_future(push))

    async def room(self) -> None:
        """Wait until another push may start."""
        while self._tasks and len(self._tasks) >= self.size:
            done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            self._reap(done)

    async def drain(self) -> None:
        """Wait for every push in flight (a failure raises at once)."""
        if self._tasks:
            done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
            self._reap(done)

    async def next_batch(self, stream: AsyncIterator[Any]) -> Any:
        """The next batch of ``stream``; a push that fails meanwhile raises first."""
        waiting = asyncio.ensure_future(anext(stream))
        try:
            while not waiting.done():
                done, _ = await asyncio.wait({waiting, *self._tasks},
                                             return_when=asyncio.FIRST_COMPLETED)
                self._reap(done - {waiting})
            return waiting.result()
        finally:
            waiting.cancel()

    def _reap(self, done: set[asyncio.Task[None]]) -> None:
        """Forget the pushes of ``done`` that succeeded; raise the first failure (failed ones
        stay, for :meth:`settle`)."""
        failed = [task for task in done if task.cancelled() or task.exception() is not None]
        self._tasks -= done.difference(failed)
        if failed:
            failed[0].result()

    async def settle(self, error: Exception) -> Exception:
        """Wait for every push in flight to end (each has its retry deadline) and return the
        error the worker ends on: a :class:`StaleEpoch` of any push, else ``error``. A worker
        cut off from its job (its loader killed, so an ack fails) still has its held pushes
        retried; that the shard refuses them is why it cannot go on."""
        ended = await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        return next((e for e in (error, *ended) if isinstance(e, StaleEpoch)), error)


async def counting_worker(*, root: str, run: str, rank: int, ps: list[str], ps_admin: list[str],
                          loader: str, loader_admin: str | None, steps: int, cut_every: int,
                          window: int = 4, step_ms: int = 0, started: str | None = None,
                          leave_after: int | None = None, retry_s: float = 0.0) -> int:
    """Rank ``rank`` of the job from the newest complete cut under ``root``: push counting
    gradients of every batch (``window`` pushes in flight), cut every ``cut_every`` steps and
    at ``steps`` (a cut refused for a restored shard is no cut: the worker goes on, and its
    next push to that shard is refused; a refused final cut raises StaleEpoch);
    ``leave_after``: stop after that step with no cut, as a crash would; ``retry_s``: pushes
    and the cut's checkpoint calls wait that long for a shard that is down (one restarting
    from its write-ahead log). Returns the step reached; a failure is
    raised once every push in flight has ended (:meth:`PushWindow.settle`)."""
    from clients.loader_client import LoaderClient
    from clients.ps_client import PSClient
    from services.common.checkpoints import latest_complete
    from services.common.checkpoints.positions import cut_positions
    from services.worker.job_checkpoints import ConsistentCut, JobCheckpointer

    manifest = latest_complete(root)
    step = int(manifest["step"]) if manifest else 0
    stamps = {STAMP: stamp_ids(int(run) + 1)[-1]}  # this run's row on every shard
    checkpointer = JobCheckpointer(root, admin_urls=ps_admin,
                                   retry_s=retry_s) if rank == 0 else None
    pushes = PushWindow(window)
    async with PSClient(ps, retry_s=retry_s) as client, LoaderClient(
            loader, rank=rank, world_size=WORLD, credits=window + 2) as batches:
        # each cut carries the epochs this rank pushed in: a shard restored since refuses it
        cut = ConsistentCut(root, rank=rank, world=WORLD, run=run, checkpointer=checkpointer,
                            positions=cut_positions(root), loader_admin_url=loader_admin,
                            epochs=lambda: client.epochs)

        if STAMP not in client.dims:  # shards without the stamp table (a test's)
            stamps.clear()

        async def push(batch: Any) -> None:  # one message per shard: counts and the stamp
            ids, counts = np.unique(np.concatenate([f.values for f in batch.sparse.values()]),
                                    return_counts=True)
            await client.push_tables({TABLE: ids, **stamps}, {
                TABLE: -counts[:, None].astype(np.float32),
                **{name: np.full((SHARDS, 1), -1.0, np.float32) for name in stamps}})
            await batches.ack(batch)

        stream = batches.batches()
        try:
            while step < steps:
                batch = await pushes.next_batch(stream)
                await pushes.room()
                pushes.add(push(batch))
                cut.trained(batch.positions)
                step += 1
                if step_ms:
                    await asyncio.sleep(step_ms / 1000)
                if started is not None and not os.path.exists(started):
                    Path(started).touch()
                if step == leave_after:
                    await pushes.drain()
                    break
                if step % cut_every == 0 or step == steps:
                    made = await cut.cut(step, drain=pushes.drain,
                                         dense=json.dumps({"step": step}).encode())
                    if made is None and step == steps:  # no later cut to finish the job
                        raise StaleEpoch(f"the final cut at step {step} was refused")
        except Exception as exc:
            ended = await pushes.settle(exc)
            if ended is exc:
                raise
            raise ended from exc
    return step


def _worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos_worker")
    for name in ("--root", "--run", "--ps", "--ps-admin", "--loader", "--loader-admin",
                 "--started", "--exit-file"):
        parser.add_argument(name, required=True)
    for name in ("--rank", "--steps", "--cut-every", "--window", "--step-ms"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--retry-s", type=float, default=0.0)
    a = parser.parse_args(argv)
    try:
        asyncio.run(counting_worker(
            root=a.root, run=a.run, rank=a.rank, ps=a.ps.split(","),
            ps_admin=a.ps_admin.split(","), loader=a.loader, loader_admin=a.loader_admin,
            steps=a.steps, cut_every=a.cut_every, window=a.window, step_ms=a.step_ms,
            started=a.started, retry_s=a.retry_s))
    except BaseException as exc:  # how it ended, for the bench (StaleEpoch: fenced)
        Path(a.exit_file).write_text(type(exc).__name__)
        raise
    Path(a.exit_file).write_text("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker_main(sys.argv[1:]))
