"""``persimmon bench recovery``: a PS shard SIGKILLed mid-run, restarted from a job checkpoint.

Two runs of the same job (2 PS shard processes under :class:`~services.local.processes.LocalPS`
supervision, one worker, planted synthetic data, same seed): train, write a job checkpoint
(every PS shard + dense state), train on. The baseline run goes on undisturbed; in the other
run shard 1 is killed with SIGKILL mid-run, the supervisor restarts it from the checkpoint
(``--restore job``), the worker pauses on its retries, then finishes. Figures:

- ``recovered``: the interrupted run finished all its steps.
- ``lost_acked_updates``: updates acknowledged before the checkpoint and missing after the
  restart: rows of a probe table pushed before the checkpoint and read back after recovery,
  plus training rows read right after the checkpoint that differ in the checkpoint's files;
  with ``--wal`` also ``lost_after_checkpoint``.
- ``lost_after_checkpoint``: rows of a second probe pushed (and acknowledged) after the
  checkpoint, before the kill, that differ after recovery: what the restart from the
  checkpoint loses (all of them), 0 with ``--wal`` (the shards keep a write-ahead log and the
  supervisor restarts a dead one from it instead of ``--restore job``).
- ``recovery_s``: from the kill to the first training step done after the shard came back
  (or, when every step after the kill had its rows already, to the end of the fit, whose
  pushes waited for the shard).
- ``auc_delta``: held-out AUC of the baseline minus that of the interrupted run (goal
  <= 0.005): the cost of the post-checkpoint updates the killed shard lost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import tempfile
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bench import write_json
from services.common.commands import int_at_least
from services.common.sharding import shard_of
from services.worker.job_checkpoints import JobCheckpointer, dense_part

__all__ = ["register_bench", "run"]

console = Console(stderr=True)
KILLED = 1
PROBE_IDS = np.arange(1, 2049, dtype=np.uint64)
LATE_IDS = PROBE_IDS + 10_000  # the probe pushed after the checkpoint


def _pushed_ids(batches: list[Any], features: list[str]) -> dict[str, np.ndarray]:
    return {f: np.unique(np.concatenate([np.asarray(b.sparse[f].values, dtype=np.uint64)
                                         for b in batches])) for f in features}


def _missing_from_checkpoint(root: str, checkpoint_id: str,
                             acked: dict[str, tuple[np.ndarray, np.ndarray]]) -> int:
    """Acknowledged rows (read right after the checkpoint) absent or different in its files."""
    from services.ps.checkpoint import read_checkpoint

    missing = 0
    for k in range(2):
        parts = read_checkpoint(root, checkpoint_id, shard_id=k, num_shards=2)
        for table, (ids, rows) in acked.items():
            mine = shard_of(ids, 2) == k
            (snap,) = parts[table]
            saved = dict(zip(snap.ids.tolist(), snap.rows.astype(np.float32), strict=True))
            for row_id, row in zip(ids[mine].tolist(), rows[mine], strict=True):
                if row_id not in saved or not np.array_equal(saved[row_id], row):
                    missing += 1
    return missing


async def _job(args: argparse.Namespace, train: list[Any], test: list[Any],
               features: list[str], kill: bool) -> dict[str, Any]:
    from services.local.processes import LocalPS
    from services.worker.config import TrainerConfig, ps_table_configs
    from services.worker.models import ModelConfig
    from services.worker.trainer import Trainer

    tables = ps_table_configs({f: args.dim for f in features}, seed=args.seed)
    tables.append({"name": "probe", "dim": 4, "optimizer": {"kind": "sgd", "lr": 1.0}})
    cut = max(1, int(len(train) * args.checkpoint_at))
    kill_step = cut + max(1, int((len(train) - cut) * 0.5))
    config = TrainerConfig(mode=args.mode, staleness=args.staleness, seed=args.seed,
                           ps_retry_s=300.0)
    marks: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="persimmon-recovery-") as root, \
            tempfile.TemporaryDirectory(prefix="persimmon-wal-") as wal, \
            LocalPS(2, tables, checkpoint_dir=root, supervise=True,
                    wal_dir=wal if args.wal else None) as cluster:
        assert cluster.supervisor is not None
        restarts = cluster.supervisor.restarts

        def on_step(info: dict[str, Any]) -> None:
            if kill and info["step"] == kill_step and "kill" not in marks:
                os.kill(cluster.procs[KILLED].pid, signal.SIGKILL)
                marks["kill"] = time.monotonic()
            elif "kill" in marks and restarts and "resumed" not in marks:
                marks["resumed"] = time.monotonic()

        async with Trainer(model=ModelConfig(name="dlrm"), ps_addresses=cluster.addresses,
                           tables={f: f for f in features}, config=config,
                           on_step=on_step) as trainer:
            started = time.perf_counter()
            await trainer.fit(train[:cut])
            grads = np.random.default_rng(args.seed).normal(size=(PROBE_IDS.size, 4))
            await trainer.ps.push("probe", PROBE_IDS, grads)
            manifest = await JobCheckpointer(root, admin_urls=cluster.admin_urls).checkpoint(
                trainer.step, parts={"dense": dense_part(trainer.dense_state())})
            probe = await trainer.ps.lookup("probe", PROBE_IDS)
            acked = {f: (ids, await trainer.ps.lookup(f, ids))
                     for f, ids in _pushed_ids(train[:cut], features).items()}
            await trainer.ps.push("probe", LATE_IDS, grads)
            late = await trainer.ps.lookup("probe", LATE_IDS)
            summary = await trainer.fit(train[cut:], eval_batches=test)
            if "kill" in marks and "resumed" not in marks:  # the steps after the kill had
                marks["resumed"] = time.monotonic()  # their rows: fit's pushes waited instead
            seconds = time.perf_counter() - started
            probe_after = await trainer.ps.lookup("probe", PROBE_IDS)
            late_after = await trainer.ps.lookup("probe", LATE_IDS)
        lost = int(np.any(probe_after != probe, axis=1).sum())
        lost_late = int(np.any(late_after != late, axis=1).sum())
        lost += await asyncio.to_thread(_missing_from_checkpoint, root,
                                        manifest["checkpoint_id"], acked)
    return {"auc": summary.auc, "steps": cut + summary.steps, "seconds": seconds,
            "lost": lost, "lost_late": lost_late, "checkpoint_step": cut, "kill_step": kill_step if kill else None,
            "restarts": len(restarts),
            "recovery_s": marks["resumed"] - marks["kill"] if "resumed" in marks else None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from services.loader.planted import SyntheticConfig, SyntheticDataset

    dataset = SyntheticDataset(SyntheticConfig(seed=args.seed))
    features = list(dataset.config.sparse_names)
    train = list(dataset.batches(args.batch_size, args.rows, "train"))
    test = list(dataset.batches(4096, args.eval_rows, "test"))
    if len(train) < 4:
        raise ValueError("--rows must give at least 4 batches")
    console.print(f"baseline: {len(train)} steps, no failure")
    baseline = asyncio.run(_job(args, train, test, features, kill=False))
    console.print(f"interrupted: SIGKILL of PS shard {KILLED} mid-run")
    broken = asyncio.run(_job(args, train, test, features, kill=True))
    return {
        "recovered": broken["steps"] == len(train) and broken["restarts"] == 1,
        "lost_acked_updates": broken["lost"] + (broken["lost_late"] if args.wal else 0),
        "lost_after_checkpoint": broken["lost_late"],
        "wal": args.wal,
        "recovery_s": broken["recovery_s"],
        "auc_delta": baseline["auc"] - broken["auc"],
        "auc_baseline": baseline["auc"],
        "auc_interrupted": broken["auc"],
        "seconds_baseline": baseline["seconds"],
        "seconds_interrupted": broken["seconds"],
        "time_ratio": broken["seconds"] / baseline["seconds"],
        "steps": len(train),
        "checkpoint_step": broken["checkpoint_step"],
        "kill_step": broken["kill_step"],
        "mode": args.mode,
        "rows": args.rows,
    }


def _print(result: dict[str, Any]) -> None:
    table = Table(title="recovery: PS shard SIGKILLed mid-run vs an uninterrupted run")
    table.add_column("measure")
    table.add_column("interrupted", justify="right")
    table.add_column("baseline (same run)", justify="right")
    table.add_column("goal", justify="right")
    table.add_row("recovered", str(result["recovered"]), "", "true")
    table.add_row("lost acknowledged updates", str(result["lost_acked_updates"]), "", "0")
    table.add_row("lost, acked after the checkpoint", str(result["lost_after_checkpoint"]),
                  "", "0 with --wal")
    recovery = result["recovery_s"]
    table.add_row("recovery (kill -> training resumed)",
                  f"{recovery:.2f} s" if recovery is not None else "-", "", "")
    table.add_row("held-out AUC", f"{result['auc_interrupted']:.4f}",
                  f"{result['auc_baseline']:.4f}", "")
    table.add_row("AUC delta (baseline - interrupted)", f"{result['auc_delta']:+.4f}", "",
                  "<= 0.005")
    table.add_row("wall time", f"{result['seconds_interrupted']:.1f} s",
                  f"{result['seconds_baseline']:.1f} s", "")
    table.add_row("time ratio", f"{result['time_ratio']:.2f}x", "1.00x", "")
    console.print(table)


def _main(args: argparse.Namespace) -> int:
    result = run(args)
    _print(result)
    write_json(result, args.json)
    return 0 if result["recovered"] and result["lost_acked_updates"] == 0 else 1


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("recovery", help="kill a PS shard mid-run, restart, finish")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--rows", type=int_at_least(1), default=65536, help="planted training rows")
    parser.add_argument("--eval-rows", type=int_at_least(1), default=16384, help="held-out rows")
    parser.add_argument("--batch-size", type=int_at_least(1), default=256)
    parser.add_argument("--dim", type=int_at_least(1), default=16, help="embedding dimension")
    parser.add_argument("--mode", default="sync", choices=["sync", "hybrid", "async"],
                        help="sync (default) makes the two runs identical but for the kill")
    parser.add_argument("--staleness", type=int, default=8)
    parser.add_argument("--checkpoint-at", type=float, default=0.4,
                        help="fraction of the steps after which the checkpoint is taken")
    parser.add_argument("--wal", action="store_true",
                        help="the shards keep a write-ahead log; a dead one restarts from it")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_main)
