"""Job checkpoints while training: periodic, on request over REST, at SIGTERM; each a cut.

:class:`JobControl` hooks into a trainer through its ``after_step`` hook (the trainer waits
for it between two steps). At a step where rank 0 has a checkpoint due (every N steps or
seconds, or requested with ``POST /v1/job/checkpoints``), or where any rank was asked to stop
(SIGTERM), every rank learns it from one tiny all-reduce and the job is cut at that step:
every rank drains its pushes in flight, the ranks meet, rank 0 writes the PS parts, the dense
state and the manifest (:class:`~services.worker.job_checkpoints.JobCheckpointer`) while no
rank pushes, and the ranks meet again. So a job checkpoint holds in its PS parts exactly the
pushes of every rank's steps up to the cut, with the dense state of that step: a consistent
cut, not rows that moved on while the parts were written. After a stop every rank raises
:class:`StopTraining` once the cut is written.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import torch
import torch.distributed as dist

from services.common.checkpoints import list_job_checkpoints
from services.common.errors import PersimmonError
from services.worker.embedding.pipeline import EmbeddingPipeline
from services.worker.job_checkpoints import JobCheckpointer, dense_part

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["JobControl", "StopTraining", "fit_with_checkpoints", "make_job_admin"]

log = logging.getLogger(__name__)


class StopTraining(Exception):  # noqa: N818 - a request, not an error
    """Raised from ``after_step`` after :meth:`JobControl.request_stop` (e.g. SIGTERM)."""


class Cuttable(Protocol):
    """What a JobControl uses of its trainer."""

    @property
    def pipeline(self) -> EmbeddingPipeline: ...

    def dense_state(self) -> dict[str, Any]: ...


class JobControl:
    """Consistent job checkpoints of ``trainer`` (see the module doc). ``checkpointer``: rank
    0's (None on the other ranks); ``group``: a gloo group of every rank (None: one rank)."""

    def __init__(self, checkpointer: JobCheckpointer | None, trainer: Cuttable, *,
                 group: Any = None) -> None:
        self.checkpointer = checkpointer
        self._trainer = trainer
        self._group = group
        self._requests: list[asyncio.Future[dict[str, Any]]] = []
        self._stop = False
        self.step = 0
        self._cut_at: int | None = None  # the step of the last cut

    async def after_step(self, info: dict[str, Any]) -> None:
        """The trainer's ``after_step`` hook: cut the job where one is due or a stop asked."""
        self.step = int(info["step"])
        due = bool(self._requests) or (self.checkpointer is not None
                                        and self.checkpointer.due(self.step))
        stop, due = await self._agree(self._stop, due)
        if due or stop:
            await self._cut()
        if stop:
            raise StopTraining(f"stop requested at step {self.step}")

    async def _agree(self, stop: bool, due: bool) -> tuple[bool, bool]:
        """Whether any rank stops, and whether any has a checkpoint due (one all-reduce)."""
        if self._group is None:
            return stop, due
        flags = torch.tensor([int(stop), int(due)], dtype=torch.int32)
        await asyncio.to_thread(dist.all_reduce, flags, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flags[0]), bool(flags[1])

    async def _meet(self) -> None:
        if self._group is not None:
            await asyncio.to_thread(dist.barrier, group=self._group)

    async def _cut(self) -> dict[str, Any] | None:
        """Drain, meet, rank 0 writes, meet: the checkpoint of this step on rank 0 (None on
        the others, and where writing failed: the requests waiting get the error)."""
        await self._trainer.pipeline.drain()
        await self._meet()
        waiting, self._requests = self._requests, []
        manifest: dict[str, Any] | None = None
        try:
            if self.checkpointer is not None:
                parts = {"dense": dense_part(self._trainer.dense_state())}
                manifest = await self.checkpointer.checkpoint(self.step, parts=parts)
        except (PersimmonError, httpx.HTTPError, OSError) as exc:  # training goes on
            log.error("job checkpoint at step %d failed: %s", self.step, exc)
            for future in waiting:
                if not future.done():
                    future.set_exception(exc)
            waiting = []
        finally:
            await self._meet()  # no rank pushes before the parts are written
        self._cut_at = self.step
        for future in waiting:
            if not future.done():
                future.set_result(manifest or {})
        return manifest

    async def requested(self) -> dict[str, Any]:
        """A checkpoint at the next step boundary; returns its manifest once complete."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._requests.append(future)
        return await future

    def request_stop(self) -> None:
        self._stop = True

    async def close(self) -> dict[str, Any] | None:
        """After training (every rank, at the same step): the final cut, unless the job was
        cut at this step already; rank 0's manifest."""
        if self._cut_at == self.step and not self._requests:
            return None
        return await self._cut()


async def fit_with_checkpoints(trainer: Any, batches: Any, control: JobControl, *,
                               eval_batches: Any = None, admin_port: int | None = None,
                               host: str = "0.0.0.0") -> tuple[dict[str, Any] | None,
                                                               dict[str, Any] | None]:
    """``trainer.fit`` under ``control`` on every rank: SIGTERM stops at the next step, the
    job admin REST runs on ``admin_port`` meanwhile (rank 0), and a final cut is written at
    the end. Returns (the fit summary, or None when stopped; rank 0's last manifest). A fit
    that fails otherwise writes no final cut."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, control.request_stop)
    from services.common.admin import AdminServer

    admin = AdminServer(make_job_admin(control), host, admin_port) \
        if admin_port is not None and control.checkpointer is not None else None
    trainer.after_step = control.after_step
    summary: dict[str, Any] | None = None
    last: dict[str, Any] | None = None
    try:
        if admin is not None:
            await admin.start()
        try:
            summary = await trainer.fit(batches, eval_batches=eval_batches)
        except StopTraining as exc:
            log.info("%s: the job was cut there", exc)
            last = await _newest(control)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
        final = await control.close()
        last = final or last
    finally:
        if admin is not None:
            await admin.close()
    return summary, last


async def _newest(control: JobControl) -> dict[str, Any] | None:
    """Rank 0's newest complete job checkpoint."""
    if control.checkpointer is None:
        return None
    known = await asyncio.to_thread(list_job_checkpoints, control.checkpointer.root)
    return known[-1] if known else None


def make_job_admin(control: JobControl) -> FastAPI:
    """Admin REST of the job (rank 0): ``POST /v1/job/checkpoints`` (returns the manifest
    once the cut is complete) and ``GET /v1/job/checkpoints`` (the complete ones)."""
    from prometheus_client import CollectorRegistry  # the admin app's imports: on first use

    from services.common.admin import make_admin_app

    checkpointer = control.checkpointer
    assert checkpointer is not None  # rank 0's
    root = checkpointer.root
    app = make_admin_app(title="Persimmon job", registry=CollectorRegistry(),
                         config=lambda: {"checkpoint_dir": str(root),
                                         "every_steps": checkpointer.every_steps,
                                         "every_s": checkpointer.every_s},
                         ready=lambda: True)

    @app.post("/v1/job/checkpoints", tags=["job"], status_code=201)
    async def create_checkpoint() -> dict[str, Any]:
        """Cut the whole job at the next step boundary."""
        return await control.requested()

    @app.get("/v1/job/checkpoints", tags=["job"])
    async def checkpoints() -> list[dict[str, Any]]:
        """Manifests of the complete job checkpoints, oldest first."""
        return await asyncio.to_thread(list_job_checkpoints, root)

    return app
