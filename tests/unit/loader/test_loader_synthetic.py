"""The planted data set: determinism, shape, an honest oracle, and files equal to memory."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from services.common.errors import ConfigError
from services.common.scoring import auc, logloss
from services.loader.parsers import TextParser
from services.loader.planted import (
    CHUNK_ROWS,
    SyntheticConfig,
    SyntheticDataset,
    format_criteo,
    synthetic_profile,
)


@pytest.fixture(scope="module")
def dataset() -> SyntheticDataset:
    return SyntheticDataset()


def test_same_seed_same_data_other_seed_other_data(dataset):
    again = SyntheticDataset(SyntheticConfig(seed=0)).teacher_chunk("train", 3)
    chunk = dataset.teacher_chunk("train", 3)
    np.testing.assert_array_equal(chunk.labels, again.labels)
    np.testing.assert_array_equal(chunk.raw_ids["C5"].values, again.raw_ids["C5"].values)
    other = SyntheticDataset(SyntheticConfig(seed=1)).teacher_chunk("train", 3)
    assert not np.array_equal(chunk.raw_ids["C5"].values, other.raw_ids["C5"].values)
    test = dataset.teacher_chunk("test", 3)
    assert not np.array_equal(chunk.raw_ids["C5"].values, test.raw_ids["C5"].values)
    rows = dataset.teacher_rows("train", CHUNK_ROWS + 100)
    assert rows.size == CHUNK_ROWS + 100
    np.testing.assert_array_equal(rows.labels[CHUNK_ROWS:], dataset.teacher_chunk(
        "train", 1).labels[:100])


def test_ids_are_zipf_and_multi_hot_lengths_vary(dataset):
    t = dataset.teacher_rows("train", 2 * CHUNK_ROWS)
    cfg = dataset.config
    for f, name in enumerate(cfg.sparse_names):
        ids = t.raw_ids[name]
        assert ids.values.max() < cfg.vocab_sizes[f]
        counts = np.sort(np.bincount(ids.values.astype(np.int64)))[::-1]
        # Zipf: the most frequent id is far more frequent than the 10th and the 100th
        assert counts[0] > 3 * counts[9] > 0 and counts[0] > 20 * max(counts[99], 1)
        if f < len(cfg.vocab_sizes) - cfg.num_multi_hot:
            assert (ids.lengths == 1).all()
        else:
            assert ids.lengths.min() == 1 and ids.lengths.max() <= cfg.max_multi_hot_length
            assert abs(ids.lengths.mean() - cfg.mean_multi_hot_length) < 0.2


def test_oracle_is_in_the_demo_range(dataset):
    oracle = dataset.oracle(20_000)
    assert 0.85 <= oracle["auc"] <= 0.9
    assert 0.1 < oracle["positive_rate"] < 0.5
    assert oracle["logloss"] < 0.5


def test_logistic_model_on_teacher_features_reaches_the_oracle(dataset):
    train = dataset.teacher_rows("train", 30_000)
    test = dataset.teacher_rows("test", 50_000)
    model = LogisticRegression(C=10.0, max_iter=500).fit(train.teacher_features(), train.labels)
    scores = model.predict_proba(test.teacher_features())[:, 1]
    oracle = dataset.oracle(50_000)
    assert abs(auc(test.labels, scores) - oracle["auc"]) < 0.01
    assert abs(logloss(test.labels, scores) - oracle["logloss"]) < 0.01
    # and the oracle is not trivial: the dense term alone is much weaker
    weak = LogisticRegression().fit(train.dense_term, train.labels)
    assert auc(test.labels, weak.predict_proba(test.dense_term)[:, 1]) < oracle["auc"] - 0.1


def test_files_parse_to_exactly_the_in_memory_rows(dataset, tmp_path):
    meta = dataset.write(tmp_path, train_rows=1000, test_rows=500)
    assert json.loads((tmp_path / "synthetic.json").read_text())["oracle"] == meta["oracle"]
    assert meta["source"].startswith("criteo:") and "multi_hot=," in meta["source"]
    data = (tmp_path / "train.txt").read_bytes()
    assert data.count(b"\n") == 1000
    parsed = TextParser(dataset.layout, dataset.transform).parse(data)
    memory = dataset.hashed(dataset.teacher_rows("train", 1000))
    assert not parsed.bad
    np.testing.assert_array_equal(parsed.labels, memory.labels)
    np.testing.assert_allclose(parsed.dense, memory.dense, rtol=1e-6)
    for name in dataset.config.sparse_names:
        np.testing.assert_array_equal(parsed.sparse[name].values, memory.sparse[name].values)
        np.testing.assert_array_equal(parsed.sparse[name].lengths, memory.sparse[name].lengths)
    assert format_criteo(dataset.teacher_rows("test", 500)) == (tmp_path / "test.txt").read_bytes()


def test_in_memory_batches(dataset):
    batches = list(dataset.batches(batch_size=3000, rows=10_000))
    assert [b.size for b in batches] == [3000, 3000, 3000, 1000]
    assert [b.batch_id for b in batches] == [0, 1, 2, 3]
    assert batches[0].feature_names == dataset.config.sparse_names
    assert batches[3].positions == {"synthetic:train": (9000, 9999)}
    assert batches[0].num_dense == dataset.config.num_dense


@pytest.mark.parametrize("kwargs", [dict(vocab_sizes=[]), dict(vocab_sizes=[1]),
                                    dict(num_multi_hot=9), dict(zipf_exponent=0.0),
                                    dict(mean_multi_hot_length=9.0), dict(weight_scale=-1.0)])
def test_bad_synthetic_configs(kwargs):
    with pytest.raises(ConfigError):
        SyntheticConfig(**kwargs)
    with pytest.raises(ConfigError, match="split must be one of"):
        SyntheticDataset().teacher_chunk("holdout", 0)


def test_the_validation_split_is_its_own_rows_of_the_same_teacher():
    dataset = SyntheticDataset()
    chunks = {split: dataset.teacher_chunk(split, 0) for split in ("train", "validation", "test")}
    again = dataset.teacher_chunk("validation", 0)
    assert np.array_equal(chunks["validation"].probs, again.probs)  # deterministic
    for other in ("train", "test"):
        assert not np.array_equal(chunks["validation"].probs, chunks[other].probs)


@pytest.fixture(scope="module")
def criteo() -> SyntheticDataset:
    return SyntheticDataset(synthetic_profile("criteo", max_vocab=200_000))


def test_criteo_profile_has_criteo_vocabularies_and_missing_counts(criteo):
    cfg = criteo.config
    assert len(cfg.sparse_names) == 26 and cfg.num_dense == 13 and cfg.num_multi_hot == 0
    assert max(cfg.vocab_sizes) == 200_000 and min(cfg.vocab_sizes) == 3
    t = criteo.teacher_rows("train", CHUNK_ROWS)
    missing = (t.dense_counts < 0).mean(axis=0)
    # I2 is never missing, I12 mostly, I1 about half the time
    assert missing[1] == 0 and missing[11] > 0.7 and 0.4 < missing[0] < 0.5
    # a capped feature sees many distinct ids in one chunk: a long Zipf tail
    assert np.unique(t.raw_ids["C3"].values).size > 2000
    oracle = criteo.oracle(20_000)
    assert 0.8 < oracle["auc"] < 0.95 and 0.1 < oracle["positive_rate"] < 0.45


def test_criteo_profile_files_keep_missing_values_empty(criteo, tmp_path):
    criteo.write(tmp_path, train_rows=300, test_rows=10)
    data = (tmp_path / "train.txt").read_bytes()
    first = data.split(b"\n")[0].split(b"\t")
    assert len(first) == 1 + 13 + 26
    parsed = TextParser(criteo.layout, criteo.transform).parse(data)
    memory = criteo.hashed(criteo.teacher_rows("train", 300))
    assert not parsed.bad
    np.testing.assert_allclose(parsed.dense, memory.dense, rtol=1e-6)
    teacher = criteo.teacher_rows("train", 300)
    assert (parsed.dense[teacher.dense_counts < 0] == 0).all()  # missing reads as log1p(0)
    assert (teacher.dense_counts < 0).any()


def test_unknown_profile_is_refused():
    with pytest.raises(ConfigError, match="profile"):
        synthetic_profile("avazu")
    with pytest.raises(ConfigError, match="max_vocab"):
        synthetic_profile("criteo", max_vocab=1)
    with pytest.raises(ConfigError, match="zipf"):
        synthetic_profile("criteo", zipf=float("nan"))
    with pytest.raises(ConfigError, match="dense_missing"):
        SyntheticConfig(num_dense=2, dense_missing=[0.5])


def test_synthetic_source_spec_picks_the_profile():
    from services.loader.config import LoaderConfig, SourceSpec
    from services.loader.sources.synthetic import SyntheticSource

    spec = SourceSpec.parse("synthetic:1000?profile=criteo&max_vocab=5000&zipf=1.2")
    source = SyntheticSource(spec, LoaderConfig(source=spec.text, seed=4))
    cfg = source.dataset.config
    assert len(cfg.vocab_sizes) == 26 and max(cfg.vocab_sizes) == 5000
    assert cfg.zipf_exponent == 1.2 and cfg.seed == 4
    for bad in ("synthetic:10?profile=avazu", "synthetic:10?zipf=steep",
                "synthetic:10?max_vocab=-3"):
        spec = SourceSpec.parse(bad)
        with pytest.raises(ConfigError):
            SyntheticSource(spec, LoaderConfig(source=spec.text))
