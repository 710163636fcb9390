"""Model versions of a running training job, on a cadence (``--export-dir DIR`` with
``--export-every-steps N`` and/or ``--export-every-s T``).

:class:`OnlineExport` holds the settings (it pickles, so every local rank gets it; rank 0
attaches it). :meth:`OnlineExport.attach` makes an :class:`OnlineExporter` the trainer's
``after_step`` hook. At a step where an export is due the trainer waits while the exporter

1. waits until every push of this rank is acknowledged (with one worker the PS then holds
   exactly this step's rows; other ranks' last pushes may still be on their way),
2. writes a job checkpoint of this step (every PS shard's tables and the dense part),
3. exports it as a model version into DIR (:func:`export_job_checkpoint`): a full version
   every ``full_every`` exports, in between one holding only the rows changed since the
   previous export (and tombstones of rows evicted since); ``keep`` prunes old versions,
4. deletes the job checkpoint.

A server watching DIR (``persimmon serve --model-dir DIR``) then swaps to the new version.
An export that fails is logged and counted (``errors``) and training goes on; the next due
step tries again. Serving does not import the PS: ``read_shards`` (the PS checkpoint
reader) is injected by the caller.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.common.errors import ConfigError, PersimmonError
from services.loader import FeatureSpec, spec_from_source
from services.loader.hashing import DenseTransform
from services.serve.sources import ReadShards, export_job_checkpoint
from services.worker.config import TrainerConfig
from services.worker.job_checkpoints import JobCheckpointer, dense_part
from services.worker.models import ModelConfig

__all__ = ["OnlineExport", "OnlineExporter", "loader_feature_spec"]

log = logging.getLogger("persimmon.serve")


@dataclass(kw_only=True, slots=True)
class OnlineExport:
    """Where and how often a running job exports model versions (see module docstring).

    ``checkpoint_dir`` is the directory the PS shards at ``ps_admin_urls`` checkpoint into.
    """

    model_dir: str
    checkpoint_dir: str
    ps_admin_urls: list[str]
    spec: FeatureSpec
    model: ModelConfig
    read_shards: ReadShards
    every_steps: int = 0
    every_s: float = 0.0
    keep: int = 0
    full_every: int = 1

    def __post_init__(self) -> None:
        if not (self.every_steps or self.every_s):
            raise ConfigError("an online export needs every_steps or every_s")
        if not self.ps_admin_urls:
            raise ConfigError("an online export needs the PS shards' admin URLs")

    @classmethod
    def from_config(cls, config: TrainerConfig, **where: Any) -> OnlineExport:
        """The export settings of ``config`` (its ``export_*`` fields); ``where``: the other
        fields."""
        if not config.export_dir:
            raise ConfigError("export_dir is not set")
        return cls(model_dir=config.export_dir, every_steps=config.export_every_steps,
                   every_s=config.export_every_s, keep=config.export_keep,
                   full_every=config.export_full_every, **where)

    def attach(self, trainer: Any) -> OnlineExporter:
        """Export ``trainer``'s versions from now on (it becomes the trainer's after_step)."""
        exporter = OnlineExporter(self, trainer)
        trainer.after_step = exporter.after_step
        return exporter


class OnlineExporter:
    """Exports of one trainer; ``exported`` holds the manifests written, oldest first."""

    def __init__(self, settings: OnlineExport, trainer: Any) -> None:
        self.settings = settings
        self.trainer = trainer
        self.checkpointer = JobCheckpointer(settings.checkpoint_dir,
                                            admin_urls=settings.ps_admin_urls,
                                            every_steps=settings.every_steps,
                                            every_s=settings.every_s)
        self.exported: list[dict[str, Any]] = []
        self.errors = 0

    async def after_step(self, info: dict[str, Any]) -> None:
        """The trainer's after_step hook: export when one is due at this step."""
        if not self.checkpointer.due(int(info["step"])):
            return
        try:
            await self.export()
        except (PersimmonError, OSError, httpx.HTTPError) as exc:
            self.errors += 1
            log.error("model export at step %s failed (training goes on): %s",
                      info["step"], exc)

    async def export(self) -> dict[str, Any]:
        """Export the trainer's model now (call between steps); returns the manifest."""
        s, trainer = self.settings, self.trainer
        await trainer.pipeline.drain()  # the PS has this rank's pushes up to this step
        step = int(trainer.step)
        checkpoint_id = f"export-{step:010d}-{uuid.uuid4().hex[:6]}"
        await self.checkpointer.checkpoint(step, checkpoint_id, parts={
            "dense": dense_part(trainer.dense_state())})
        full = len(self.exported) % s.full_every == 0
        try:
            manifest = await asyncio.to_thread(
                export_job_checkpoint, s.checkpoint_dir, checkpoint_id, s.model_dir,
                read_shards=s.read_shards, model=s.model, spec=s.spec,
                features=trainer.tables, pooling=trainer.config.pooling, keep=s.keep or None,
                base=None if full else self.exported[-1]["version_id"],
                source={"kind": "online", "step": step})
        finally:
            await asyncio.to_thread(shutil.rmtree, Path(s.checkpoint_dir) / checkpoint_id,
                                    True)
        self.exported.append(manifest)
        log.info("exported model version %s (step %d, %s)", manifest["version_id"], step,
                 "full" if full else f"on {manifest['base']}")
        return manifest


def loader_feature_spec(admin_url: str, timeout_s: float = 10.0) -> FeatureSpec:
    """The feature spec of the data the loader at ``admin_url`` reads: its source spec
    (``GET /v1/sources``) and dense transform (``GET /v1/config``)."""
    with httpx.Client(base_url=admin_url, timeout=timeout_s) as http:
        sources = http.get("/v1/sources").raise_for_status().json()
        config = http.get("/v1/config").raise_for_status().json()
    try:
        transform = DenseTransform(fill=config["dense_fill"], clip_min=config["dense_clip_min"],
                                   clip_max=config["dense_clip_max"],
                                   log1p=config["dense_log1p"])
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"the loader at {admin_url} reports no usable dense transform: "
                          f"{exc}") from exc
    return spec_from_source(sources[0]["spec"], transform)
