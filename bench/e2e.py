"""``python -m bench e2e``: the user's path, ``persimmon train`` on files end to end, against
TorchRec and plain torch given the same rows, model and cores.

    python -m bench e2e --json e2e.json    # 1,000,000 + 100,000 rows, every way, 3 repeats

It writes Criteo-layout files with ``persimmon synth --profile criteo`` (``--data-dir`` keeps
and reuses them), then runs ``persimmon train --model dlrm`` on them in a subprocess, each way
of :data:`WAYS`, timing the whole command (start-up, parsing, training, evaluation). A cold
run gets fresh empty ``PERSIMMON_CACHE_DIR`` (parsed columns) and ``NUMBA_CACHE_DIR``
(compiled kernels), as the first run after install; a warm run reuses the column cache an
untimed warm-up run filled (``--warm-dir`` keeps it) and numba's own cache, as a user's
next run does. Repeat r runs every way with ``--seed r
--data-seed r``, every other repeat in reverse order, the peers between the Persimmon runs.
The peers (:mod:`bench.peers`) train on the same files, parsed beforehand by the loader's
own parser into batches of ``persimmon train``'s default size (shuffled once, ``--seed``),
with the same DLRM (dim 16, standardising its dense input as ``persimmon train``'s does), dense
and PS learning rates, one torch thread per core; ``torchrec_e3`` makes 3 passes (samples/s
over all 3). Both evaluate on the test rows. ``--ways`` and ``--peers`` choose the runs.

Keys: ``runs`` holds each way's medians over the repeats: ``samples_per_s`` (training loop,
all workers), ``wall_s`` (the command), ``wall_samples_per_s`` (rows x epochs / wall_s),
``time_to_first_step_s``, ``batch_wait_ms``, ``cpu_s`` (the command and all its children),
``auc``; ``per_repeat`` the raw figures (with the summary's ``staleness``, ``cache``). Each ratio is the median of its within-repeat values
(``ratios_per_repeat``): ``e2e_vs_torchrec`` and ``e2e_vs_torch`` (default's samples/s /
the peer's), ``e2e_wall_vs_torchrec`` (default's wall_samples_per_s / TorchRec's samples/s),
``e2e_cold_vs_warm`` and ``e2e_cold_vs_warm_wall`` (default_cold / default, loop and wall),
``e2e_epochs3_vs_torchrec`` (default_e3 / torchrec_e3); ``e2e_default_auc_gap`` (sync AUC -
default AUC, paired by seed) and ``e2e_2w_default_auc_gap`` (sync_2w - default_2w).
``synth`` is the data's rows and oracle AUC, ``machine`` the CPU.

TorchRec is a bench-only extra: ``pip install fbgemm-gpu-cpu==1.8.0 && pip install --no-deps
torchrec==1.8.0 && pip install tensordict pyre-extensions torchmetrics tqdm``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import glob
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from rich.console import Console
from rich.table import Table

from bench import write_json
from bench.peers import torch_baseline, torchrec_available, torchrec_baseline
from bench.train import machine
from services.common.batch import Batch
from services.common.commands import int_at_least
from services.loader.batching import Rows
from services.loader.config import LoaderConfig
from services.loader.sources import make_source

__all__ = ["PEERS", "WAYS", "Way", "paired", "print_table", "register_bench", "run"]

console = Console()
_CLI = [sys.executable, "-m", "services.cli"]
_DIM = 16


@dataclass(frozen=True, slots=True)
class Way:
    """One way to run ``persimmon train``: its extra flags, cold or warm caches, epochs."""

    help: str
    flags: tuple[str, ...] = ()
    cold: bool = False
    epochs: int = 1


WAYS = {
    "default": Way("persimmon train as it comes (1 worker, hybrid), warm caches"),
    "default_cold": Way("the same, first run after install: empty caches", cold=True),
    "sync": Way("--mode sync", ("--mode", "sync")),
    "default_2w": Way("--workers 2", ("--workers", "2")),
    "sync_2w": Way("--mode sync --workers 2", ("--mode", "sync", "--workers", "2")),
    "default_e3": Way("--epochs 3", ("--epochs", "3"), epochs=3),
}
PEERS = {"torchrec": "TorchRec DMP, fused kernel, row-wise Adagrad",
         "torch": "plain torch: nn.EmbeddingBag, sparse Adagrad"}
_RATIOS = {  # name: (way, figure) / (way, figure), within one repeat
    "e2e_vs_torchrec": (("default", "samples_per_s"), ("torchrec", "samples_per_s")),
    "e2e_wall_vs_torchrec": (("default", "wall_samples_per_s"), ("torchrec", "samples_per_s")),
    "e2e_vs_torch": (("default", "samples_per_s"), ("torch", "samples_per_s")),
    "e2e_cold_vs_warm": (("default_cold", "samples_per_s"), ("default", "samples_per_s")),
    "e2e_cold_vs_warm_wall": (("default_cold", "wall_samples_per_s"),
                              ("default", "wall_samples_per_s")),
    "e2e_epochs3_vs_torchrec": (("default_e3", "samples_per_s"),
                                ("torchrec_e3", "samples_per_s")),
}
_GAPS = {"e2e_default_auc_gap": ("sync", "default"),  # name: AUC of one way - the other's
         "e2e_2w_default_auc_gap": ("sync_2w", "default_2w")}
_SUMMARY_KEYS = ("batch_wait_ms", "step_wall_ms", "worker_cpu_ms_per_step", "steps", "seconds",
                 "time_to_first_step_s", "staleness", "window_choice", "cache", "step_phases")
_FIGURES = ("samples_per_s", "wall_s", "wall_samples_per_s", "time_to_first_step_s",
            "batch_wait_ms", "cpu_s", "auc", "step_wall_ms", "worker_cpu_ms_per_step")


class Files(NamedTuple):
    """The data on disk: loader specs of the training and test files, training rows."""

    train: str
    test: str
    rows: int


def _synth(args: argparse.Namespace, out: str) -> tuple[Files, dict[str, Any]]:
    """Write the files with ``persimmon synth`` unless ``out`` holds them already; the specs
    and what ``synth`` reported (rows, oracle)."""
    meta_path = os.path.join(out, "synthetic.json")
    if os.path.isfile(meta_path):
        console.log(f"reusing the files in {out} (their synthetic.json says how many rows)")
    else:
        console.log(f"persimmon synth: {args.rows:,} + {args.test_rows:,} rows into {out}")
        subprocess.run([*_CLI, "synth", "--profile", "criteo", "--rows", str(args.rows),
                        "--test-rows", str(args.test_rows), "--max-vocab", str(args.max_vocab),
                        "--seed", str(args.seed), "--out", out],
                       check=True, stdout=subprocess.DEVNULL)
    with open(meta_path) as f:
        meta = json.load(f)
    query = meta["source"].partition("?")[2]  # the layout synth wrote (dense, sparse, ...)
    train, test = (f"criteo:{os.path.join(out, name)}?{query}"
                   for name in ("train.txt", "test.txt"))
    return (Files(train, test, int(meta["train_rows"])),
            {k: meta.get(k) for k in ("train_rows", "test_rows", "seed", "oracle")})


def _persimmon(way: Way, files: Files, seed: int, caches: str, tmp: str) -> dict[str, Any]:
    """One ``persimmon train`` command, its caches under ``caches``: its wall and CPU time
    (with all its children) and the figures of its summary."""
    summary_path, log_path = os.path.join(tmp, "summary.json"), os.path.join(tmp, "train.log")
    command = [*_CLI, "train", "--train-data", files.train, "--eval-data", files.test,
               "--model", "dlrm", "--summary-json", summary_path, "--seed", str(seed),
               "--data-seed", str(seed), *way.flags]
    env = {**os.environ, "PERSIMMON_CACHE_DIR": os.path.join(caches, "columns")}
    if way.cold:  # the first run after install: nothing compiled (warm runs use numba's own)
        env["NUMBA_CACHE_DIR"] = os.path.join(caches, "numba")
    children, before = _children(), resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - started
    _reap_orphans(children)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        with open(log_path) as log:
            tail = log.read()[-3000:]
        raise RuntimeError(f"{' '.join(command)} exited {code}; its output ends:\n{tail}")
    with open(summary_path) as f:
        summary = json.load(f)
    os.unlink(summary_path)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"samples_per_s": summary["samples_per_s"], "auc": summary["auc"], "wall_s": wall,
            "wall_samples_per_s": files.rows * way.epochs / wall, "cpu_s": cpu,
            **{k: summary.get(k) for k in _SUMMARY_KEYS}}


def _adopt_orphans() -> None:
    """Become the parent of descendants their own parent leaves behind (Linux's child
    subreaper): ``persimmon train``'s forkserver, which reaped its ranks and so holds their CPU
    time, outlives the command by a second or two."""
    try:
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):  # not Linux: cpu_s misses what such orphans used
        pass


def _children() -> set[int]:
    pids: set[int] = set()
    for path in glob.glob("/proc/self/task/*/children"):
        with open(path) as f:
            pids.update(int(pid) for pid in f.read().split())
    return pids


def _reap_orphans(earlier: set[int], timeout_s: float = 30.0) -> None:
    """Wait for the children this process adopted since ``earlier`` was listed to end, so that
    their CPU time reaches RUSAGE_CHILDREN and none runs into the next timed run."""
    deadline = time.monotonic() + timeout_s
    while (orphans := _children() - earlier) and time.monotonic() < deadline:
        for pid in orphans:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.05)
    if orphans:
        console.log(f"warning: processes {sorted(orphans)} of the last run still run")


def _run_way(key: str, files: Files, seed: int, warm: str, tmp: str) -> dict[str, Any]:
    way = WAYS[key]
    if not way.cold:
        return _persimmon(way, files, seed, warm, tmp)
    cold = tempfile.mkdtemp(prefix="cold-", dir=tmp)  # empty: nothing parsed nor compiled
    try:
        return _persimmon(way, files, seed, cold, tmp)
    finally:
        shutil.rmtree(cold, ignore_errors=True)


class PeerData(NamedTuple):
    """The files parsed for the peers: training batches (shuffled), test batches, features."""

    train: list[Batch]
    test: list[Batch]
    features: list[str]


def _parse(spec: str) -> tuple[Rows, list[str]]:
    """Every row of a file spec as the loader parses it (its own source and parser), in
    file order, and the sparse feature names."""
    async def read() -> tuple[Rows, list[str]]:
        source = make_source(LoaderConfig(source=spec))
        await source.start()
        parts = [Rows(labels=b.labels, dense=b.dense, sparse=b.sparse, positions=b.positions,
                      chunks=np.zeros(b.size, np.int64)) async for b in source.blocks()]
        return Rows.concat(parts), list(source.schema.sparse)

    return asyncio.run(read())


def _batches(rows: Rows, size: int) -> list[Batch]:
    return [rows.slice(start, min(start + size, rows.size)).to_batch(i, lambda _: "file")
            for i, start in enumerate(range(0, rows.size, size))]


def _train_batch_size() -> int:
    """``persimmon train``'s default ``--batch-size``."""
    from services.worker.flags import add_training_flags

    parser = argparse.ArgumentParser()
    add_training_flags(parser)
    return int(parser.get_default("batch_size"))


