"""``persimmon bench train``: training throughput of Persimmon against a one-process torch model.

Same planted data, same DLRM, same batches, in one run:

- ``local``: the baseline, one process: ``nn.EmbeddingBag`` tables (mean pooling, sparse
  gradients, Adagrad) and the dense net under Adam. Ids are mapped to rows once, before the
  clock starts (the favourable case for the baseline).
- ``hybrid`` / ``sync``: one Persimmon worker (this process) against 2 PS shard processes,
  embeddings looked up and pushed over gRPC, PERSIA's hybrid mode with S = 8, then sync mode.

Keys: ``vs_local`` = hybrid / local samples/s (goal >= 0.75), ``hybrid_vs_sync`` (goal >= 1.5).

The default batch is 2048 rows, a small one for recommendation training; every step costs
Persimmon two messages per shard whatever its size, so smaller batches lower ``vs_local``
(``--batch-size 512`` shows it). ``ms_per_step`` of each run is in the JSON: sync mode's step
minus hybrid's is what the PS round trips cost sync mode, the most hybrid mode can win back.
Persimmon runs also report their compute thread's mean ``step_wall_ms`` and ``step_cpu_ms``
(the difference: waiting for a core or the GIL) and ``batch_wait_ms`` (waiting for a batch).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from bench import write_json
from services.common.batch import Batch
from services.common.scoring import auc

__all__ = ["register_bench", "run"]

console = Console()
_PS_LR = 0.05
_DENSE_LR = 3e-3


def _warm_up_torch() -> None:
    """Pay torch's one-time lazy imports (the optimizers pull in torch._dynamo) before any
    clock starts, so that neither run is charged for them."""
    dense = torch.nn.Linear(2, 1)
    table = torch.nn.EmbeddingBag(4, 2, sparse=True)
    for opt, params in ((torch.optim.Adam, dense.parameters()),
                        (torch.optim.Adagrad, table.parameters())):
        optimizer = opt(params)
        dense(table(torch.tensor([[0, 1]]))).sum().backward()
        optimizer.step()


def _local_baseline(train: Sequence[Batch], test: Sequence[Batch], features: list[str],
                    dim: int, seed: int) -> dict[str, float]:
    """Samples/s and test AUC of the one-process torch model."""
    from services.worker.models import ModelConfig

    vocab = {f: np.unique(np.concatenate([b.sparse[f].values for b in (*train, *test)]))
             for f in features}

    def inputs(batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for f in features:
            jag = batch.sparse[f]
            rows = torch.from_numpy(np.searchsorted(vocab[f], jag.values).astype(np.int64))
            offsets = np.zeros(jag.lengths.size, dtype=np.int64)
            np.cumsum(jag.lengths[:-1], out=offsets[1:])
            out[f] = (rows, torch.from_numpy(offsets))
        return out

    train_in = [(inputs(b), torch.tensor(b.dense), torch.tensor(b.labels)) for b in train]
    torch.manual_seed(seed)
    tables = torch.nn.ModuleDict({f: torch.nn.EmbeddingBag(vocab[f].size, dim, mode="mean",
                                                           sparse=True) for f in features})
    for t in tables.values():
        torch.nn.init.uniform_(t.weight, -0.01, 0.01)  # the PS tables' default initializer
    model = ModelConfig(name="dlrm").build(sparse_dims=dict.fromkeys(features, dim),
                                           num_dense=train[0].num_dense)
    sparse_opt = torch.optim.Adagrad(list(tables.parameters()), lr=_PS_LR)
    dense_opt = torch.optim.Adam(model.parameters(), lr=_DENSE_LR, fused=True)  # as the Trainer
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
        scores = [model({f: tables[f](*v) for f, v in inputs(b).items()},
                        torch.tensor(b.dense)).numpy() for b in test]
    labels = np.concatenate([b.labels for b in test])
    return {"samples_per_s": sum(b.size for b in train) / seconds,
            "auc": auc(labels, np.concatenate(scores))}


def _persimmon(train: Sequence[Batch], test: Sequence[Batch], features: list[str], dim: int,
               seed: int, mode: str) -> dict[str, float]:
    from services.processes import LocalPS
    from services.worker.config import TrainerConfig, ps_table_configs
    from services.worker.local import run_local_training
    from services.worker.models import ModelConfig

    tables = ps_table_configs(dict.fromkeys(features, dim), lr=_PS_LR)
    config = TrainerConfig(mode=mode, staleness=8, lr=_DENSE_LR, pooling="mean", seed=seed)
    with LocalPS(2, tables) as cluster:
        summary = run_local_training(ps_addresses=cluster.addresses, train_batches=train,
                                     eval_batches=test, model=ModelConfig(name="dlrm"),
                                     config=config)
    return {"samples_per_s": summary["samples_per_s"], "auc": summary["auc"],
            "staleness_max": summary["staleness_max"],
            **{k: summary[k] for k in ("step_wall_ms", "step_cpu_ms", "batch_wait_ms")}}


def run(*, rows: int = 524288, batch_size: int = 2048, dim: int = 16, seed: int = 0
        ) -> dict[str, Any]:
    """Train the three ways on the same batches; the figures and their ratios.

    torch runs one intra-op thread in every run (2 cores: the PS processes need the other)."""
    torch.set_num_threads(1)
    _warm_up_torch()
    from services.loader.synthetic import SyntheticConfig, SyntheticDataset

    data = SyntheticDataset(SyntheticConfig(seed=seed))
    features = data.config.sparse_names
    train = list(data.batches(batch_size, rows))
    test = list(data.batches(4096, 16384, "test"))
    runs = {"local": _local_baseline(train, test, features, dim, seed),
            "hybrid": _persimmon(train, test, features, dim, seed, "hybrid"),
            "sync": _persimmon(train, test, features, dim, seed, "sync")}
    for r in runs.values():
        r["ms_per_step"] = 1e3 * batch_size / r["samples_per_s"]
    return {"rows": rows, "batch_size": batch_size, "oracle_auc": data.oracle(16384)["auc"],
            "runs": runs,
            "vs_local": runs["hybrid"]["samples_per_s"] / runs["local"]["samples_per_s"],
            "hybrid_vs_sync": runs["hybrid"]["samples_per_s"] / runs["sync"]["samples_per_s"]}


def _print_table(result: dict[str, Any]) -> None:
    table = Table(title=f"persimmon bench train ({result['rows']:,} planted rows, "
                        f"batch {result['batch_size']}, DLRM)")
    for column in ("run", "samples/s", "ms/step", "test AUC"):
        table.add_column(column, justify="left" if column == "run" else "right")
    names = {"local": "one process: nn.EmbeddingBag + sparse Adagrad (baseline)",
             "hybrid": "Persimmon: 1 worker + 2 PS shards, hybrid S=8",
             "sync": "Persimmon: 1 worker + 2 PS shards, sync"}
    for key, name in names.items():
        r = result["runs"][key]
        table.add_row(name, f"{r['samples_per_s']:,.0f}", f"{r['ms_per_step']:.2f}",
                      f"{r['auc']:.4f}")
    console.print(table)
    for key in ("hybrid", "sync"):
        r = result["runs"][key]
        console.print(f"{key}: compute thread per step {r['step_wall_ms']:.2f} ms wall, "
                      f"{r['step_cpu_ms']:.2f} ms CPU; {r['batch_wait_ms']:.2f} ms waiting "
                      "for a batch")
    console.print(f"oracle AUC {result['oracle_auc']:.4f}   vs_local "
                  f"{result['vs_local']:.2f} (goal >= 0.75)   hybrid_vs_sync "
                  f"{result['hybrid_vs_sync']:.2f} (goal >= 1.5)")


def _main(args: argparse.Namespace) -> int:
    result = run(rows=args.rows, batch_size=args.batch_size, seed=args.seed)
    _print_table(result)
    write_json(result, args.json)
    return 0


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="worker + PS throughput vs one torch process")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--rows", type=int, default=524288, help="planted training rows")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_main)
