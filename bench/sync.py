"""``persimmon bench sync``: the dense sync strategies side by side, measured in one run.

Four gloo workers (forked once) train a DLRM on planted synthetic data against PS shard
processes, once per strategy (fresh PS tables each time, same batches, same seed):
``allreduce`` (DDP every step, the baseline), ``local_sgd`` (average every 8 steps),
``ds_sync`` (pairs, hypercube regrouping), ``shadow`` (background averaging) and ``gossip``
(ring). It reports samples/s, dense bytes per step (per worker), held-out AUC against the
data's oracle AUC and the final consensus distance, and plots AUC against samples seen.

The ``lamb_large_batch`` row: LAMB (``dense_optimizer=lamb``) at the batch size above and at
``lamb_scale`` (8) times it, on the same rows (so 1/8 of the steps), the large run's lr scaled
by the square root of the batch ratio (``lamb_base_batch``, the large-batch papers' rule) and
both warmed up over the first 10% of their steps; it reports each run's AUC and steps.

The planted data is small on purpose (:data:`services.local.compare.PLANTED`: 4 features,
vocabularies of 10-50 ids): a strategy that trains worse shows as a gap to the oracle.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import save_plot, write_json
from services.common.errors import ConfigError
from services.local.compare import STRATEGY_SETTINGS, TRAINING, train_configs
from services.worker.sync import STRATEGIES

__all__ = ["register_bench", "run"]

console = Console(stderr=True)


LAMB_LR = 1e-2  # the small-batch LAMB run's lr


def lamb_large_batch(*, rows: int, batch_size: int, eval_rows: int, workers: int,
                     scale: int) -> dict[str, Any]:
    """LAMB at ``batch_size`` and at ``scale`` times it (sqrt-scaled lr) on the same rows."""
    runs = []
    for batch in (batch_size, scale * batch_size):
        steps = rows // batch // workers
        config = replace(TRAINING, dense_optimizer="lamb", lr=LAMB_LR,
                         lamb_warmup_steps=max(1, steps // 10),
                         lamb_base_batch=batch_size * workers)
        [summary], oracle = train_configs([config], rows=rows, batch_size=batch,
                                          eval_rows=eval_rows, workers=workers)
        runs.append({"batch_size": batch, "steps": summary["steps"], "auc": summary["auc"],
                     "samples_per_s": summary["samples_per_s"]})
    small, large = runs
    return {"scale": scale, "small": small, "large": large,
            "auc_delta": large["auc"] - small["auc"],
            "steps_ratio": large["steps"] / small["steps"] if small["steps"] else 0.0}


def run(*, rows: int = 131_072, batch_size: int = 128, eval_rows: int = 16_384,
        workers: int = 4, evals: int = 8, strategies: Sequence[str] = tuple(STRATEGIES),
        lamb_scale: int = 8) -> dict[str, Any]:
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
    result = {"workers": workers, "rows": rows, "batch_size": batch_size,
              "oracle_auc": oracle, "strategies": out}
    if lamb_scale:
        result["lamb_large_batch"] = lamb_large_batch(
            rows=rows, batch_size=batch_size, eval_rows=eval_rows, workers=workers,
            scale=lamb_scale)
    return result


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
    lamb = result.get("lamb_large_batch")
    if lamb:
        small, large = lamb["small"], lamb["large"]
        console.print(f"lamb_large_batch: batch {large['batch_size']} per worker "
                      f"({lamb['scale']}x) AUC {large['auc']:.4f} in {large['steps']} steps vs "
                      f"batch {small['batch_size']} AUC {small['auc']:.4f} in {small['steps']} "
                      f"steps: ΔAUC {lamb['auc_delta']:+.4f}, steps x{lamb['steps_ratio']:.3f}")
    console.print("sync ms/step: time in communication (shadow: on its background thread); "
                  "blocking ms/step: the training thread inside the strategy after backward "
                  "and after the optimizer step (DDP's all-reduce waits inside backward).")


def _main(args: argparse.Namespace) -> int:
    result = run(rows=args.rows, batch_size=args.batch_size, eval_rows=args.eval_rows,
                 workers=args.workers, strategies=args.strategies.split(","),
                 lamb_scale=args.lamb_scale)
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
    parser.add_argument("--lamb-scale", type=int, default=8,
                        help="the lamb_large_batch row's batch multiple (0: no such row)")
    parser.set_defaults(func=_main)