def _peer_data(files: Files, seed: int, batch_size: int) -> PeerData:
    rows, features = _parse(files.train)
    rows = rows.take(np.random.default_rng(seed).permutation(rows.size))
    test, _ = _parse(files.test)
    return PeerData(_batches(rows, batch_size), _batches(test, 4096), features)


def _run_peer(key: str, data: PeerData, seed: int, *, small: bool = False) -> dict[str, Any]:
    """A peer's run (``torchrec_e3``: 3 passes over the rows); ``small``: a few batches,
    untimed (torch's and TorchRec's one-time loading)."""
    from services.worker.config import TrainerConfig
    from services.worker.models import ModelConfig

    name, _, epochs = key.partition("_e")
    train = data.train[:4] if small else data.train * int(epochs or 1)
    peer = torchrec_baseline if name == "torchrec" else torch_baseline
    logging.disable(logging.WARNING)  # TorchRec and FBGEMM log every table and plan
    try:
        return dict(peer(train, data.test[:1] if small else data.test, data.features, dim=_DIM,
                         seed=seed, ps_lr=ModelConfig(name="dlrm").ps_optimizer_defaults(
                             "adagrad")[0], dense_lr=TrainerConfig().lr,
                         threads=os.cpu_count() or 1, dense_norm=True))
    finally:
        logging.disable(logging.NOTSET)


