"""The numba kernels of a training step, loaded (or compiled) before the first timed step.

numba compiles a kernel at the first call of each signature (``cache=True`` keeps it on
disk for later processes, but a first run, or a model of a new shape, compiles). Many of a
step's kernels take tuples whose lengths are the run's: one array per table of a request (the
PS's multi-table lookups and pushes), per feature pooled, per vector of DLRM's interaction,
per dim of its unrolled loop. Only a batch shaped like the run's calls them with their
signatures, so :func:`warm_up_step` runs one: a few samples cut from the first batch,
planned as every batch is, pooled from zero rows, through the model's forward and the
gradient of those rows; the rows clients whose kernels run in this process warm the
requests of the plan's groups of tables (:class:`services.worker.embedding.rows.WarmRows`), and the
head ids' kernels run once where the pipeline has head ids.

Nothing of the run changes: no row is looked up or pushed, the model runs in eval mode (no
statistic updated) and no parameter's gradient is kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from services.common.batch import Batch, Jagged
from services.worker.embedding.exchange import EmbeddingPath, PooledPath
from services.worker.embedding.pipeline import EmbeddingPipeline
from services.worker.embedding.rows import WarmRows
from services.worker.head_kernels import warm_up as warm_up_head_sets
from services.worker.pooling import BatchPlan

__all__ = ["WARM_UP_SAMPLES", "first_samples", "warm_up_step"]

# samples of the batch a warm-up step runs: more than 1, since an axis of length 1 can give
# an array another layout (another signature) than a whole batch gives it
WARM_UP_SAMPLES = 4


def first_samples(batch: Batch, size: int) -> Batch:
    """A copy of the first ``size`` samples of ``batch`` (all of them if it has fewer)."""
    n = min(size, batch.size)
    sparse = {}
    for name, feature in batch.sparse.items():
        total = int(feature.lengths[:n].sum(dtype=np.int64))
        sparse[name] = Jagged(feature.values[:total].copy(), feature.lengths[:n].copy())
    return Batch(batch_id=batch.batch_id, labels=batch.labels[:n].copy(),
                 dense=batch.dense[:n].copy(), sparse=sparse)


async def warm_up_step(pipeline: EmbeddingPipeline, module: nn.Module, batch: Batch,
                       device: torch.device) -> None:
    """Load or compile every kernel a training step of ``module`` on batches like ``batch``
    runs (see the module doc), after ``pipeline`` planned its first batch (which decides
    its groups of tables)."""
    tiny = first_samples(batch, WARM_UP_SAMPLES)
    plan = await pipeline.plan(tiny)
    groups = [list(group.layout.tables) for group in plan.groups]
    for client in pipeline.clients():
        if isinstance(client, WarmRows):
            await asyncio.to_thread(client.warm_up, groups)
    if pipeline.heads is not None:
        await asyncio.to_thread(warm_up_head_sets)
    rows = _zero_rows(pipeline.path, plan, pipeline.rows.dims)
    await asyncio.to_thread(_model_pass, module, pipeline.path, plan, rows, tiny, device)


def _zero_rows(path: EmbeddingPath, plan: BatchPlan, dims: Mapping[str, int]
               ) -> list[np.ndarray]:
    """Zero rows of each group of ``plan``, shaped as ``path`` looks them up."""
    out = []
    for group in plan.groups:
        count = (len(group.features) * plan.batch_size if isinstance(path, PooledPath)
                 else group.layout.ids.size)
        out.append(np.zeros((count, dims[group.layout.tables[0]]), dtype=np.float32))
    return out


def _model_pass(module: nn.Module, path: EmbeddingPath, plan: BatchPlan,
                rows: Sequence[np.ndarray], batch: Batch, device: torch.device) -> None:
    """Pool ``rows`` of ``batch``'s ``plan`` as a step does, run the model's forward and take
    the loss's gradient of the pooled rows only (no parameter's), in eval mode; the module's
    mode is put back."""
    training = module.training
    module.eval()
    try:
        pooled = path.pool(plan, rows, device=device)
        dense = torch.from_numpy(batch.dense).to(device)
        labels = torch.from_numpy(batch.labels).to(device)
        loss = F.binary_cross_entropy_with_logits(module(pooled.pooled, dense), labels)
        if loss.requires_grad:  # else no step's backward runs either
            torch.autograd.grad(loss, pooled.rows, allow_unused=True)
    finally:
        module.train(training)
