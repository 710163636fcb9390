"""``persimmon bench sync``: the dense sync strategies side by side, measured in one run.

Four gloo workers (forked once) train a DLRM on planted synthetic data against PS shard
processes, once per strategy (fresh PS tables each time, same batches, same seed):
``allreduce`` (DDP every step, the baseline), ``local_sgd`` (average every 8 steps),
``ds_sync`` (pairs, hypercube regrouping), ``shadow`` (background averaging) and ``gossip``
(ring). It reports samples/s, dense bytes per step (per worker), held-out AUC against the
data's oracle AUC and the final consensus distance, and plots AUC against samples seen.

The planted data is small on purpose (:data:`PLANTED`: 4 features, vocabularies of 10-50
ids): its oracle AUC is reachable from a few ten thousand rows, so a strategy that trains
worse shows as a gap to the oracle rather than drowning in the finite-sample gap of
large vocabularies (with the default ``SyntheticConfig`` even a tuned logistic regression on
the one-hot ids stays 0.02 below the oracle at 32k rows).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import save_plot, write_json
from services.common.batch import Batch
from services.common.errors import ConfigError
from services.loader.synthetic import SyntheticConfig, SyntheticDataset
from services.processes import LocalPS
from services.worker.config import TrainerConfig, ps_table_configs
from services.worker.distributed import run_local_ranks
from services.worker.models import ModelConfig
from services.worker.sync import STRATEGIES
from services.worker.trainer import Trainer

__all__ = ["PLANTED", "STRATEGY_SETTINGS", "TRAINING", "register_bench", "run", "train_configs"]

console = Console(stderr=True)
_WARMUP_STEPS = 4

# Planted data whose oracle is reachable from small samples (see the module docstring); every
# teacher setting is spelled out so that changes to the defaults do not move these figures.
PLANTED = SyntheticConfig(seed=0, vocab_sizes=[10, 20, 30, 50], num_multi_hot=1, num_dense=2,
                          mean_multi_hot_length=3.0, max_multi_hot_length=8,
                          zipf_exponent=2.0, interaction_rank=4, weight_scale=1.0,
                          interaction_scale=0.2, dense_scale=0.5, bias=-1.0)
# Mean pooling matches the teacher (it averages a multi-hot feature's ids); lr 1e-2 because a
# short run gives the dense net only tens of Adam steps; mode "sync" because every batch
# reads the same few hot rows, where embedding staleness would blur the dense comparison.
TRAINING = TrainerConfig(mode="sync", lr=1e-2, pooling="mean")
STRATEGY_SETTINGS: dict[str, dict[str, Any]] = {
    "allreduce": {},
    "local_sgd": {"sync_period": 8},
    "ds_sync": {"sync_group_size": 2},
    "shadow": {},
    "gossip": {"gossip_topology": "ring"},
}


def _strip(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k != "losses"}


async def _train_one(rank: int, world: int, addresses: list[str], tables: dict[str, str],
                     config: TrainerConfig, model: ModelConfig, train: list[Batch],
                     test: list[Batch]) -> dict[str, Any]:
    async with Trainer(model=model, ps_addresses=addresses, tables=tables,
                       config=config) as trainer:
        return _strip(await trainer.fit(train[rank::world], eval_batches=test[rank::world]))


async def _train_all(rank: int, world: int, addresses: list[str], features: list[str],
                     configs: list[TrainerConfig], model: ModelConfig, train: list[Batch],
                     test: list[Batch]) -> list[dict[str, Any]]:
    warm = train[:_WARMUP_STEPS * world]
    await _train_one(rank, world, addresses, {f: f"warm_{f}" for f in features}, TRAINING,
                     model, warm, warm)
    return [await _train_one(rank, world, addresses, {f: f"r{k}_{f}" for f in features},
                             config, model, train, test)
            for k, config in enumerate(configs)]


def _rank_runs(rank: int, world: int, *args: Any) -> list[dict[str, Any]]:
    """One rank, one event loop: a short untimed warm-up (first-call costs of torch, gloo and
    the PS's compiled loops), then every config in turn, each on fresh PS tables (``r<k>_``)."""
    return asyncio.run(_train_all(rank, world, *args))


def train_configs(configs: Sequence[TrainerConfig], *, rows: int, batch_size: int = 128,
                  eval_rows: int = 16_384, workers: int = 4, data: SyntheticConfig = PLANTED,
                  model: ModelConfig | None = None, dim: int = 16, ps_lr: float = 0.05,
                  shards: int = 2, timeout_s: float = 600.0
                  ) -> tuple[list[dict[str, Any]], float]:
    """Train each config on the same planted batches with ``workers`` gloo ranks (forked once)
    against ``shards`` PS processes; returns rank 0's summary per config (``samples_per_s``
    summed over the ranks) and the oracle AUC of the held-out rows."""
    dataset = SyntheticDataset(data)
    train = list(dataset.batches(batch_size, rows))
    test = list(dataset.batches(4096, eval_rows, "test"))
    features = dataset.config.sparse_names
    prefixes = ["warm_", *(f"r{k}_" for k in range(len(configs)))]
    tables = [t for p in prefixes
              for t in ps_table_configs({f: dim for f in features}, prefix=p, lr=ps_lr)]
    with LocalPS(shards, tables) as ps:
        per_rank = run_local_ranks(_rank_runs, workers, ps.addresses, features, list(configs),
                                   model or ModelConfig(name="dlrm"), train, test,
                                   timeout_s=timeout_s)
    summaries = []
    for k in range(len(configs)):
        summary = dict(per_rank[0][k])
        summary["samples_per_s"] = sum(r[k]["samples_per_s"] for r in per_rank)
        summaries.append(summary)
    return summaries, dataset.oracle(eval_rows)["auc"]


def run(*, rows: int = 131_072, batch_size: int = 128, eval_rows: int = 16_384,
        workers: int = 4, evals: int = 8, strategies: Sequence[str] = tuple(STRATEGIES)
        ) -> dict[str, Any]:
    """Every strategy on the same data; the JSON-ready result (see the module docstring)."""
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        raise ConfigError(f"unknown strategies {unknown}; available: {list(STRATEGIES)}")
    steps = rows // batch_size // workers
    base = replace(TRAINING, eval_every=max(1, steps // evals))
    configs = [replace(base, sync=name, **STRATEGY_SETTINGS[name]) for name in strategies]
    summaries, oracle = train_configs(configs, rows=rows, batch_size=batch_size,
                                      eval_rows=eval_rows, workers=workers)
    out = []
    for name, s in zip(strategies, summaries, strict=True):
        sync = s["sync"]
        out.append({"name": name, "samples_per_s": s["samples_per_s"],
                    "bytes_per_step": sync["bytes_per_step"], "auc": s["auc"],
                    "consensus_distance": sync["consensus_distance"],
                    "sync_time_per_step": sync["sync_time_per_step"],
                    "blocking_time_per_step": sync["blocking_seconds"] / max(sync["steps"], 1),
                    "curve": [{"samples": h["step"] * batch_size * workers, "auc": h["auc"]}
                              for h in s["history"]]})
    return {"workers": workers, "rows": rows, "batch_size": batch_size,
            "oracle_auc": oracle, "strategies": out}


def plot(result: dict[str, Any], path: str) -> None:
    """Held-out AUC against training samples seen (all workers), one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in result["strategies"]:
        ax.plot([p["samples"] for p in s["curve"]], [p["auc"] for p in s["curve"]],
                marker="o", markersize=3, label=s["name"])
    ax.axhline(result["oracle_auc"], color="gray", linestyle="--", label="oracle AUC")
    ax.set(title=f"dense sync strategies, {result['workers']} workers",
           xlabel="training samples seen", ylabel="held-out AUC")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _print_table(result: dict[str, Any]) -> None:
    table = Table(title=f"persimmon bench sync ({result['workers']} gloo workers, "
                        f"{result['rows']:,} rows, oracle AUC {result['oracle_auc']:.4f})")
    for col in ("strategy", "samples/s", "vs allreduce", "dense bytes/step", "AUC",
                "gap to oracle", "consensus dist.", "sync ms/step", "blocking ms/step"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    base = next((s for s in result["strategies"] if s["name"] == "allreduce"), None)
    for s in result["strategies"]:
        ratio = f"{s['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        table.add_row(s["name"], f"{s['samples_per_s']:,.0f}", ratio,
                      f"{s['bytes_per_step']:,.0f}", f"{s['auc']:.4f}",
                      f"{result['oracle_auc'] - s['auc']:+.4f}",
                      f"{s['consensus_distance']:.2e}",
                      f"{1000 * s['sync_time_per_step']:.2f}",
                      f"{1000 * s['blocking_time_per_step']:.2f}")
    Console(width=150).print(table)
    console.print("sync ms/step: time in communication (shadow: on its background thread); "
                  "blocking ms/step: the training thread inside the strategy after backward "
                  "and after the optimizer step (DDP's all-reduce waits inside backward).")


def _main(args: argparse.Namespace) -> int:
    result = run(rows=args.rows, batch_size=args.batch_size, eval_rows=args.eval_rows,
                 workers=args.workers, strategies=args.strategies.split(","))
    _print_table(result)
    png = save_plot(plot, result, args.plot, "sync")
    console.print(f"AUC against samples seen: {png}")
    write_json(result, args.json)
    return 0


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sync", help="dense sync strategies: throughput, bytes, AUC")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--plot", help="PNG path (default: in the temp dir)")
    parser.add_argument("--rows", type=int, default=131_072, help="planted training rows")
    parser.add_argument("--eval-rows", type=int, default=16_384, help="held-out rows")
    parser.add_argument("--batch-size", type=int, default=128, help="rows per worker step")
    parser.add_argument("--workers", type=int, default=4, help="gloo worker processes")
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help="comma-separated strategies to compare")
    parser.set_defaults(func=_main)
