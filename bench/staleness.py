"""``persimmon bench staleness``: embedding staleness S against throughput and AUC, one run.

The same gloo workers (forked once) train a DLRM on the same planted batches against PS shard
processes (:class:`services.local.processes.LocalPS`), once per staleness bound, on fresh tables each
time: S = 0 is ``mode="sync"`` (the baseline: each lookup waits for every earlier push),
S = 1, 2, ..., 32 is ``mode="hybrid"`` with ``staleness=S`` and "unbounded" is
``mode="async"`` (lookups run ``prefetch`` batches ahead, pushes are never waited for).
Dense gradients are all-reduced every step in every run, so only the embedding staleness
changes. It reports samples/s (all workers), held-out AUC, the AUC gap to S = 0 and the
largest staleness a lookup really saw, and plots throughput and AUC against S.

``--data default`` (the default) is ``SyntheticConfig()``: 8 features with long-tailed
vocabularies, so a step has 8 tables of lookups and pushes to overlap with compute.
``--data small`` is :data:`services.local.compare.PLANTED`: 4 features of a few dozen ids,
so every batch reads and writes the same hot rows; ``--data criteo`` the Criteo-shaped profile
(26 features, vocabularies capped at 200k ids, Zipf 1.1).

The S rows bound every row (``hot_ratio=0``, ``head_rate=0``): they show what the window
costs. S = 0 (``sync``) misses none of a worker's own pushes; the ``global_sync`` row is
synchronous across the workers (every worker's push of step t applied before any lookup of step
t + 1), the baseline of a fair comparison with several workers. The last row is the default hybrid mode,
S = 8 with the head ids (ids seen in about every batch) at ``hot_staleness=1`` across the
workers (``global_hot``); ``--hot-staleness 1,2`` adds that row with the head ids' bound 2
(``"8+hot2"``: one of their pushes in flight).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import save_plot, write_json
from services.common.commands import int_at_least, ints_at_least
from services.common.errors import ConfigError
from services.loader.planted import SyntheticConfig, synthetic_profile
from services.local.compare import PLANTED, STRATEGY_SETTINGS, TRAINING, train_configs
from services.worker.config import TrainerConfig
from services.worker.embedding.bound import staleness_bound

__all__ = ["STALENESS", "default_row", "register_bench", "run", "staleness_config",
           "staleness_list"]

console = Console(stderr=True)
STALENESS: tuple[int | None, ...] = (0, 1, 2, 4, 8, 16, 32, None)   # None: unbounded
DATA = {"small": PLANTED, "default": SyntheticConfig(seed=0),
        "criteo": synthetic_profile("criteo", max_vocab=200_000)}
DEFAULT_ROW = "8+hot"  # the default hybrid settings, as the last row
GLOBAL_ROW = "global_sync"  # synchronous across the workers, before the default row
_ASYNC_PREFETCH = 64


def default_row(hot_staleness: int) -> str:
    """The row name of the default hybrid settings with the head ids' bound ``hot_staleness``
    (:data:`DEFAULT_ROW` for the default bound)."""
    return DEFAULT_ROW if hot_staleness == TrainerConfig().hot_staleness \
        else f"{DEFAULT_ROW}{hot_staleness}"


DEFAULT_S = 8  # the S of the "8+hot" rows


def window_of(s: int | str | None) -> int | None:
    """The window a row's lookups are bounded by (None: unbounded)."""
    if s is None:
        return None
    if s == GLOBAL_ROW or s == 0:
        return 1
    return DEFAULT_S if isinstance(s, str) else int(s)


def staleness_config(s: int | str | None, base: TrainerConfig = TRAINING) -> TrainerConfig:
    """S = 0: sync mode; S >= 1: hybrid with bound S on every row; None: async
    (unbounded); :data:`DEFAULT_ROW`: hybrid with S = 8 and head ids at ``hot_staleness``
    (the default before ``staleness auto``, which gives one worker on embedded shards S = 1), ``"8+hotK"`` the same with ``hot_staleness=K``; :data:`GLOBAL_ROW`:
    global_sync mode."""
    if s == GLOBAL_ROW:
        return replace(base, mode="global_sync", staleness=0)
    if s is None:
        return replace(base, mode="async", prefetch=_ASYNC_PREFETCH)
    if isinstance(s, str) and s.startswith(DEFAULT_ROW):
        defaults = TrainerConfig()
        hot = int(s[len(DEFAULT_ROW):] or defaults.hot_staleness)
        return replace(base, mode="hybrid", staleness=DEFAULT_S,
                       hot_ratio=defaults.hot_ratio, hot_staleness=hot,
                       head_rate=defaults.head_rate, global_hot=defaults.global_hot)
    if s == 0:
        return replace(base, mode="sync", staleness=0)
    return replace(base, mode="hybrid", staleness=int(s), hot_ratio=0.0, head_rate=0.0)