def _order(ways: list[str], peers: list[str]) -> list[str]:
    """The runs of a repeat: the Persimmon ways with the peers' runs between them."""
    runs = [*peers, *(["torchrec_e3"] if "default_e3" in ways and "torchrec" in peers else [])]
    out: list[str] = []
    for i in range(max(len(ways), len(runs))):
        out += ways[i:i + 1] + runs[i:i + 1]
    return out


def _log_run(repeat: int, key: str, r: dict[str, Any]) -> None:
    wall = f", wall {r['wall_s']:.1f} s, CPU {r['cpu_s']:.1f} s" if "wall_s" in r else ""
    console.log(f"repeat {repeat}: {key}: {r['samples_per_s']:,.0f} samples/s{wall}, "
                f"AUC {r['auc']:.4f}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every chosen way and peer, ``args.repeats`` times in turn; see the module docstring."""
    peers = [p for p in args.peers if p != "torchrec" or torchrec_available()]
    _adopt_orphans()
    batch_size = _train_batch_size()
    with tempfile.TemporaryDirectory(prefix="persimmon-bench-e2e-") as tmp:
        files, synth = _synth(args, os.path.abspath(args.data_dir or os.path.join(tmp, "data")))
        warm = os.path.abspath(args.warm_dir or os.path.join(tmp, "warm"))
        data = PeerData([], [], [])
        if peers:
            console.log("parsing the files for the peers (untimed)")
            data = _peer_data(files, args.seed, batch_size)
            for peer in peers:  # untimed: their one-time loading
                _run_peer(peer, data, 0, small=True)
        if any(not WAYS[key].cold for key in args.ways):
            console.log("warm-up run (untimed): fills the warm caches")
            _run_way("default", files, 0, warm, tmp)
        order = _order(args.ways, peers)
        per_repeat: list[dict[str, dict[str, Any]]] = []
        for repeat in range(args.repeats):
            done: dict[str, dict[str, Any]] = {}
            for key in order if repeat % 2 == 0 else reversed(order):
                done[key] = (_run_way(key, files, repeat, warm, tmp) if key in WAYS else
                             _run_peer(key, data, repeat))
                _log_run(repeat, key, done[key])
            per_repeat.append({key: done[key] for key in order})
    ratios = paired(per_repeat)
    return {"rows": files.rows, "test_rows": synth["test_rows"], "batch_size": batch_size,
            "dim": _DIM, "repeats": args.repeats, "seeds": list(range(args.repeats)),
            "ways": list(args.ways), "peers": peers, "cores": os.cpu_count(),
            "machine": machine(), "synth": synth,
            "runs": {key: {f: _median([r[key].get(f) for r in per_repeat]) for f in _FIGURES}
                     for key in order},
            **{name: _median(values) for name, values in ratios.items()},
            "ratios_per_repeat": ratios, "per_repeat": per_repeat}


def _median(values: list[Any]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def paired(per_repeat: list[dict[str, dict[str, Any]]]) -> dict[str, list[float]]:
    """Each ratio and AUC gap within each repeat that ran both of its ways."""
    out = {name: [r[a][fa] / r[b][fb] for r in per_repeat if a in r and b in r]
           for name, ((a, fa), (b, fb)) in _RATIOS.items()}
    out.update({name: [r[a]["auc"] - r[b]["auc"] for r in per_repeat if a in r and b in r]
                for name, (a, b) in _GAPS.items()})
    return out


def _describe(key: str) -> str:
    if key in WAYS:
        return WAYS[key].help
    return PEERS[key.partition("_e")[0]] + (", 3 passes" if key.endswith("_e3") else "")


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(result: dict[str, Any]) -> None:
    """``run``'s result as a person reads it: a row per way and peer, then the ratios."""
    oracle = (result["synth"].get("oracle") or {}).get("auc")
    table = Table(title=f"persimmon bench e2e: persimmon train on {result['rows']:,} "
                        f"Criteo-layout rows, DLRM dim {result['dim']}, batch "
                        f"{result['batch_size']} (oracle AUC {_cell(oracle, '.4f')})")
    for column in ("way", "samples/s", "wall s", "wall samples/s", "first step s",
                   "batch wait ms", "CPU s", "test AUC"):
        table.add_column(column, justify="left" if column == "way" else "right",
                         no_wrap=column == "way")
    for key, r in result["runs"].items():
        table.add_row(key, _cell(r["samples_per_s"], ",.0f"),
                      _cell(r["wall_s"], ".1f"), _cell(r["wall_samples_per_s"], ",.0f"),
                      _cell(r["time_to_first_step_s"], ".2f"), _cell(r["batch_wait_ms"], ".2f"),
                      _cell(r["cpu_s"], ".1f"), _cell(r["auc"], ".4f"))
    console.print(table)
    console.print("; ".join(f"{key}: {_describe(key)}" for key in result["runs"]))
    figures = "   ".join(f"{name} {result[name]:+.4f}" if name in _GAPS
                         else f"{name} {result[name]:.2f}"
                         for name in (*_RATIOS, *_GAPS) if result[name] is not None)
    console.print(f"machine: {result['machine']['cpu']}, {result['cores']} cores; medians of "
                  f"{result['repeats']} paired repeats: {figures or 'none (no pair ran)'}")
    for name in _GAPS:
        if result["ratios_per_repeat"][name]:
            console.print(f"{name} per seed: " + ", ".join(
                f"{g:+.4f}" for g in result["ratios_per_repeat"][name]))


def _main(args: argparse.Namespace) -> int:
    result = run(args)
    print_table(result)
    write_json(result, args.json)
    return 0


def _names(known: dict[str, Any], flag: str) -> Any:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip() and n.strip() != "none"]
        unknown = [n for n in names if n not in known]
        if unknown or len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"{flag} takes distinct names of "
                                             f"{','.join(known)}, got {text!r}")
        return names
    return parse


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("e2e", help="persimmon train on files, end to end, vs the "
                                   "peers on the same rows")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--rows", type=int_at_least(1), default=1_000_000,
                        help="training rows written by persimmon synth")
    parser.add_argument("--test-rows", type=int_at_least(1), default=100_000)
    parser.add_argument("--max-vocab", type=int_at_least(2), default=1_000_000,
                        help="the largest vocabulary of the criteo profile")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the data and of the peers' shuffle")
    parser.add_argument("--data-dir", help="write the files here, or reuse the ones there "
                        "(default: a temporary directory)")
    parser.add_argument("--warm-dir", help="the warm runs' column cache (columns/), kept "
                        "(default: a temporary directory filled by the warm-up run)")
    parser.add_argument("--repeats", type=int_at_least(1), default=3,
                        help="runs of each way in turn, repeat r with --seed r --data-seed r")
    parser.add_argument("--ways", type=_names(WAYS, "--ways"), default=list(WAYS),
                        help=f"the Persimmon ways (default: {','.join(WAYS)})")
    parser.add_argument("--peers", type=_names(PEERS, "--peers"), default=list(PEERS),
                        help="the peers, or none (default: torchrec,torch; TorchRec where "
                             "installed)")
    parser.set_defaults(func=_main)
