"""``persimmon bench train``: Persimmon's training throughput against the peers a user would
pick instead, same batches, same model, same cores.

Every way of :data:`RUNS`, in one run:

- peers (:mod:`bench.peers`): ``local`` (plain torch at one thread: ``nn.EmbeddingBag``,
  mean pooling, sparse gradients, Adagrad, the dense net under Adam), ``torch`` (the same
  with one thread per core) and ``torchrec`` (TorchRec DMP, fused kernel, row-wise Adagrad,
  one thread per core; where installed). Ids are mapped to rows before the clock starts (the
  favourable case for them).
- Persimmon, one worker (this process). ``default`` is what ``persimmon train`` does on one
  machine: one PS shard embedded in the worker's process, hybrid with head ids synchronous
  (read and updated by the compute thread); ``sync_embedded`` and ``hybrid_embedded`` (S=8
  on every row) the same placement in the other modes. ``hybrid``, ``hybrid_hot``,
  ``hybrid_replica`` and ``sync`` are the remote path: 2 shard processes (nice 10, as
  background work beside a trainer should run) over gRPC, the worker's PS traffic in its
  child process (``ps_process``).

Keys: ``vs_torchrec`` / ``vs_torch`` = Persimmon's fastest run / the peer's;
``default_vs_torchrec`` and ``sync_vs_torchrec`` the default and sync (embedded) runs against
TorchRec; ``embedded_vs_processes`` = sync embedded / sync over gRPC; ``vs_local`` = hybrid
/ local and ``hybrid_vs_sync``, ``hot_vs_sync``, ``replica_vs_sync`` on the remote path (S=8
on every row; head ids synchronous through the PS; head ids synchronous in a replica on the
worker, ``persimmon train``'s default there: against sync). ``--profile criteo`` trains on the Criteo-shaped
planted profile, ``toy`` on the small one.

``--rtt-ms 0,0.5,2`` repeats the remote path's hybrid, hybrid-with-head-ids and sync runs
with the shards behind a latency-injecting proxy (:mod:`bench.netem`; no kernel netem here):
``rtt`` rows of ``{rtt_ms, measured_rtt_ms, hybrid_vs_sync, hot_vs_sync, replica_vs_sync,
auc_hybrid, auc_hot, auc_replica, auc_sync}``. The proxy's process shares the cores, which a real network would not.
``--rtt-ways hybrid_replica,sync`` runs only those ways there (sync and any of the others),
``--only-rtt`` runs those alone (as on a lent GPU machine without the peers), ``--device``
puts Persimmon's dense compute on the CPU or a GPU, ``--hot-staleness`` sets the head ids'
bound; ``machine`` in the JSON names the CPU (and its widest vector ISA) and the device.

Each Persimmon run reports its compute thread's mean ``step_wall_ms`` and ``step_cpu_ms``,
where its step goes (``step_phases``: the wall and CPU ms of each phase), ``batch_wait_ms``,
its event loop's thread's CPU per step (``loop_cpu_ms``: the plans, lookups and pushes that
feed the steps), the CPU per training step (``cpu_ms_per_step``: worker with
its children, the PS processes) and the peak RSS of the PS processes (``ps_peak_rss_mb``); the
embedded runs report ``bytes_per_row`` (rows, optimizer state, index and slack of every table
over its live rows). ``peak_rss_mb`` is this process's peak over the whole run.

Machines drift (a shared 2-core VM by 10-30 % within a minute), so the runs are repeated in
turn (``--repeats``; every other repeat in reverse order): the table shows each way's median
run, and each ratio is the median of that ratio within each repeat. ``hybrid_vs_sync_ceiling``
bounds what hybrid mode could gain from the work measured: a step is no shorter than the CPU
per step over all processes divided by the cores, nor than the compute thread's CPU per step.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from bench import write_json
from bench.netem import LatencyProxy
from bench.peers import torch_baseline, torchrec_available, torchrec_baseline
from bench.procstats import cpu_seconds, memory_mb
from services.common.batch import Batch
from services.common.commands import int_at_least

__all__ = ["RUNS", "hybrid_ceiling", "machine", "median_run", "paired_ratios", "print_table",
           "register_bench", "rtt_row", "run"]

console = Console()
_PS_LR = 0.05
_DENSE_LR = 3e-3
PS_NICE = 10  # the shards run beside the worker at a lower priority, as a co-located PS should
RUNS = {  # key: what the table calls it
    "local": "plain torch, 1 thread: nn.EmbeddingBag + sparse Adagrad",
    "torch": "plain torch with every core's thread",
    "torchrec": "TorchRec DMP, fused kernel, row-wise Adagrad, every core's thread",
    "default": "Persimmon as `persimmon train` runs: shard embedded, staleness auto (S = 1)",
    "sync_embedded": "Persimmon, shard embedded, sync",
    "hybrid_embedded": "Persimmon, shard embedded, hybrid S=8 on every row",
    "hybrid": "Persimmon, 2 shard processes over gRPC, hybrid S=8 on every row",
    "hybrid_hot": "the same, hybrid with head ids synchronous (push-then-lookup chain)",
    "hybrid_replica": "the same, head ids synchronous in a replica on the worker (default)",
    "sync": "Persimmon, 2 shard processes over gRPC, sync",
}
_PERSIMMON_RUNS = {  # key: placement, mode, hot tables and head ids as by default (else none),
    # a replica of the head rows on the worker, the staleness
    "default": ("embedded", "hybrid", True, False, "auto"),
    "sync_embedded": ("embedded", "sync", False, False, 8),
    "hybrid_embedded": ("embedded", "hybrid", False, False, 8),
    "hybrid": ("processes", "hybrid", False, False, 8),
    "hybrid_hot": ("processes", "hybrid", True, False, 8),
    "hybrid_replica": ("processes", "hybrid", True, True, 8),
    "hybrid_auto": ("processes", "hybrid", True, True, "auto"),  # behind the proxy only
    "sync": ("processes", "sync", False, False, 8)}
# the ways behind the proxy (each paired with sync) and their names in the rtt rows' keys
_RTT_NAMES = {"hybrid": "hybrid", "hybrid_hot": "hot", "hybrid_replica": "replica",
              "hybrid_auto": "auto"}
_RTT_RUNS = (*_RTT_NAMES, "sync")


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
               seed: int, placement: str, mode: str, hot: bool, replica: bool = False,
               staleness: int | str = 8, rtt_ms: float | None = None,
               device: str | None = None, hot_staleness: int = 1) -> dict[str, Any]:
    """One Persimmon run; ``replica``: the worker keeps a replica of its head rows
    (``persimmon train``'s default for remote shards); ``staleness``: S, or ``auto`` (the
    window sized from the measured round trip); ``rtt_ms``: the shard processes behind a
    :class:`LatencyProxy`;
    ``device``: the worker's torch device (None: CUDA where there is one); ``hot_staleness``:
    the bound of the head ids (1: synchronous, the default)."""
    from services.local.processes import LocalPS
    from services.ps.inprocess import InProcessShards
    from services.ps.replica import HeadReplica
    from services.worker.config import TrainerConfig, ps_table_configs
    from services.worker.local_ranks import run_local_training
    from services.worker.models import ModelConfig

    tables = ps_table_configs(dict.fromkeys(features, dim), lr=_PS_LR)
    config = TrainerConfig(mode=mode, staleness=staleness, lr=_DENSE_LR, pooling="mean", seed=seed,
                           ps_process=placement == "processes", device=device,
                           hot_staleness=hot_staleness)
    if not hot:
        config = replace(config, hot_ratio=0.0, head_rate=0.0)
    train_on = dict(train_batches=train, eval_batches=test, model=ModelConfig(name="dlrm"),
                    config=config, head_replica=HeadReplica() if replica else None)
    if placement == "embedded":
        shards = InProcessShards(tables).warm_up()  # one shard, as `persimmon train` embeds
        summary = run_local_training(rows_client=shards, **train_on)
        stats = [t.stats() for shard in shards.shards for t in shard.tables.values()]
        return {**_summary_figures(summary), "cpu_ms_per_step": {
            "worker": summary["worker_cpu_ms_per_step"], "ps": 0.0}, "ps_peak_rss_mb": 0.0,
            "bytes_per_row": sum(t.bytes for t in stats) / max(1, sum(t.rows for t in stats))}
    with LocalPS(2, tables, nice=PS_NICE) as cluster:
        ps_pids = [p.pid for p in cluster.procs]
        before = [cpu_seconds(pid) for pid in ps_pids]
        if rtt_ms is None:
            summary = run_local_training(ps_addresses=cluster.addresses, **train_on)
            measured = None
        else:
            with LatencyProxy(cluster.addresses, rtt_ms=rtt_ms) as proxy:
                measured = proxy.measured_rtt_ms()
                summary = run_local_training(ps_addresses=proxy.addresses, **train_on)
        after = [cpu_seconds(pid) for pid in ps_pids]
        peak_rss = [memory_mb(pid, "VmHWM") for pid in ps_pids]
    ps_cpu = [b - a for a, b in zip(before, after, strict=True) if a is not None and b is not None]
    cpu = {"worker": summary["worker_cpu_ms_per_step"],  # over its training steps only
           # over the whole run (the evaluation too), per training step
           "ps": 1e3 * sum(ps_cpu) / summary["steps"] if len(ps_cpu) == len(ps_pids) else None}
    return {**_summary_figures(summary), "cpu_ms_per_step": cpu,
            "ps_peak_rss_mb": sum(peak_rss) if None not in peak_rss else None,
            **({} if measured is None else {"measured_rtt_ms": measured})}


def _summary_figures(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary[k] for k in ("samples_per_s", "auc", "staleness", "staleness_max",
                                    "step_wall_ms", "step_cpu_ms", "step_phases",
                                    "batch_wait_ms", "loop_cpu_ms")}


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
        repeats: int = 9, profile: str = "toy", rtt_ms: Sequence[float] = (),
        only_rtt: bool = False, device: str | None = None, hot_staleness: int = 1,
        rtt_ways: Sequence[str] = _RTT_RUNS) -> dict[str, Any]:
    """Train every way of :data:`RUNS` on the same batches of the planted ``profile``,
    ``repeats`` times in turn (then, for each of ``rtt_ms``, the remote path behind the
    latency proxy); the median run of each way and the median of each ratio within a
    repeat. TorchRec runs only where it is installed. ``only_rtt``: the runs behind the
    proxy only; ``device``: Persimmon's torch device (None: CUDA where there is one; the
    peers run on the CPU); ``hot_staleness``: the head ids' bound in the runs that have them;
    ``rtt_ways``: the ways run behind the proxy (sync and any of the others).

    Persimmon's torch runs one intra-op thread (2 cores: the PS work needs the other);
    ``local`` one, ``torch`` and ``torchrec`` one per core."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    _check_rtt_ways(rtt_ways)
    torch.set_num_threads(1)
    _warm_up_torch()
    from services.loader.planted import SyntheticDataset, synthetic_profile

    data = SyntheticDataset(synthetic_profile(profile, seed=seed))
    features = data.config.sparse_names
    train = list(data.batches(batch_size, rows))
    test = list(data.batches(4096, 16384, "test"))
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count()) or 1
    # untimed: the first runs in a process pay numba's and torch's one-time loading (seen as
    # a first repeat at half speed)
    _persimmon(train[:4], test[:1], features, dim, seed, *_PERSIMMON_RUNS["default"],
               device=device)
    if rtt_ms and "hybrid_replica" in rtt_ways:  # and the replica's kernels (remote runs only)
        _persimmon(train[:4], test[:1], features, dim, seed,
                   *_PERSIMMON_RUNS["hybrid_replica"], device=device)
    if not only_rtt:
        _baseline("local", train[:4], test[:1], features, dim, seed, cores)
    keys = [] if only_rtt else [k for k in RUNS if k != "torchrec" or torchrec_available()]
    ways = [(key, None) for key in keys] + [(key, r) for r in rtt_ms
                                            for key in _RTT_RUNS if key in rtt_ways]
    every: dict[tuple[str, float | None], list[dict[str, Any]]] = {w: [] for w in ways}
    for repeat in track(range(repeats), description="bench train repeats", console=console):
        # every other repeat in reverse order: a drift of the machine's speed within a repeat
        # favours neither side of a ratio over the whole run
        for key, rtt in (ways if repeat % 2 == 0 else reversed(ways)):
            done = (_persimmon(train, test, features, dim, seed, *_PERSIMMON_RUNS[key], rtt,
                               device, hot_staleness)
                    if key in _PERSIMMON_RUNS else
                    _baseline(key, train, test, features, dim, seed, cores))
            every[key, rtt].append(done)
            console.log(f"repeat {repeat}: {key}" + ("" if rtt is None else f" at RTT {rtt} ms")
                        + f": {done['samples_per_s']:,.0f} samples/s, AUC {done['auc']:.4f}")
    direct = {key: values for (key, rtt), values in every.items() if rtt is None}
    runs = {key: median_run(values) for key, values in direct.items()}
    for r in runs.values():
        r["ms_per_step"] = 1e3 * batch_size / r["samples_per_s"]
    per_repeat = paired_ratios(direct, batch_size, cores) if direct else {}
    return {"profile": profile, "rows": rows, "batch_size": batch_size, "repeats": repeats,
            "cores": cores, "machine": machine(device), "hot_staleness": hot_staleness,
            "peak_rss_mb": _self_peak_rss_mb(),
            "oracle_auc": data.oracle(16384)["auc"], "runs": runs,
            **{key: statistics.median(values) if values else None
               for key, values in per_repeat.items()},
            "ratios_per_repeat": per_repeat,
            "rtt": [rtt_row(r, {key: every[key, r] for key in _RTT_RUNS if key in rtt_ways})
                    for r in rtt_ms]}