def run(*, rows: int = 65_536, batch_size: int = 128, eval_rows: int = 16_384,
        workers: int = 4, data: str = "default",
        staleness: tuple[int | None, ...] = STALENESS, seeds: int = 1,
        hot_staleness: tuple[int, ...] = (1,), sync: str = "allreduce",
        slow_worker: float = 1.0) -> dict[str, Any]:
    """Every bound on the same data, once per seed (the data set's and the dense model's);
    the JSON-ready result (see the module docstring). With several seeds, ``auc`` is the mean
    over the seeds and ``auc_gap`` the mean of the paired per-seed gaps to S = 0.
    ``hot_staleness``: the head ids' bounds of the default rows, one row each. ``sync``: the
    dense sync strategy of every row; ``slow_worker``: rank 0's steps take that many times
    as long. Each row reports what the PS counted: the most pushes of any one worker a
    lookup missed (``global_staleness_max``) against the row's ``bound``
    (:mod:`services.worker.embedding.bound`; None: async, no bound), and every worker's
    summed (``total_staleness_max``)."""
    if data not in DATA:
        raise ConfigError(f"unknown data {data!r}; available: {sorted(DATA)}")
    if seeds < 1:
        raise ConfigError(f"seeds must be >= 1, got {seeds}")
    if not hot_staleness or any(h < 1 for h in hot_staleness):
        raise ConfigError(f"hot_staleness must be ints >= 1, got {hot_staleness!r}")
    bounds = (*staleness, GLOBAL_ROW, *(default_row(h) for h in hot_staleness))
    per_seed, oracles = [], []
    for seed in range(seeds):
        base = replace(TRAINING, sync=sync, **STRATEGY_SETTINGS.get(sync, {}))
        configs = [replace(staleness_config(s, base), seed=seed) for s in bounds]
        summaries, oracle = train_configs(configs, rows=rows, batch_size=batch_size,
                                          eval_rows=eval_rows, workers=workers,
                                          data=replace(DATA[data], seed=seed), slow=slow_worker)
        per_seed.append(summaries)
        oracles.append(oracle)
    runs = []
    for k, s in enumerate(bounds):
        xs = [summaries[k] for summaries in per_seed]
        aucs = [x["auc"] for x in xs]
        base = [summaries[bounds.index(0)]["auc"] for summaries in per_seed] \
            if 0 in bounds else None
        gaps = [b - a for a, b in zip(aucs, base, strict=True)] if base else None
        runs.append({"staleness": s, "mode": xs[0]["mode"],
                     "samples_per_s": statistics.median(x["samples_per_s"] for x in xs),
                     "auc": statistics.fmean(aucs), "auc_per_seed": aucs,
                     "auc_gap": statistics.fmean(gaps) if gaps else None, "gap_per_seed": gaps,
                     "staleness_max": max(x["staleness_max"] for x in xs),
                     "staleness_mean": statistics.fmean(x["staleness_mean"] for x in xs),
                     "hot_tables": xs[0].get("hot_tables", []),
                     "head_ids": xs[0].get("head_ids", 0),
                     "window": window_of(s), "bound": _bound(staleness_config(s), workers),
                     **{key: max(x.get("ps_staleness", {}).get(key, 0) for x in xs)
                        for key in ("global_staleness_max", "total_staleness_max")}})
    bounded = [r for r in runs if r["bound"] is not None]
    return {"workers": workers, "rows": rows, "batch_size": batch_size, "data": data,
            "seeds": seeds, "sync": sync, "slow_worker": slow_worker,
            "oracle_auc": statistics.fmean(oracles), "runs": runs,
            "global_bound_holds": all(r["global_staleness_max"] <= r["bound"]
                                      for r in bounded)}


def _bound(config: TrainerConfig, workers: int) -> int | None:
    """The most pushes of any one worker a lookup of ``config`` may miss (None: async)."""
    bound = staleness_bound(config.mode, window=config.window, workers=workers,
                            global_bound=config.global_bound)
    return bound.any_worker if bound is not None else None


def _label(s: int | str | None) -> str:
    if s == DEFAULT_ROW:
        return f"8, head ids {TrainerConfig().hot_staleness} (default)"
    if isinstance(s, str) and s.startswith(DEFAULT_ROW):
        return f"8, head ids {s[len(DEFAULT_ROW):]}"
    if s == GLOBAL_ROW:
        return "0 across workers"
    return "unbounded" if s is None else str(s)


