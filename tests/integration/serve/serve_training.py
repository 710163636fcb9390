"""Helpers of the serving integration tests: records, real PS shards, a trained model,
versions, and a server on port 0."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.batch import Batch
from services.loader import FeatureSpec
from services.ps.checkpoint import read_checkpoint
from services.ps.config import PSConfig
from services.ps.service import PSService
from services.ps.tables import TableConfig, initial_rows
from services.serve.config import ServeConfig
from services.serve.export import write_version
from services.serve.rows import TableRows
from services.serve.service import ServeService
from services.worker.models import ModelConfig
from services.worker.pooling import pool_batch
from services.worker.trainer import Trainer
from tests.conftest import eventually as _eventually

SPEC = FeatureSpec(layout="json", dense=["I1", "I2"], sparse=["C1", "C2", "C3"],
                   multi_hot={"C3": "|"}, buckets={"C2": 50})
TABLES = [TableConfig(name="C1", dim=8, seed=1),
          TableConfig(name="C2", dim=8, seed=2, initializer="normal", init_std=0.05),
          TableConfig(name="C3", dim=4, seed=3)]
DIMS = {t.name: t.dim for t in TABLES}


def model_config(name: str) -> ModelConfig:
    return ModelConfig(name=name, bottom_mlp=[16, 8], top_mlp=[8], deep_mlp=[16],
                       cross_layers=2)


def ps_initial_rows(config: Mapping[str, Any], ids: np.ndarray) -> np.ndarray:
    """What the CLI injects: the PS's own initial rows of a table config."""
    return initial_rows(TableConfig(**config), ids)


def read_shards(root: Path, checkpoint_id: str) -> dict[str, list[Any]]:
    """What the CLI injects: every shard's part of a PS checkpoint, as one shard."""
    return read_checkpoint(root, checkpoint_id, shard_id=0, num_shards=1)


def records(rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
    out = []
    for _ in range(n):
        tags = rng.integers(0, 20, size=int(rng.integers(0, 4)))
        out.append({"I1": int(rng.integers(0, 100)),
                    "I2": None if rng.random() < 0.2 else float(rng.random() * 5),
                    "C1": f"u{rng.integers(0, 30)}", "C2": int(rng.integers(0, 1000)),
                    "C3": "|".join(f"t{x}" for x in tags)})
    return out


def batch(batch_id: int, recs: list[dict[str, Any]], rng: np.random.Generator) -> Batch:
    """The training batch of ``recs``: featurized as the loader does (the spec's code)."""
    f = SPEC.records(recs)
    labels = (rng.random(len(recs)) < 0.3).astype(np.float32)
    return Batch(batch_id=batch_id, labels=labels, dense=f.dense, sparse=f.sparse)


async def trainer_probabilities(trainer: Trainer, recs: list[dict[str, Any]]) -> np.ndarray:
    """The trainer's own eval forward of ``recs``: PS lookups, its pooling, its model."""
    return await trainer_predict(trainer, batch(0, recs, np.random.default_rng(0)))


async def trainer_predict(trainer: Trainer, b: Batch) -> np.ndarray:
    """The trainer's own eval forward of batch ``b``."""
    plan = await trainer.pipeline.plan(b)
    rows = await trainer.pipeline.lookup(plan)
    assert trainer.module is not None
    trainer.module.eval()
    with torch.no_grad():
        pooled = pool_batch(plan, rows, mode=trainer.config.pooling)
        logits = trainer.module(pooled.pooled, torch.from_numpy(b.dense))
    return torch.sigmoid(logits).numpy()


@contextlib.asynccontextmanager
async def ps_shards(root: Path, num_shards: int = 2) -> AsyncIterator[list[PSService]]:
    """Real PS shards (gRPC and admin servers on port 0) checkpointing under ``root``."""
    shards = [PSService(PSConfig(shard_id=k, num_shards=num_shards, grpc_port=0, admin_port=0,
                                 checkpoint_dir=str(root), tables=list(TABLES)))
              for k in range(num_shards)]
    try:
        for s in shards:
            await s.start()
        yield shards
    finally:
        for s in shards:
            await s.close()


@contextlib.asynccontextmanager
async def server(model_dir: Path, **settings: Any) -> AsyncIterator[ServeService]:
    """A prediction server on port 0 over ``model_dir``."""
    config = ServeConfig(model_dir=str(model_dir), admin_port=0, grpc_port=0,
                         **{"watch_interval_s": 0.05, "max_wait_ms": 1.0, **settings})
    service = ServeService(config, initial_rows=ps_initial_rows)
    await service.start()
    try:
        yield service
    finally:
        await service.close()


def random_version(model_dir: Path, *, step: int, bias: float, seed: int = 0,
                   version_id: str | None = None) -> dict[str, Any]:
    """A DLRM version with random weights and rows whose output bias is ``bias`` (versions
    that differ only there answer every record differently)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    module = model_config("dlrm").build(sparse_dims=DIMS, num_dense=2)
    state = module.state_dict()
    last = max(k for k in state if k.startswith("top.") and k.endswith(".bias"))
    state[last] = torch.full_like(state[last], bias)
    tables = {}
    for t in TABLES:
        ids = rng.choice(2**20, size=50, replace=False).astype(np.uint64)
        tables[t.name] = TableRows(name=t.name, ids=ids, config=_dict(t),
                                   rows=rng.normal(size=(50, t.dim)).astype(np.float32))
    return write_version(model_dir, step=step, model=model_config("dlrm"), state=state,
                         features={f: f for f in DIMS}, num_dense=2, tables=tables, spec=SPEC,
                         version_id=version_id)


def _dict(config: TableConfig) -> dict[str, Any]:
    from services.common.config import config_to_dict

    return config_to_dict(config)


async def eventually(predicate: Callable[[], bool | Awaitable[bool]],
                     timeout: float = 20.0) -> None:
    """:func:`tests.conftest.eventually` with a longer default deadline (versions load
    slowly on shared cores)."""
    await _eventually(predicate, timeout)
