"""``persimmon bench sync``: the dense sync strategies side by side, measured in one run.

Four gloo workers (forked once) train a DLRM on planted synthetic data against PS shard
processes, once per strategy (fresh PS tables each time, same batches, same seed):
``allreduce`` (DDP every step, the baseline), ``local_sgd`` (average every 8 steps),
``ds_sync`` (pairs, hypercube regrouping), ``shadow`` (background averaging), ``gossip``
(ring), ``hierarchical`` (2 ranks per node) and ``sfb``. It reports samples/s,
dense bytes per step (per worker), held-out AUC against the data's oracle AUC and the final
consensus distance, and plots AUC against samples seen. Bytes crossing nodes per step (all
ranks) are reported for ``allreduce`` (every rank's payload enters the world collective) and
``hierarchical`` (the node leaders' only).

``--sfb`` adds :func:`sfb_rows` (allreduce against SFB on a wide DLRM at 16 rows per worker,
where SFB pays, with ``sfb_bytes_ratio``, and the layer arithmetic of the default DLRM at batch
2048, where it does not); ``--codecs`` adds :func:`lossy_averaging_rows` (every strategy x
dense codec, trained within the oracle's bound or refused by the config); ``--gadmm`` adds
:func:`gadmm_rows` (GADMM against all-reduce L-BFGS on logistic regression: rounds and bytes
to the centralised loss).

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

import torch
from rich.console import Console
from rich.table import Table

from bench import save_plot, write_json
from services.common.commands import int_at_least
from services.common.errors import ConfigError
from services.local.compare import STRATEGY_SETTINGS, TRAINING, train_configs
from services.worker.models import ModelConfig, build_model
from services.worker.sync import sfb_plan
from services.worker.sync.gadmm import (
    LogisticWorker,
    logistic_objective,
    planted_logistic,
    simulate,
)

__all__ = ["gadmm_rows", "register_bench", "run", "sfb_rows"]

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
        workers: int = 4, evals: int = 8,
        strategies: Sequence[str] = tuple(STRATEGY_SETTINGS), lamb_scale: int = 8
        ) -> dict[str, Any]:
    """Every strategy on the same data; the JSON-ready result (see the module docstring)."""
    unknown = sorted(set(strategies) - set(STRATEGY_SETTINGS))
    if unknown:
        raise ConfigError(f"unknown strategies {unknown}; available: {list(STRATEGY_SETTINGS)}")
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
                    "cross_node_bytes_per_step": _cross_node(name, sync, workers),
                    "curve": [{"samples": h["step"] * batch_size * workers, "auc": h["auc"]}
                              for h in s["history"]]})
    result = {"workers": workers, "rows": rows, "batch_size": batch_size,
              "oracle_auc": oracle, "strategies": out}
    if lamb_scale:
        result["lamb_large_batch"] = lamb_large_batch(
            rows=rows, batch_size=batch_size, eval_rows=eval_rows, workers=workers,
            scale=lamb_scale)
    return result


LOSSY_CODECS = ("none", "fp16", "dct", "qsgd")
AUC_BOUND = 0.01  # a strategy x codec pair trains within oracle - 0.01, or is refused


def lossy_averaging_rows(*, strategies: Sequence[str], codecs: Sequence[str] = LOSSY_CODECS,
                         rows: int, batch_size: int, eval_rows: int, workers: int
                         ) -> dict[str, Any]:
    """Every strategy x dense codec (``--dense-codec``): the config refused (its ConfigError)
    or trained on the same data, with its AUC and whether it is within ``AUC_BOUND`` of the
    oracle. ``lossy_averaging_ok``: every pair is one or the other."""
    steps = rows // batch_size // workers
    base = replace(TRAINING, eval_every=max(1, steps // 4))
    pairs, configs, refused = [], [], {}
    for name in strategies:
        for codec in codecs:
            try:
                configs.append(replace(base, sync=name, dense_codec=codec,
                                       **STRATEGY_SETTINGS[name]))
                pairs.append((name, codec))
            except ConfigError as exc:
                refused[(name, codec)] = exc.message
    summaries, oracle = train_configs(configs, rows=rows, batch_size=batch_size,
                                      eval_rows=eval_rows, workers=workers) \
        if configs else ([], float("nan"))
    trained = dict(zip(pairs, summaries, strict=True))
    out = []
    for name in strategies:
        for codec in codecs:
            if (name, codec) in refused:
                out.append({"strategy": name, "codec": codec, "refused": refused[name, codec]})
                continue
            s = trained[name, codec]
            out.append({"strategy": name, "codec": codec, "auc": s["auc"],
                        "bytes_per_step": s["sync"]["bytes_per_step"],
                        "within_bound": s["auc"] >= oracle - AUC_BOUND})
    return {"oracle_auc": oracle, "bound": AUC_BOUND, "rows": out,
            "lossy_averaging_ok": all("refused" in r or r["within_bound"] for r in out)}


def _cross_node(name: str, sync: dict[str, Any], workers: int) -> float | None:
    """Payload bytes per step crossing nodes, all ranks together (None: not node-aware)."""
    if name == "allreduce":
        return sync["bytes_per_step"] * workers
    if name == "hierarchical":
        return sync["cross_node_bytes"] / max(sync["steps"], 1)
    return None


SFB_WIDE = ModelConfig(name="dlrm", bottom_mlp=[512, 16], top_mlp=[512, 512])


def sfb_rows(*, rows: int = 8192, batch_size: int = 16, eval_rows: int = 16_384,
             workers: int = 4) -> dict[str, Any]:
    """allreduce (DDP) against sfb on :data:`SFB_WIDE` at small per-worker batches, and
    which layers of the default DLRM (Criteo: 13 dense, 26 tables of 16) SFB would factor
    at batch 2048 (none)."""
    steps = rows // batch_size // workers
    base = replace(TRAINING, eval_every=max(1, steps // 4))
    summaries, oracle = train_configs([replace(base, sync=n) for n in ("allreduce", "sfb")],
                                      rows=rows, batch_size=batch_size, eval_rows=eval_rows,
                                      workers=workers, model=SFB_WIDE)
    out = [{"name": name, "samples_per_s": s["samples_per_s"],
            "bytes_per_step": s["sync"]["bytes_per_step"], "auc": s["auc"]}
           for name, s in zip(("allreduce", "sfb"), summaries, strict=True)]
    default = build_model("dlrm", sparse_dims={f"C{i}": 16 for i in range(26)}, num_dense=13)
    return {"model": {"bottom_mlp": SFB_WIDE.bottom_mlp, "top_mlp": SFB_WIDE.top_mlp},
            "batch_size": batch_size, "oracle_auc": oracle, "runs": out,
            "sfb_bytes_ratio": out[0]["bytes_per_step"] / max(out[1]["bytes_per_step"], 1),
            "default_dlrm_at_2048": sfb_plan(default, 2048)}


def gadmm_rows(*, workers: int = 4, rows: int = 8192, dim: int = 16, l2: float = 1e-2,
               rho: float = 0.01, tols: Sequence[float] = (1e-3, 1e-6),
               max_rounds: int = 40) -> dict[str, Any]:
    """GADMM (the exact form, a chain in this process) against all-reduce L-BFGS (one
    all-reduce of the gradient and loss per function evaluation) on a non-iid logistic
    regression: rounds until every model is within each tolerance of scikit-learn's optimum,
    and the payload bytes per round of all workers together."""
    from sklearn.linear_model import LogisticRegression

    x, y = planted_logistic(rows, dim)
    clf = LogisticRegression(C=1 / (l2 * rows), fit_intercept=False, tol=1e-12, max_iter=1000)
    best = float(logistic_objective(torch.tensor(clf.fit(x.numpy(), y.numpy()).coef_[0]),
                                    x, y, total=rows, l2=l2))

    def gap(t: torch.Tensor) -> float:
        return float(logistic_objective(t.detach(), x, y, total=rows, l2=l2)) - best

    def first_below(gaps: list[float]) -> list[int | None]:
        return [next((i + 1 for i, g in enumerate(gaps) if g < tol), None) for tol in tols]

    chain = [LogisticWorker(xs, ys, index=i, world=workers, total=rows, rho=rho, l2=l2)
             for i, (xs, ys) in enumerate(zip(x.chunk(workers), y.chunk(workers), strict=True))]
    chain_gaps: list[float] = []
    sent = simulate(chain, max_rounds,
                    lambda r: chain_gaps.append(max(gap(w.theta) for w in chain)))
    w = torch.zeros(dim, dtype=torch.float64, requires_grad=True)
    lbfgs = torch.optim.LBFGS([w], lr=1, max_iter=max_rounds, tolerance_grad=1e-12,
                              tolerance_change=1e-14, line_search_fn="strong_wolfe")
    lbfgs_gaps: list[float] = []

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        loss = logistic_objective(w, x, y, total=rows, l2=l2)
        loss.backward()
        lbfgs_gaps.append(gap(w))
        return loss

    lbfgs.step(closure)
    return {"workers": workers, "rows": rows, "dim": dim, "tols": list(tols), "runs": [
        {"name": "gadmm", "rounds": first_below(chain_gaps),
         "bytes_per_round": sent / max_rounds, "peers_per_worker": "1-2 (chain neighbours)"},
        {"name": "allreduce_lbfgs", "rounds": first_below(lbfgs_gaps),
         "bytes_per_round": workers * (dim + 1) * 8, "peers_per_worker": "all (a collective)"}]}


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
    cross = {s["name"]: s["cross_node_bytes_per_step"] for s in result["strategies"]
             if s.get("cross_node_bytes_per_step") is not None}
    if cross:
        console.print("payload bytes crossing nodes per step (all ranks, 2 ranks per node): "
                      + ", ".join(f"{k} {v:,.0f}" for k, v in cross.items()))


def _print_extras(result: dict[str, Any]) -> None:
    """The --sfb, --codecs and --gadmm tables, when they ran."""
    if "lossy_averaging" in result:
        lossy = result["lossy_averaging"]
        table = Table(title=f"strategy x dense codec: trained within oracle "
                            f"{lossy['oracle_auc']:.4f} - {lossy['bound']}, or refused")
        for col in ("strategy", "codec", "AUC", "within", "dense bytes/step", "refused"):
            table.add_column(col)
        for r in lossy["rows"]:
            table.add_row(r["strategy"], r["codec"], f"{r['auc']:.4f}" if "auc" in r else "-",
                          str(r.get("within_bound", "-")),
                          f"{r['bytes_per_step']:,.0f}" if "bytes_per_step" in r else "-",
                          r.get("refused", ""))
        Console(width=170).print(table)
        console.print(f"lossy_averaging_ok: {lossy['lossy_averaging_ok']}")
    if "sfb" in result:
        sfb = result["sfb"]
        table = Table(title=f"SFB on DLRM bottom {sfb['model']['bottom_mlp']} top "
                            f"{sfb['model']['top_mlp']}, {sfb['batch_size']} rows per worker")
        for col in ("strategy", "samples/s", "dense bytes/step", "AUC"):
            table.add_column(col)
        for r in sfb["runs"]:
            table.add_row(r["name"], f"{r['samples_per_s']:,.0f}",
                          f"{r['bytes_per_step']:,.0f}", f"{r['auc']:.4f}")
        Console(width=150).print(table)
        console.print(f"sfb_bytes_ratio (allreduce bytes / sfb bytes): {sfb['sfb_bytes_ratio']:.2f}")
        layers = Table(title="default DLRM (13 dense, 26 tables of 16) at batch 2048")
        for col in ("layer m x n", "gradient floats", "factor floats", "SFB"):
            layers.add_column(col)
        for r in sfb["default_dlrm_at_2048"]:
            layers.add_row(f"{r['m']} x {r['n']}", f"{r['dense_floats']:,}",
                           f"{r['factor_floats']:,}", "yes" if r["sfb"] else "no")
        Console(width=150).print(layers)
    if "gadmm" in result:
        g = result["gadmm"]
        table = Table(title=f"GADMM vs all-reduce, logistic regression ({g['workers']} workers, "
                            f"{g['rows']:,} rows, d={g['dim']})")
        for col in ("method", *(f"rounds to {t:g}" for t in g["tols"]),
                    "bytes/round (all workers)", "peers per worker"):
            table.add_column(col)
        for r in g["runs"]:
            table.add_row(r["name"], *map(str, r["rounds"]), f"{r['bytes_per_round']:,.0f}",
                          r["peers_per_worker"])
        Console(width=150).print(table)


def _main(args: argparse.Namespace) -> int:
    result = run(rows=args.rows, batch_size=args.batch_size, eval_rows=args.eval_rows,
                 workers=args.workers, strategies=args.strategies.split(","),
                 lamb_scale=args.lamb_scale)
    if args.sfb:
        result["sfb"] = sfb_rows(workers=args.workers)
    if args.gadmm:
        result["gadmm"] = gadmm_rows(workers=args.workers)
    if args.codecs:
        result["lossy_averaging"] = lossy_averaging_rows(
            strategies=args.strategies.split(","), codecs=args.codecs.split(","),
            rows=args.rows, batch_size=args.batch_size, eval_rows=args.eval_rows,
            workers=args.workers)
    _print_table(result)
    _print_extras(result)
    png = save_plot(plot, result, args.plot, "sync")
    console.print(f"AUC against samples seen: {png}")
    write_json(result, args.json)
    return 0


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sync", help="dense sync strategies: throughput, bytes, AUC")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--plot", help="PNG path (default: in the temp dir)")
    parser.add_argument("--rows", type=int_at_least(1), default=131_072,
                        help="planted training rows")
    parser.add_argument("--eval-rows", type=int_at_least(1), default=16_384, help="held-out rows")
    parser.add_argument("--batch-size", type=int_at_least(1), default=128,
                        help="rows per worker step")
    parser.add_argument("--workers", type=int_at_least(1), default=4, help="gloo worker processes")
    parser.add_argument("--strategies", default=",".join(STRATEGY_SETTINGS),
                        help="comma-separated strategies to compare")
    parser.add_argument("--lamb-scale", type=int_at_least(1), default=8,
                        help="the lamb_large_batch row's batch multiple (0: no such row)")
    parser.add_argument("--sfb", action="store_true",
                        help="also: SFB on a wide DLRM at 16 rows per worker")
    parser.add_argument("--codecs", nargs="?", const=",".join(LOSSY_CODECS), default=None,
                        help="also: every strategy x these dense codecs, trained or refused "
                             f"(default {','.join(LOSSY_CODECS)})")
    parser.add_argument("--gadmm", action="store_true",
                        help="also: GADMM against all-reduce L-BFGS on logistic regression")
    parser.set_defaults(func=_main)
