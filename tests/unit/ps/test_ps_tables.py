"""Table configs validate themselves; initial rows are deterministic per (seed, id)."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.config import config_to_dict, from_dict
from services.common.errors import ConfigError
from services.ps.tables import (
    Initializer,
    OptimizerConfig,
    OptimizerKind,
    TableConfig,
    admission_uniform,
    initial_rows,
)

IDS = np.array([0, 1, 2, 7, 2**63, 2**64 - 1, 123456789], dtype=np.uint64)


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "bad name", "dim": 4}, "table name"),
    ({"name": "", "dim": 4}, "table name"),
    ({"name": "t", "dim": 0}, "dim"),
    ({"name": "t", "dim": 4097}, "dim"),
    ({"name": "t", "dim": 4, "dtype": "int8"}, "dtype"),
    ({"name": "t", "dim": 4, "initializer": "xavier"}, "initializer"),
    ({"name": "t", "dim": 4, "init_low": 1.0, "init_high": 0.0}, "init_low"),
    ({"name": "t", "dim": 4, "admit_probability": 0.0}, "admit_probability"),
    ({"name": "t", "dim": 4, "admit_min_count": -1}, "admit_min_count"),
    ({"name": "t", "dim": 4, "max_rows": 0}, "max_rows"),
    ({"name": "t", "dim": 4, "ttl_s": -1.0}, "ttl_s"),
    ({"name": "t", "dim": 4, "eviction": "fifo"}, "eviction"),
    ({"name": "t", "dim": 4, "seed": -1}, "seed"),
])
def test_table_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TableConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "rmsprop"}, "kind"),
    ({"lr": -0.1}, "lr"),
    ({"lr": float("nan")}, "lr"),
    ({"kind": "ftrl", "lr": 0.0}, "lr"),
    ({"eps": 0.0}, "eps"),
    ({"beta1": 1.0}, "beta1"),
    ({"beta2": -0.1}, "beta2"),
    ({"weight_bound": 0.0}, "weight_bound"),
    ({"ftrl_beta": 0.0}, "ftrl_beta"),
])
def test_optimizer_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        OptimizerConfig(**kwargs)


def test_config_round_trips_through_dict_and_coerces_strings():
    cfg = TableConfig(name="user.v1", dim=8, dtype="float16", initializer="normal",
                      optimizer=OptimizerConfig(kind="ftrl", lr=0.1, ftrl_l1=0.5),
                      max_rows=100, eviction="lfu", ttl_s=3.5)
    assert cfg.initializer is Initializer.NORMAL
    assert cfg.optimizer.kind is OptimizerKind.FTRL
    again = from_dict(TableConfig, config_to_dict(cfg))
    assert again == cfg


@pytest.mark.parametrize("init", ["uniform", "normal", "zeros"])
def test_initial_rows_are_deterministic_per_seed_and_id(init):
    cfg = TableConfig(name="t", dim=16, initializer=init, seed=3)
    a = initial_rows(cfg, IDS)
    b = initial_rows(cfg, IDS[::-1])[::-1]  # order and batch composition do not matter
    c = initial_rows(cfg, IDS[2:3])
    assert a.dtype == np.float32 and a.shape == (IDS.size, 16)
    assert np.array_equal(a, b)
    assert np.array_equal(a[2:3], c)
    other_seed = initial_rows(TableConfig(name="t", dim=16, initializer=init, seed=4), IDS)
    if init == "zeros":
        assert not a.any()
    else:
        assert not np.array_equal(a, other_seed)
        assert len({row.tobytes() for row in a}) == IDS.size  # distinct ids, distinct rows


def test_uniform_and_normal_have_the_configured_distribution():
    ids = np.arange(20_000, dtype=np.uint64)
    uni = initial_rows(TableConfig(name="t", dim=8, init_low=-0.5, init_high=1.5), ids)
    assert uni.min() >= -0.5 and uni.max() < 1.5
    assert abs(uni.mean() - 0.5) < 0.01 and abs(uni.std() - 2 / np.sqrt(12)) < 0.01
    nor = initial_rows(TableConfig(name="t", dim=8, initializer="normal", init_std=2.0), ids)
    assert abs(nor.mean()) < 0.03 and abs(nor.std() - 2.0) < 0.03
    # columns are independent streams, not copies of each other
    assert abs(np.corrcoef(nor[:, 0], nor[:, 1])[0, 1]) < 0.03


def test_fp16_initial_rows_are_rounded_to_storage():
    ids = np.arange(100, dtype=np.uint64)
    f32 = initial_rows(TableConfig(name="t", dim=4, seed=1), ids)
    f16 = initial_rows(TableConfig(name="t", dim=4, seed=1, dtype="float16"), ids)
    assert f16.dtype == np.float32
    assert np.array_equal(f16, f32.astype(np.float16).astype(np.float32))


def test_admission_draws_depend_on_id_and_sighting_only():
    cfg = TableConfig(name="t", dim=4, seed=9, admit_probability=0.5)
    ids = np.arange(1000, dtype=np.uint64)
    first = admission_uniform(cfg, ids, np.ones(1000, dtype=np.int64))
    again = admission_uniform(cfg, ids[::-1], np.ones(1000, dtype=np.int64))[::-1]
    second = admission_uniform(cfg, ids, np.full(1000, 2, dtype=np.int64))
    assert np.array_equal(first, again)
    assert not np.array_equal(first, second)
    assert 0.0 <= first.min() and first.max() < 1.0 and abs(first.mean() - 0.5) < 0.05
