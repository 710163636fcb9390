"""``persimmon bench train``: training throughput of Persimmon against a one-process torch model.

Same planted data, same DLRM, same batches, in one run:

- ``local``: the baseline, one process: ``nn.EmbeddingBag`` tables (mean pooling, sparse
  gradients, Adagrad) and the dense net under Adam. Ids are mapped to rows once, before the
  clock starts (the favourable case for the baseline).
- ``hybrid`` / ``sync``: one Persimmon worker (this process) against 2 PS shard processes,
  embeddings looked up and pushed over gRPC, PERSIA's hybrid mode with S = 8, then sync mode;
  the worker's PS traffic runs in its child process (``ps_process``), and the PS shards run
  at nice 10, as background work beside a trainer should.
- ``hybrid_in_process`` / ``sync_in_process``: the same with the PS client on the worker's
  own event loop.

Keys: ``vs_local`` = hybrid / local samples/s (goal >= 0.75), ``hybrid_vs_sync`` (goal >= 1.5;
the same system, only the mode differs) and ``hybrid_vs_fastest_sync`` (against whichever
sync run was faster). The hybrid runs bound every table by S (``hot_ratio=0``);
``hybrid_hot`` is hybrid as configured by default (hot tables synchronous), ``hot_vs_sync``
its ratio to sync. ``vs_torch`` and ``vs_torchrec``: Persimmon's fastest run against plain
torch and TorchRec (:mod:`bench.peers`) with one thread per core, same batches and model.
``--profile criteo`` trains on the Criteo-shaped planted profile instead of the toy one.

The default batch is 2048 rows, a small one for recommendation training; every step costs
Persimmon a message per shard whatever its size, so smaller batches lower ``vs_local``
(``--batch-size 512`` shows it). ``ms_per_step`` of each run is in the JSON: sync mode's step
minus hybrid's is what the PS round trips cost sync mode, the most hybrid mode can win back.
Persimmon runs also report their compute thread's mean ``step_wall_ms`` and ``step_cpu_ms``
(the difference: waiting for a core or the GIL), ``batch_wait_ms`` (waiting for a batch) and
the CPU spent per training step (``cpu_ms_per_step``: the worker with its child, the PS).

Machines drift (a shared 2-core VM by 10-30 % within a minute), so the runs are repeated in
turn (``--repeats``, default 9; every other repeat in reverse order): the table shows each
way's median run, and each ratio is the median of that ratio within each repeat (whose runs
shared the machine's state).

``hybrid_vs_sync_ceiling`` is the most hybrid mode could gain here, from the work measured: a
hybrid step cannot be shorter than the hybrid run's CPU per step over all processes divided by
the cores, nor than its compute thread's CPU per step; sync's step over that bound is the
ceiling. On few cores the PS processes compete with compute, so it stays well under 2.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from bench import write_json
from bench.peers import torch_baseline, torchrec_available, torchrec_baseline
from services.common.batch import Batch

__all__ = ["RUNS", "hybrid_ceiling", "median_run", "paired_ratios", "register_bench", "run"]

console = Console()
_PS_LR = 0.05
_DENSE_LR = 3e-3
PS_NICE = 10  # the shards run beside the worker at a lower priority, as a co-located PS should
RUNS = {  # key: what the table calls it
    "local": "plain torch, 1 thread: nn.EmbeddingBag + sparse Adagrad (baseline)",
    "torch": "plain torch with every core's thread",
    "torchrec": "TorchRec DMP, fused kernel, row-wise Adagrad, every core's thread",
    "hybrid": "Persimmon: 1 worker + 2 PS shards, hybrid S=8 on every table",
    "hybrid_hot": "the same, hybrid as by default (hot tables synchronous)",
    "sync": "Persimmon: 1 worker + 2 PS shards, sync",
    "hybrid_in_process": "the same, hybrid S=8 on every table, PS client in the worker process",
    "sync_in_process": "the same, sync, PS client in the worker process",
}
_PERSIMMON_RUNS = {  # key: mode, ps_process, hot_ratio
    "hybrid": ("hybrid", True, 0.0), "hybrid_hot": ("hybrid", True, None),
    "sync": ("sync", True, 0.0), "hybrid_in_process": ("hybrid", False, 0.0),
    "sync_in_process": ("sync", False, 0.0)}


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


def _persimmon(train: Sequence[Batch], test: Sequence[Batch], features: list[str], dim: int,
               seed: int, mode: str, ps_process: bool, hot_ratio: float | None
               ) -> dict[str, Any]:
    from services.local.processes import LocalPS
    from services.worker.config import TrainerConfig, ps_table_configs
    from services.worker.local import run_local_training
    from services.worker.models import ModelConfig

    tables = ps_table_configs(dict.fromkeys(features, dim), lr=_PS_LR)
    config = TrainerConfig(mode=mode, staleness=8, lr=_DENSE_LR, pooling="mean", seed=seed,
                           ps_process=ps_process)
    if hot_ratio is not None:
        config = replace(config, hot_ratio=hot_ratio)
    with LocalPS(2, tables, nice=PS_NICE) as cluster:
        ps_pids = [p.pid for p in cluster.procs]
        before = [_cpu_seconds(pid) for pid in ps_pids]
        summary = run_local_training(ps_addresses=cluster.addresses, train_batches=train,
                                     eval_batches=test, model=ModelConfig(name="dlrm"),
                                     config=config)
        after = [_cpu_seconds(pid) for pid in ps_pids]
    ps_cpu = [b - a for a, b in zip(before, after, strict=True) if a is not None and b is not None]
    cpu = {"worker": summary["worker_cpu_ms_per_step"],  # over its training steps only
           # over the whole run (the evaluation too), per training step
           "ps": 1e3 * sum(ps_cpu) / summary["steps"] if len(ps_cpu) == len(ps_pids) else None}
    return {"samples_per_s": summary["samples_per_s"], "auc": summary["auc"],
            "staleness_max": summary["staleness_max"], "cpu_ms_per_step": cpu,
            **{k: summary[k] for k in ("step_wall_ms", "step_cpu_ms", "batch_wait_ms")}}


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``; else None)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median samples/s (the lower middle one for an even count), with every
    run's samples/s beside it."""
    ordered = sorted(runs, key=lambda r: r["samples_per_s"])
    return {**ordered[(len(ordered) - 1) // 2],
            "samples_per_s_runs": [r["samples_per_s"] for r in runs]}


def hybrid_ceiling(hybrid: dict[str, Any], sync_ms_per_step: float, cores: int) -> float | None:
    """The most ``hybrid_vs_sync`` could be given the hybrid run's measured work: its step is
    at least its CPU per step over all processes / ``cores`` and at least its compute thread's
    CPU per step (None without the PS processes' CPU)."""
    cpu = hybrid["cpu_ms_per_step"]
    if cpu["ps"] is None:
        return None
    floor = max((cpu["worker"] + cpu["ps"]) / cores, hybrid["step_cpu_ms"])
    return sync_ms_per_step / floor


def _baseline(key: str, train: Sequence[Batch], test: Sequence[Batch], features: list[str],
              dim: int, seed: int, cores: int) -> dict[str, Any]:
    """One peer's run (:mod:`bench.peers`); torch is back at one thread afterwards."""
    peer = torchrec_baseline if key == "torchrec" else torch_baseline
    try:
        return peer(train, test, features, dim=dim, seed=seed, ps_lr=_PS_LR, dense_lr=_DENSE_LR,
                    threads=1 if key == "local" else cores)
    finally:
        torch.set_num_threads(1)


def run(*, rows: int = 524288, batch_size: int = 2048, dim: int = 16, seed: int = 0,
        repeats: int = 9, profile: str = "toy") -> dict[str, Any]:
    """Train every way of :data:`RUNS` on the same batches of the planted ``profile``,
    ``repeats`` times in turn; the median run of each way and the median of each ratio within
    a repeat. TorchRec runs only where it is installed.

    Persimmon's torch runs one intra-op thread (2 cores: the PS processes need the other);
    ``local`` one, ``torch`` and ``torchrec`` one per core."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    torch.set_num_threads(1)
    _warm_up_torch()
    from services.loader.synthetic import SyntheticDataset, synthetic_profile

    data = SyntheticDataset(synthetic_profile(profile, seed=seed))
    features = data.config.sparse_names
    train = list(data.batches(batch_size, rows))
    test = list(data.batches(4096, 16384, "test"))
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count()) or 1
    keys = [k for k in RUNS if k != "torchrec" or torchrec_available()]
    every: dict[str, list[dict[str, Any]]] = {key: [] for key in keys}
    for repeat in track(range(repeats), description="bench train repeats", console=console):
        # every other repeat in reverse order: a drift of the machine's speed within a repeat
        # favours neither side of a ratio over the whole run
        for key in (keys if repeat % 2 == 0 else reversed(keys)):
            every[key].append(
                _persimmon(train, test, features, dim, seed, *_PERSIMMON_RUNS[key])
                if key in _PERSIMMON_RUNS else
                _baseline(key, train, test, features, dim, seed, cores))
    runs = {key: median_run(values) for key, values in every.items()}
    for r in runs.values():
        r["ms_per_step"] = 1e3 * batch_size / r["samples_per_s"]
    per_repeat = paired_ratios(every, batch_size, cores)
    return {"profile": profile, "rows": rows, "batch_size": batch_size, "repeats": repeats,
            "cores": cores,
            "oracle_auc": data.oracle(16384)["auc"], "runs": runs,
            **{key: statistics.median(values) if values else None
               for key, values in per_repeat.items()},
            "ratios_per_repeat": per_repeat}


def paired_ratios(every: dict[str, list[dict[str, Any]]], batch_size: int, cores: int
                  ) -> dict[str, list[float]]:
    """Each ratio within each repeat: the runs of one repeat ran within half a minute of each
    other, on the machine as it was then (no ceilings without the PS's CPU)."""
    speed = {key: [r["samples_per_s"] for r in values] for key, values in every.items()}
    out: dict[str, list[float]] = {"vs_local": [], "vs_torch": [], "vs_torchrec": [],
                                   "hybrid_vs_sync": [], "hot_vs_sync": [],
                                   "hybrid_vs_fastest_sync": [], "hybrid_vs_sync_ceiling": []}
    for i, hybrid in enumerate(speed["hybrid"]):
        sync, in_process = speed["sync"][i], speed["sync_in_process"][i]
        out["vs_local"].append(hybrid / speed["local"][i])
        best = max(speed[k][i] for k in _PERSIMMON_RUNS if k in speed)
        for peer in ("torch", "torchrec"):  # Persimmon's fastest way against the peer
            if peer in speed:
                out[f"vs_{peer}"].append(best / speed[peer][i])
        if "hybrid_hot" in speed:
            out["hot_vs_sync"].append(speed["hybrid_hot"][i] / sync)
        out["hybrid_vs_sync"].append(hybrid / sync)
        out["hybrid_vs_fastest_sync"].append(hybrid / max(sync, in_process))
        ceiling = hybrid_ceiling(every["hybrid"][i], 1e3 * batch_size / sync, cores)
        if ceiling is not None:
            out["hybrid_vs_sync_ceiling"].append(ceiling)
    return out


def _print_table(result: dict[str, Any]) -> None:
    table = Table(title=f"persimmon bench train ({result['rows']:,} planted rows, "
                        f"batch {result['batch_size']}, DLRM)")
    for column in ("run", "samples/s", "ms/step", "test AUC"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for key, name in RUNS.items():
        if key not in result["runs"]:
            continue
        r = result["runs"][key]
        table.add_row(name, f"{r['samples_per_s']:,.0f}", f"{r['ms_per_step']:.2f}",
                      f"{r['auc']:.4f}")
    console.print(table)
    for key in _PERSIMMON_RUNS:
        r = result["runs"][key]
        cpu = r["cpu_ms_per_step"]
        ps = f"{cpu['ps']:.2f}" if cpu["ps"] is not None else "?"
        console.print(f"{key}: compute thread per step {r['step_wall_ms']:.2f} ms wall, "
                      f"{r['step_cpu_ms']:.2f} ms CPU; {r['batch_wait_ms']:.2f} ms waiting "
                      f"for a batch; CPU per step: worker {cpu['worker']:.2f} ms, PS {ps} ms")
    ceiling = result["hybrid_vs_sync_ceiling"]
    console.print(f"median of {result['repeats']} runs each   oracle AUC "
                  f"{result['oracle_auc']:.4f}   vs_local {result['vs_local']:.2f} (goal >= 0.75)"
                  f"   hybrid_vs_sync {result['hybrid_vs_sync']:.2f} (goal >= 1.5; ceiling on "
                  f"{result['cores']} cores from the work measured: "
                  f"{'?' if ceiling is None else f'{ceiling:.2f}'})   hybrid vs the fastest "
                  f"sync {result['hybrid_vs_fastest_sync']:.2f}")
    peers = "   ".join(f"{key} {result[key]:.2f}" for key in ("vs_torch", "vs_torchrec",
                                                              "hot_vs_sync")
                       if result.get(key) is not None)
    console.print(f"Persimmon's fastest run against the peers, and the default hybrid mode "
                  f"against sync: {peers}")


def _main(args: argparse.Namespace) -> int:
    result = run(rows=args.rows, batch_size=args.batch_size, seed=args.seed,
                 repeats=args.repeats, profile=args.profile)
    _print_table(result)
    write_json(result, args.json)
    return 0


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="worker + PS throughput vs one torch process")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--rows", type=int, default=524288, help="planted training rows")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="toy", choices=["toy", "criteo"],
                        help="the planted data set (criteo: 26 features, up to 1M ids each)")
    parser.add_argument("--repeats", type=int, default=9,
                        help="runs of each way, in turn; the median is reported")
    parser.set_defaults(func=_main)
