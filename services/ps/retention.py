"""What a PS shard keeps in its checkpoint directory: its newest checkpoints, nothing half-made.

:func:`clean_temp` removes this shard's staging directories (``<id>/.tmp-shard-<k>-of-<n>-*``)
that a crash left behind; other shards' are theirs to clean (they may be writing now).
:func:`prune_checkpoints` keeps this shard's ``keep`` newest checkpoint parts and every
part they chain to (an incremental's parents), and removes its older parts. Parts of job
checkpoints (``<id>/job.json``) are left alone: the job's retention
(:func:`services.common.checkpoints.prune_job_checkpoints`) removes those whole.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from services.common.checkpoints import JOB_MANIFEST
from services.ps.checkpoint import list_checkpoints

__all__ = ["clean_temp", "prune_checkpoints"]

log = logging.getLogger("persimmon.ps.retention")


def clean_temp(root: Path | str, shard_id: int, num_shards: int) -> list[Path]:
    """Remove this shard's staging directories under ``root``; returns what was removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for staging in root.glob(f"*/.tmp-shard-{shard_id}-of-{num_shards}-*"):
        shutil.rmtree(staging, ignore_errors=True)
        removed.append(staging)
    if removed:
        log.info("removed %d staging directories a crash left: %s", len(removed),
                 [str(p) for p in removed])
    return removed


def prune_checkpoints(root: Path | str, shard_id: int, num_shards: int, keep: int) -> list[str]:
    """Remove this shard's parts of all but its ``keep`` newest checkpoints (0: keep all),
    never a part a kept incremental chains to, nor a job checkpoint's; a checkpoint
    directory left empty goes too. Returns the ids whose part was removed."""
    if keep <= 0:
        return []
    root = Path(root)
    part = f"shard-{shard_id}-of-{num_shards}"
    known = list_checkpoints(root)  # oldest first
    mine = [c for c in known
            if any(p.shard_id == shard_id and p.num_shards == num_shards
                   for p in c.parts) and not (root / c.checkpoint_id / JOB_MANIFEST).exists()]
    parents = {c.checkpoint_id: c.parent for c in known}
    needed: set[str] = set()
    for checkpoint in mine[-keep:]:
        current: str | None = checkpoint.checkpoint_id
        while current is not None and current not in needed:
            needed.add(current)
            current = parents.get(current)
    removed = []
    for checkpoint in mine[:-keep]:
        checkpoint_id = checkpoint.checkpoint_id
        if checkpoint_id in needed:
            continue
        shutil.rmtree(root / checkpoint_id / part, ignore_errors=True)
        try:
            (root / checkpoint_id).rmdir()  # only when no other part is left
        except OSError:
            pass
        removed.append(checkpoint_id)
    if removed:
        log.info("pruned checkpoints %s (keeping the newest %d)", removed, keep)
    return removed
