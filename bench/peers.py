"""The peers a user would train with instead of Persimmon, on the same batches and cores.

- :func:`torch_baseline`: plain torch, one ``nn.EmbeddingBag`` per feature (sparse gradients,
  ``torch.optim.Adagrad``) under the same dense model and Adam.
- :func:`torchrec_baseline`: TorchRec's ``DistributedModelParallel`` (one gloo rank) over an
  ``EmbeddingBagCollection`` with FBGEMM's fused table-batched kernel and exact row-wise
  Adagrad applied in the backward pass (TorchRec's recommended CPU/GPU set-up); the planner
  is constrained to the FUSED kernel (its default CPU plan picks a kernel whose backward is
  not registered, which trains nothing). A bench-only extra:
  ``pip install fbgemm-gpu-cpu==1.8.0 && pip install --no-deps torchrec==1.8.0`` and its
  small dependencies (docs/benchmarks.md).

Both map every hashed id to a row of its feature's vocabulary before the clock starts (the
favourable case for them: Persimmon's PS maps ids itself, in the timed loop) and time the
training loop only; both evaluate on the same held-out batches.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from services.common.batch import Batch
from services.common.scoring import auc

__all__ = ["PeerRun", "torch_baseline", "torchrec_available", "torchrec_baseline"]

PeerRun = dict[str, float]


def _vocabularies(batches: Sequence[Batch], features: list[str]) -> dict[str, np.ndarray]:
    return {f: np.unique(np.concatenate([b.sparse[f].values for b in batches]))
            for f in features}


def _rows_and_offsets(batch: Batch, features: list[str], vocab: dict[str, np.ndarray]
                      ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for f in features:
        jag = batch.sparse[f]
        rows = torch.from_numpy(np.searchsorted(vocab[f], jag.values).astype(np.int64))
        offsets = np.zeros(jag.lengths.size, dtype=np.int64)
        np.cumsum(jag.lengths[:-1], out=offsets[1:])
        out[f] = (rows, torch.from_numpy(offsets))
    return out


def _dense_model(features: list[str], dim: int, num_dense: int, seed: int,
                 dense_norm: bool = False) -> torch.nn.Module:
    from services.worker.models import ModelConfig

    torch.manual_seed(seed)
    return ModelConfig(name="dlrm", dense_norm=dense_norm).build(
        sparse_dims=dict.fromkeys(features, dim), num_dense=num_dense)


def torch_baseline(train: Sequence[Batch], test: Sequence[Batch], features: list[str], *,
                   dim: int, seed: int, ps_lr: float, dense_lr: float, threads: int,
                   dense_norm: bool = False) -> PeerRun:
    """Samples/s and test AUC of plain torch: EmbeddingBag (mean, sparse) + Adagrad
    (``dense_norm``: the DLRM standardises its dense input, as ``persimmon train``'s does)."""
    torch.set_num_threads(threads)
    vocab = _vocabularies([*train, *test], features)
    train_in = [(_rows_and_offsets(b, features, vocab), torch.tensor(b.dense),
                 torch.tensor(b.labels)) for b in train]
    model = _dense_model(features, dim, train[0].num_dense, seed, dense_norm)
    tables = torch.nn.ModuleDict({f: torch.nn.EmbeddingBag(vocab[f].size, dim, mode="mean",
                                                           sparse=True) for f in features})
    for t in tables.values():
        torch.nn.init.uniform_(t.weight, -0.01, 0.01)  # the PS tables' default initializer
    sparse_opt = torch.optim.Adagrad(list(tables.parameters()), lr=ps_lr)
    dense_opt = torch.optim.Adam(model.parameters(), lr=dense_lr, fused=True)
    started = time.perf_counter()
    for ids, dense, labels in train_in:
        pooled = {f: tables[f](*ids[f]) for f in features}
        loss = F.binary_cross_entropy_with_logits(model(pooled, dense), labels)
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
    seconds = time.perf_counter() - started
    with torch.no_grad():
        scores = [model({f: tables[f](*v) for f, v in
                         _rows_and_offsets(b, features, vocab).items()},
                        torch.tensor(b.dense)).numpy() for b in test]
    labels = np.concatenate([b.labels for b in test])
    return {"samples_per_s": sum(b.size for b in train) / seconds,
            "auc": auc(labels, np.concatenate(scores))}


def torchrec_available() -> bool:
    try:
        import torchrec  # noqa: F401
    except Exception:  # not installed, or a broken fbgemm build
        return False
    return True


class _TorchRecModel(torch.nn.Module):
    def __init__(self, ebc: torch.nn.Module, dense: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.dense = dense

    def forward(self, kjt: Any, dense: torch.Tensor) -> torch.Tensor:
        return self.dense(self.ebc(kjt).to_dict(), dense)


def _kjt(batch: Batch, features: list[str], vocab: dict[str, np.ndarray]) -> Any:
    from torchrec import KeyedJaggedTensor

    values = [np.searchsorted(vocab[f], batch.sparse[f].values).astype(np.int64)
              for f in features]
    lengths = [batch.sparse[f].lengths.astype(np.int64) for f in features]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=features, values=torch.from_numpy(np.concatenate(values)),
        lengths=torch.from_numpy(np.concatenate(lengths)))


def _init_single_rank_group() -> bool:
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    from services.common.ports import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    return True


def torchrec_baseline(train: Sequence[Batch], test: Sequence[Batch], features: list[str], *,
                      dim: int, seed: int, ps_lr: float, dense_lr: float, threads: int,
                      dense_norm: bool = False) -> PeerRun:
    """Samples/s and test AUC of TorchRec DMP with the fused kernel and row-wise Adagrad
    (``dense_norm`` as for :func:`torch_baseline`)."""
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.distributed.types import ShardingType
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    torch.set_num_threads(threads)
    vocab = _vocabularies([*train, *test], features)
    created = _init_single_rank_group()
    try:
        configs = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim,
                                      num_embeddings=int(vocab[f].size), feature_names=[f],
                                      pooling=PoolingType.MEAN) for f in features]
        torch.manual_seed(seed)
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        for p in ebc.parameters():
            torch.nn.init.uniform_(p, -0.01, 0.01)
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": ps_lr})
        model = _TorchRecModel(ebc, _dense_model(features, dim, train[0].num_dense, seed,
                                                 dense_norm))
        constraints = {c.name: ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value],
            compute_kernels=[EmbeddingComputeKernel.FUSED.value]) for c in configs}
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints)
        plan = planner.collective_plan(model, pg=dist.group.WORLD)
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan)
        dense_params = [p for n, p in dmp.named_parameters() if "ebc" not in n]
        dense_opt = torch.optim.Adam(dense_params, lr=dense_lr)
        train_in = [(_kjt(b, features, vocab), torch.tensor(b.dense), torch.tensor(b.labels))
                    for b in train]
        started = time.perf_counter()
        for kjt, dense, labels in train_in:
            loss = F.binary_cross_entropy_with_logits(dmp(kjt, dense), labels)
            dense_opt.zero_grad()
            loss.backward()  # the fused kernel updates the embedding rows here
            dense_opt.step()
        seconds = time.perf_counter() - started
        with torch.no_grad():
            scores = [dmp(_kjt(b, features, vocab), torch.tensor(b.dense)).numpy()
                      for b in test]
    finally:
        if created:
            dist.destroy_process_group()
    labels = np.concatenate([b.labels for b in test])
    return {"samples_per_s": sum(b.size for b in train) / seconds,
            "auc": auc(labels, np.concatenate(scores))}
