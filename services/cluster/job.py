"""Job checkpoints while training: periodic, on request over REST, and at SIGTERM.

:class:`JobControl` hooks into a trainer through its ``on_step`` callback (rank 0 only): at
a step where a checkpoint is due (every N steps or seconds) or was requested
(``POST /v1/job/checkpoints``), it captures the dense state between two steps, so model and
optimizer are consistent, and writes the job checkpoint in the background. After
:meth:`request_stop` (the SIGTERM handler) the next step raises :class:`StopTraining`; the
launcher then writes a final checkpoint and exits cleanly.

Resume: :func:`resume_state` reads the dense state of the newest complete job checkpoint (the
PS shards restore theirs with ``--restore job``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from services.cluster.checkpoints import JobCheckpointer, dense_part, load_dense_part
from services.common.admin import AdminServer, make_admin_app
from services.common.jobs import latest_complete, list_job_checkpoints, read_part

__all__ = ["JobControl", "StopTraining", "fit_with_checkpoints", "make_job_admin",
           "resume_state"]

log = logging.getLogger(__name__)


class StopTraining(Exception):  # noqa: N818 - a request, not an error
    """Raised from ``on_step`` after :meth:`JobControl.request_stop` (e.g. SIGTERM)."""


class JobControl:
    """Checkpoints for a trainer exposing ``dense_state()`` (see module docstring)."""

    def __init__(self, checkpointer: JobCheckpointer, dense_state: Callable[[], dict[str, Any]]
                 ) -> None:
        self.checkpointer = checkpointer
        self._dense_state = dense_state
        self._requests: list[asyncio.Future[dict[str, Any]]] = []
        self._writes: set[asyncio.Task[dict[str, Any]]] = set()
        self._stop = False
        self.step = 0

    def on_step(self, info: dict[str, Any]) -> None:
        """The trainer's ``on_step`` callback (runs on the event loop, between steps)."""
        self.step = int(info["step"])
        if self._stop:
            raise StopTraining(f"stop requested at step {self.step}")
        if self._requests or self.checkpointer.due(self.step):
            waiting, self._requests = self._requests, []
            task = asyncio.get_running_loop().create_task(self.checkpointer.checkpoint(
                self.step, parts=self._parts()))  # the state now, between two steps
            self._writes.add(task)
            task.add_done_callback(lambda t: self._finish(t, waiting))

    def _finish(self, task: asyncio.Task[dict[str, Any]],
                waiting: list[asyncio.Future[dict[str, Any]]]) -> None:
        self._writes.discard(task)
        for future in waiting:
            if future.done():
                continue
            if task.cancelled():
                future.cancel()
            elif (exc := task.exception()) is not None:
                future.set_exception(exc)
            else:
                future.set_result(task.result())

    def _parts(self) -> dict[str, bytes]:
        return {"dense": dense_part(self._dense_state())}

    async def checkpoint_now(self) -> dict[str, Any]:
        """Write a job checkpoint of the current step (call between steps)."""
        return await self.checkpointer.checkpoint(self.step, parts=self._parts())

    async def requested(self) -> dict[str, Any]:
        """A checkpoint at the next step boundary; returns its manifest once complete."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._requests.append(future)
        return await future

    def request_stop(self) -> None:
        self._stop = True

    async def close(self, *, final: bool = True) -> dict[str, Any] | None:
        """After training: wait for checkpoints being written, then write a last one (when
        ``final`` or when one is still requested) and return its manifest."""
        await asyncio.gather(*self._writes, return_exceptions=True)
        if not (final or self._requests):
            return None
        waiting, self._requests = self._requests, []
        manifest = await self.checkpoint_now()
        for future in waiting:
            future.set_result(manifest)
        return manifest


async def fit_with_checkpoints(trainer: Any, batches: Any, control: JobControl, *,
                               eval_batches: Any = None, admin_port: int | None = None,
                               host: str = "0.0.0.0") -> tuple[dict[str, Any] | None,
                                                               dict[str, Any] | None]:
    """``trainer.fit`` under ``control``: SIGTERM stops at the next step, the job admin REST
    runs on ``admin_port`` meanwhile, and a final checkpoint is written at the end.
    Returns (the fit summary, or None when stopped; the final checkpoint's manifest)."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, control.request_stop)
    admin = AdminServer(make_job_admin(control), host, admin_port) \
        if admin_port is not None else None
    trainer.on_step = control.on_step
    summary: dict[str, Any] | None = None
    try:
        if admin is not None:
            await admin.start()
        summary = await trainer.fit(batches, eval_batches=eval_batches)
    except StopTraining as exc:
        log.info("%s: writing a final checkpoint", exc)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        try:
            manifest = await control.close(final=True)
        finally:
            if admin is not None:
                await admin.close()
    return summary, manifest


def make_job_admin(control: JobControl) -> FastAPI:
    """Admin REST of the job: ``POST /v1/job/checkpoints`` (returns the manifest once the
    checkpoint is complete) and ``GET /v1/job/checkpoints`` (the complete ones)."""
    root = control.checkpointer.root
    app = make_admin_app(title="Persimmon job", registry=CollectorRegistry(),
                         config=lambda: {"checkpoint_dir": str(root),
                                         "every_steps": control.checkpointer.every_steps,
                                         "every_s": control.checkpointer.every_s},
                         ready=lambda: True)

    @app.post("/v1/job/checkpoints", tags=["job"], status_code=201)
    async def create_checkpoint() -> dict[str, Any]:
        """Checkpoint the whole job at the next step boundary."""
        return await control.requested()

    @app.get("/v1/job/checkpoints", tags=["job"])
    async def checkpoints() -> list[dict[str, Any]]:
        """Manifests of the complete job checkpoints, oldest first."""
        return await asyncio.to_thread(list_job_checkpoints, root)

    return app


def resume_state(root: Path | str) -> dict[str, Any] | None:
    """The dense state (model, optimizer, step) of the newest complete job checkpoint."""
    manifest = latest_complete(root)
    if manifest is None:
        return None
    return load_dense_part(read_part(root, manifest, "dense"))
