"""What serving and exports read of the PS, without torch: the initial rows of ids never
trained and a PS checkpoint's tables (``persimmon serve`` runs on the core install)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from services.ps.store import TableSnapshot

__all__ = ["ps_initial_rows", "ps_read_shards"]


def ps_initial_rows(config: Mapping[str, Any], ids: np.ndarray) -> np.ndarray:
    """The PS's own initial rows of ``ids`` in a table of ``config`` (a served model's rows
    for ids it has never trained)."""
    from services.ps.tables import TableConfig, initial_rows

    return initial_rows(TableConfig(**config), ids)


def ps_read_shards(root: Path | str, checkpoint_id: str) -> dict[str, list[TableSnapshot]]:
    """Every shard's part of PS checkpoint ``checkpoint_id`` under ``root``, read as one
    shard (what an export of the served model reads)."""
    from services.ps.checkpoint import read_checkpoint

    return read_checkpoint(root, checkpoint_id, shard_id=0, num_shards=1)
