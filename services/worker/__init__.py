"""The NN worker: what a user's training script imports.

Usage::

    from services.worker import ModelConfig, Trainer, TrainerConfig

    async with Trainer(model=ModelConfig(name="dlrm"), ps_addresses=addresses,
                       config=TrainerConfig(mode="hybrid", staleness=8)) as trainer:
        summary = await trainer.fit(batches)

Names load on first use (the Trainer pulls in torch; ``services.worker.config`` alone does
not need it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.lazy import lazy_exports

if TYPE_CHECKING:
    from services.worker.config import TrainerConfig, ps_table_configs
    from services.worker.local_ranks import run_local_training
    from services.worker.models import ModelConfig
    from services.worker.pipeline import EmbeddingPipeline, Prepared
    from services.worker.pooling import BatchPlan, plan_batch, pool_batch
    from services.worker.summary import FitSummary, LossCurve
    from services.worker.sync import SyncConfig, SyncStrategy, make_sync
    from services.worker.trainer import Trainer

__all__ = [
    "BatchPlan",
    "EmbeddingPipeline",
    "FitSummary",
    "LossCurve",
    "ModelConfig",
    "Prepared",
    "SyncConfig",
    "SyncStrategy",
    "Trainer",
    "TrainerConfig",
    "make_sync",
    "plan_batch",
    "pool_batch",
    "ps_table_configs",
    "run_local_training",
]

_HOME = {
    "BatchPlan": "pooling", "EmbeddingPipeline": "pipeline", "FitSummary": "summary",
    "LossCurve": "summary", "ModelConfig": "models", "Prepared": "pipeline",
    "SyncConfig": "sync", "SyncStrategy": "sync", "Trainer": "trainer",
    "TrainerConfig": "config", "make_sync": "sync", "plan_batch": "pooling",
    "pool_batch": "pooling", "ps_table_configs": "config", "run_local_training": "local_ranks",
}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _HOME)