def machine(device: str | None = None) -> dict[str, str]:
    """What ran the bench: the CPU's model name and the worker's torch device (figures of
    two machines compare only as ratios measured on each)."""
    from services.worker.models import pick_device

    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            info = {k.strip(): v.strip() for k, v in
                    (line.split(":", 1) for line in f if ":" in line)}
        cpu = info.get("model name", cpu)
        flags = set(info.get("flags", "").split())
    except OSError:
        pass
    vector = next((isa for isa in ("amx_tile", "avx512f", "avx2") if isa in flags), "")
    picked = pick_device(device)
    gpu = torch.cuda.get_device_name(picked) if picked.type == "cuda" else None
    return {"cpu": cpu + (f" ({vector})" if vector else ""),
            "device": str(picked) + (f" ({gpu})" if gpu else "")}


def _self_peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rtt_row(rtt_ms: float, every: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One ``rtt`` row: paired ratios and median AUCs of the runs behind the proxy, and each
    way's median run (``runs``: where its step's time went). ``every`` holds sync and any of
    the other ways; the figures of a way that did not run are None."""
    speed = {key: [r["samples_per_s"] for r in values] for key, values in every.items()}
    row: dict[str, Any] = {
        "rtt_ms": rtt_ms,
        "measured_rtt_ms": statistics.median(r["measured_rtt_ms"] for r in every["sync"])}
    for way, name in _RTT_NAMES.items():
        ran = way in every
        row[f"{name}_vs_sync"] = statistics.median(
            h / s for h, s in zip(speed[way], speed["sync"], strict=True)) if ran else None
        row[f"auc_{name}"] = statistics.median(r["auc"] for r in every[way]) if ran else None
    row["auc_sync"] = statistics.median(r["auc"] for r in every["sync"])
    row.update({f"samples_per_s_{key}": statistics.median(speed[key]) for key in every})
    row["runs"] = {key: median_run(values) for key, values in every.items()}
    return row


def paired_ratios(every: dict[str, list[dict[str, Any]]], batch_size: int, cores: int
                  ) -> dict[str, list[float]]:
    """Each ratio within each repeat: the runs of one repeat ran within a minute of each
    other, on the machine as it was then (no ceilings without the PS's CPU)."""
    speed = {key: [r["samples_per_s"] for r in values] for key, values in every.items()}
    out: dict[str, list[float]] = {
        "vs_local": [], "vs_torch": [], "vs_torchrec": [], "default_vs_torchrec": [],
        "sync_vs_torchrec": [], "embedded_vs_processes": [], "hybrid_vs_sync": [],
        "hot_vs_sync": [], "replica_vs_sync": [], "hybrid_vs_sync_ceiling": []}
    for i, hybrid in enumerate(speed["hybrid"]):
        sync = speed["sync"][i]
        out["vs_local"].append(hybrid / speed["local"][i])
        best = max(speed[k][i] for k in _PERSIMMON_RUNS if k in speed)
        for peer in ("torch", "torchrec"):  # Persimmon's fastest way against the peer
            if peer in speed:
                out[f"vs_{peer}"].append(best / speed[peer][i])
        if "torchrec" in speed:
            out["default_vs_torchrec"].append(speed["default"][i] / speed["torchrec"][i])
            out["sync_vs_torchrec"].append(speed["sync_embedded"][i] / speed["torchrec"][i])
        out["embedded_vs_processes"].append(speed["sync_embedded"][i] / sync)
        out["hot_vs_sync"].append(speed["hybrid_hot"][i] / sync)
        out["replica_vs_sync"].append(speed["hybrid_replica"][i] / sync)
        out["hybrid_vs_sync"].append(hybrid / sync)
        ceiling = hybrid_ceiling(every["hybrid"][i], 1e3 * batch_size / sync, cores)
        if ceiling is not None:
            out["hybrid_vs_sync_ceiling"].append(ceiling)
    return out


def print_table(result: dict[str, Any]) -> None:
    """``run``'s result as a person reads it: the runs, the ratios, the rtt rows."""
    table = Table(title=f"persimmon bench train ({result['rows']:,} planted rows, "
                        f"{result['profile']} profile, batch {result['batch_size']}, DLRM)")
    for column in ("run", "samples/s", "ms/step", "test AUC"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for key, name in RUNS.items():
        if key not in result["runs"]:
            continue
        r = result["runs"][key]
        table.add_row(name, f"{r['samples_per_s']:,.0f}", f"{r['ms_per_step']:.2f}",
                      f"{r['auc']:.4f}")
    if result["runs"]:
        console.print(table)
    for key in _PERSIMMON_RUNS:
        if key not in result["runs"]:
            continue
        r = result["runs"][key]
        cpu = r["cpu_ms_per_step"]
        ps = f"{cpu['ps']:.2f}" if cpu["ps"] is not None else "?"
        extra = (f"; {r['bytes_per_row']:.0f} bytes per stored row" if "bytes_per_row" in r
                 else f"; PS peak RSS {r['ps_peak_rss_mb']:.0f} MB")
        console.print(f"{key}: compute thread per step {r['step_wall_ms']:.2f} ms wall, "
                      f"{r['step_cpu_ms']:.2f} ms CPU; {r['batch_wait_ms']:.2f} ms waiting "
                      f"for a batch; CPU per step: worker {cpu['worker']:.2f} ms (its event "
                      f"loop {r['loop_cpu_ms']:.2f}), PS {ps} ms"
                      + extra)
        console.print("  its step, wall / CPU ms: " + ", ".join(
            f"{phase} {t['wall_ms']:.2f} / {t['cpu_ms']:.2f}"
            for phase, t in r["step_phases"].items()))
    figures = "   ".join(f"{key} {result[key]:.2f}" for key in (
        "vs_torchrec", "default_vs_torchrec", "sync_vs_torchrec", "vs_torch", "vs_local",
        "embedded_vs_processes", "hybrid_vs_sync", "hot_vs_sync", "replica_vs_sync",
        "hybrid_vs_sync_ceiling")
        if result.get(key) is not None)
    console.print(f"machine: {result['machine']['cpu']}, {result['cores']} cores; Persimmon "
                  f"on {result['machine']['device']}")
    console.print(f"medians of {result['repeats']} paired repeats: {figures}   (oracle AUC "
                  f"{result['oracle_auc']:.4f}; this process's peak RSS "
                  f"{result['peak_rss_mb']:.0f} MB)")
    for row in result["rtt"]:
        ran = [name for name in _RTT_NAMES.values() if row[f"{name}_vs_sync"] is not None]
        console.print(f"RTT {row['rtt_ms']} ms (measured {row['measured_rtt_ms']:.2f}): "
                      + ", ".join(f"{name}_vs_sync {row[f'{name}_vs_sync']:.2f}" for name in ran)
                      + "; AUC " + ", ".join(f"{name} {row[f'auc_{name}']:.4f}"
                                             for name in [*ran, "sync"]))
        steps = {key: row["runs"][key] for key in ("hybrid", "hybrid_replica")
                 if key in row["runs"]}
        if steps:
            console.print(f"  a step (median run), {' / '.join(steps)}: " + ", ".join(
                f"{label} " + " / ".join(f"{r[k]:.1f}" for r in steps.values()) + " ms"
                for label, k in (("computing", "step_wall_ms"), ("its CPU", "step_cpu_ms"),
                                 ("waiting for rows", "batch_wait_ms"),
                                 ("the event loop's CPU", "loop_cpu_ms"))))


def _main(args: argparse.Namespace) -> int:
    if args.only_rtt and not args.rtt_ms:
        console.print("persimmon bench train: error: --only-rtt needs --rtt-ms")
        return 2
    result = run(rows=args.rows, batch_size=args.batch_size, seed=args.seed,
                 repeats=args.repeats, profile=args.profile, rtt_ms=args.rtt_ms,
                 only_rtt=args.only_rtt, device=args.device, hot_staleness=args.hot_staleness,
                 rtt_ways=args.rtt_ways)
    print_table(result)
    write_json(result, args.json)
    return 0


def _check_rtt_ways(ways: Sequence[str]) -> None:
    """Raise ValueError unless ``ways`` holds sync (every ratio's pair) and known ways only."""
    if "sync" not in ways or not set(ways) <= set(_RTT_RUNS):
        raise ValueError(f"rtt_ways must hold sync and any of {','.join(_RTT_RUNS)}, "
                         f"got {','.join(ways) or 'none'}")


def _rtt_ways(text: str) -> list[str]:
    ways = [w.strip() for w in text.split(",") if w.strip()]
    try:
        _check_rtt_ways(ways)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return ways


def _rtt_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rtt-ms takes numbers like 0,0.5,2, got {text!r}"
                                         ) from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"--rtt-ms values must be >= 0, got {text!r}")
    return values


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="Persimmon's training throughput vs the peers")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--rows", type=int_at_least(1), default=524288,
                        help="planted training rows")
    parser.add_argument("--batch-size", type=int_at_least(1), default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="criteo", choices=["toy", "criteo"],
                        help="the planted data set (criteo: 26 features, up to 1M ids each)")
    parser.add_argument("--repeats", type=int_at_least(1), default=5,
                        help="runs of each way, in turn; the median is reported")
    parser.add_argument("--rtt-ms", type=_rtt_list, default=[],
                        help="also run the remote path behind a proxy adding these round-trip "
                             "times (comma-separated ms, e.g. 0,0.5,2)")
    parser.add_argument("--rtt-ways", type=_rtt_ways, default=list(_RTT_RUNS),
                        help="the ways run behind the proxy: sync and any of "
                             f"{','.join(_RTT_RUNS)} (default: all)")
    parser.add_argument("--only-rtt", action="store_true",
                        help="run only the remote path behind the proxy (needs --rtt-ms)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="Persimmon's torch device (default: CUDA where there is one; the "
                             "peers run on the CPU)")
    parser.add_argument("--hot-staleness", type=int_at_least(1), default=1,
                        help="the head ids' staleness bound in the runs that have them (default "
                             "1: synchronous, as persimmon train)")
    parser.set_defaults(func=_main)
