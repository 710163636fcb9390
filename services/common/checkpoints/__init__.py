"""Checkpoints: where each piece lives (start here).

- :mod:`services.common.checkpoints.jobs` (re-exported here): the job checkpoint on disk, the
  one format both the PS shards and the workers read: ``root/<id>/job.json`` (the manifest,
  written last), ``root/<id>/parts/<name>`` (dense state, loader offsets) next to every PS
  shard's part; :func:`latest_complete` is what ``--restore job`` and ``--resume`` pick.
- :mod:`services.common.checkpoints.positions`: the source positions of a consistent cut
  (the job part ``positions``), which a loader under ``--checkpoint-dir`` resumes from.
- :mod:`services.ps.checkpoint`: a PS shard's own part (``root/<id>/shard-<k>-of-<n>/``):
  atomic, checksummed, incremental and reshardable; the PS admin API writes and restores it.
- :mod:`services.worker.job_checkpoints`: the coordinator run by worker rank 0
  (:class:`~services.worker.job_checkpoints.JobCheckpointer`: PS parts over their admin API, then
  the job parts, then the manifest; :class:`~services.worker.job_checkpoints.ConsistentCut`: a
  cut across ranks; :class:`~services.worker.job_checkpoints.JobControl`: periodic,
  on request over REST, at SIGTERM; ``resume_state``).
- :mod:`services.local.supervise` with :class:`services.local.processes.LocalPS`: a PS shard
  that dies on this machine is restarted from the newest complete job checkpoint.
"""

from __future__ import annotations

from services.common.checkpoints import jobs
from services.common.checkpoints.jobs import *  # noqa: F403 - the package's API is jobs'

__all__ = list(jobs.__all__)
