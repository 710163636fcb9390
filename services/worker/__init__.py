"""The NN worker: what a user's training script imports.

Usage::

    from services.worker import ModelConfig, Trainer, TrainerConfig

    async with Trainer(model=ModelConfig(name="dlrm"), ps_addresses=addresses,
                       config=TrainerConfig(mode="hybrid", staleness=8)) as trainer:
        summary = await trainer.fit(batches)

``RowsClient`` is the protocol a ``rows_client=`` of the Trainer implements (the PS's shards
in this process are one). Names load on first use (the Trainer pulls in torch;
``services.worker.config`` alone does not need it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.lazy import lazy_exports

if TYPE_CHECKING:
    from services.worker.config import TrainerConfig, ps_table_configs
    from services.worker.embedding.rows import RowsClient
    from services.worker.local_ranks import run_local_training
    from services.worker.models import ModelConfig
    from services.worker.summary import FitSummary, LossCurve
    from services.worker.sync import SyncConfig, SyncStrategy, make_sync
    from services.worker.trainer import Trainer

__all__ = [
    "FitSummary",
    "LossCurve",
    "ModelConfig",
    "RowsClient",
    "SyncConfig",
    "SyncStrategy",
    "Trainer",
    "TrainerConfig",
    "make_sync",
    "ps_table_configs",
    "run_local_training",
]

_HOME = {
    "FitSummary": "summary", "LossCurve": "summary", "ModelConfig": "models",
    "RowsClient": "embedding.rows", "SyncConfig": "sync", "SyncStrategy": "sync",
    "Trainer": "trainer", "TrainerConfig": "config", "make_sync": "sync",
    "ps_table_configs": "config", "run_local_training": "local_ranks",
}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _HOME)