def plot(result: dict[str, Any], path: str) -> None:
    """samples/s and held-out AUC against S (evenly spaced, unbounded last)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    xs = list(range(len(runs)))
    labels = [_label(r["staleness"]) for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(xs, [r["samples_per_s"] for r in runs], marker="o")
    ax1.set(title="throughput", xlabel="embedding staleness S", ylabel="samples/s (all workers)")
    ax2.plot(xs, [r["auc"] for r in runs], marker="o", label="held-out AUC")
    ax2.axhline(result["oracle_auc"], color="gray", linestyle="--", label="oracle AUC")
    ax2.set(title="final AUC", xlabel="embedding staleness S", ylabel="AUC")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(xs, labels)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _print_table(result: dict[str, Any]) -> None:
    table = Table(title=f"persimmon bench staleness ({result['workers']} gloo workers, "
                        f"{result['rows']:,} rows of '{result['data']}' planted data, "
                        f"{result['seeds']} seed(s), "
                        f"oracle AUC {result['oracle_auc']:.4f})")
    for col in ("S", "mode", "samples/s", "vs S=0", "AUC", "gap to S=0", "own pushes missed",
                "bound", "PS: any worker's", "PS: all summed"):
        table.add_column(col, justify="right")
    base = next((r for r in result["runs"] if r["staleness"] == 0), None)
    for r in result["runs"]:
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        gap = f"{r['auc_gap']:+.4f}" if r["auc_gap"] is not None else "-"
        table.add_row(_label(r["staleness"]), r["mode"], f"{r['samples_per_s']:,.0f}", ratio,
                      f"{r['auc']:.4f}", gap, str(r["staleness_max"]),
                      "none" if r["bound"] is None else str(r["bound"]),
                      str(r["global_staleness_max"]), str(r["total_staleness_max"]))
    Console(width=170).print(table)
    print(f"sync {result['sync']}, rank 0 slowed {result['slow_worker']}x: no lookup missed "
          f"more than its bound of any one worker's pushes (global_staleness_max <= bound; "
          f"async: no bound): {result['global_bound_holds']}")


def staleness_list(text: str) -> tuple[int | None, ...]:
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip()
        if part in ("unbounded", "inf", "async"):
            out.append(None)
        elif part.isdigit():
            out.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"bad staleness {part!r}: an int >= 0 or 'unbounded'")
    return tuple(out)


def _factor(text: str) -> float:
    try:
        value = float(text.removesuffix("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad factor {text!r}: a number >= 1, e.g. 2x") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"bad factor {text!r}: a number >= 1, e.g. 2x")
    return value


def _main(args: argparse.Namespace) -> int:
    result = run(rows=args.rows, batch_size=args.batch_size, eval_rows=args.eval_rows,
                 workers=args.workers, data=args.data, staleness=args.staleness,
                 seeds=args.seeds, hot_staleness=args.hot_staleness, sync=args.sync,
                 slow_worker=args.slow_worker)
    _print_table(result)
    png = save_plot(plot, result, args.plot, "staleness")
    console.print(f"samples/s and AUC against S: {png}")
    write_json(result, args.json)
    return 0


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("staleness", help="embedding staleness S: throughput, AUC")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--plot", help="PNG path (default: in the temp dir)")
    parser.add_argument("--rows", type=int_at_least(1), default=65_536,
                        help="planted training rows")
    parser.add_argument("--eval-rows", type=int_at_least(1), default=16_384, help="held-out rows")
    parser.add_argument("--batch-size", type=int_at_least(1), default=128,
                        help="rows per worker step")
    parser.add_argument("--workers", type=int_at_least(1), default=4, help="gloo worker processes")
    parser.add_argument("--seeds", type=int_at_least(1), default=1,
                        help="data and model seeds 0..N-1: AUCs are means, gaps paired")
    parser.add_argument("--data", default="default", choices=sorted(DATA),
                        help="planted data: default (8 long-tailed features) or small")
    parser.add_argument("--staleness", type=staleness_list,
                        default=STALENESS, help="comma-separated S values ('unbounded' too)")
    parser.add_argument("--sync", default="allreduce", choices=sorted(STRATEGY_SETTINGS),
                        help="the dense sync strategy of every row")
    parser.add_argument("--slow-worker", type=_factor, default=1.0,
                        help="rank 0's steps take this many times as long (e.g. 2x)")
    parser.add_argument("--hot-staleness", type=ints_at_least(1), default=(1,),
                        help="comma-separated head-id bounds of the default row, one row each "
                             "(e.g. 1,2)")
    parser.set_defaults(func=_main)
