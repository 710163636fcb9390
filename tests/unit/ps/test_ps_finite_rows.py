"""Rows and optimizer state stay finite whatever finite gradient a push carries (issue 45).

Each case is a finite gradient that used to leave a row NaN, ±Inf or frozen for good (an
infinite Adagrad accumulator moves the row by 0 forever). Now the update of such a row is
refused inside the optimizer kernel (the row and its state keep their values, counted as
``refused_nonfinite`` in the table's stats and on /metrics), and float16 rows saturate at
float16's largest finite value instead of overflowing.
"""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import generate_latest

from services.ps.config import PSConfig
from services.ps.metrics import PSMetrics
from services.ps.optimizers import state_layout
from services.ps.shard import Shard
from services.ps.tables import OptimizerConfig, TableConfig

IDS = np.arange(3, dtype=np.uint64)
DIM = 4
FP16_MAX = float(np.finfo(np.float16).max)


def shard_of_one(kind: str, *, dtype: str = "float32", lr: float = 0.5) -> Shard:
    return Shard(PSConfig(tables=[TableConfig(
        name="t", dim=DIM, dtype=dtype, optimizer=OptimizerConfig(kind=kind, lr=lr))]))


def push(shard: Shard, value: float, ids: np.ndarray = IDS):
    return shard.push_sync("t", ids, np.full((ids.size, DIM), value, np.float32))


def rows_and_state(shard: Shard) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    table = shard.table("t")
    return table.lookup(IDS), table.state_of(IDS)


def assert_finite(shard: Shard) -> None:
    rows, state = rows_and_state(shard)
    assert np.isfinite(rows).all(), rows
    for name, values in state.items():
        assert np.isfinite(values).all(), (name, values)


@pytest.mark.parametrize("kind, dtype, lr, gradient, pushes, back", [
    ("ftrl", "float32", 0.5, 1e20, 1, 1.0),  # z and n overflow: the row became NaN
    ("sgd", "float32", 1.0, 3e38, 2, 1e38),  # the second push went past float32: -inf
    ("adagrad", "float32", 0.5, 1e20, 1, 1.0),  # accum = inf: the row frozen for good
    ("rowwise_adagrad", "float32", 0.5, 1e20, 1, 1.0),  # the same, one accumulator a row
])
def test_an_update_that_would_not_be_finite_is_refused_and_counted(kind, dtype, lr, gradient,
                                                                    pushes, back):
    shard = shard_of_one(kind, dtype=dtype, lr=lr)
    push(shard, 0.0)  # the rows exist
    for _ in range(pushes - 1):
        assert push(shard, gradient).applied == IDS.size  # still finite: applied
    rows, state = rows_and_state(shard)
    result = push(shard, gradient)
    assert (result.applied, result.dropped_nonfinite) == (0, IDS.size)
    after, state_after = rows_and_state(shard)
    np.testing.assert_array_equal(after, rows)  # nothing written
    for name in state:
        np.testing.assert_array_equal(state_after[name], state[name])
    assert shard.stats("t").tables["t"].refused_nonfinite == IDS.size
    assert_finite(shard)
    assert push(shard, -back).applied == IDS.size  # not frozen: an ordinary push moves it
    assert (shard.table("t").lookup(IDS) > after).all()


def test_float16_rows_saturate_at_the_largest_finite_value():
    shard = shard_of_one("sgd", dtype="float16")
    assert push(shard, 1e6).applied == IDS.size  # w - 5e5: finite in float32, not in float16
    rows, _ = rows_and_state(shard)
    np.testing.assert_array_equal(rows, np.full((IDS.size, DIM), -FP16_MAX, np.float32))
    assert push(shard, -1000.0).applied == IDS.size  # and it moves back
    assert (shard.table("t").lookup(IDS) > -FP16_MAX).all()


def test_a_refused_row_leaves_the_other_rows_of_the_push_applied():
    shard = shard_of_one("adagrad")
    push(shard, 0.0)
    rows, _ = rows_and_state(shard)
    grads = np.array([[1e20] * DIM, [1.0] * DIM, [-1.0] * DIM], np.float32)
    result = shard.push_sync("t", IDS, grads)
    assert (result.applied, result.dropped_nonfinite) == (2, 1)
    after, state = rows_and_state(shard)
    np.testing.assert_array_equal(after[0], rows[0])
    assert (after[1] < rows[1]).all() and (after[2] > rows[2]).all()
    assert_finite(shard)


def test_many_tables_in_one_kernel_call_refuse_per_table():
    """Plain float32 Adagrad tables of one request share one kernel call (multitable)."""
    tables = [TableConfig(name=name, dim=DIM, optimizer=OptimizerConfig(kind="adagrad"))
              for name in ("a", "b")]
    shard = Shard(PSConfig(tables=tables))
    grads = np.zeros((2 * IDS.size, DIM), np.float32)
    shard.push_many_sync(["a", "b"], [IDS.size, IDS.size], np.r_[IDS, IDS], grads)
    grads[IDS.size] = 1e20  # table b's first id
    result = shard.push_many_sync(["a", "b"], [IDS.size, IDS.size], np.r_[IDS, IDS], grads)
    assert (result.applied, result.dropped_nonfinite) == (2 * IDS.size - 1, 1)
    stats = shard.stats().tables
    assert (stats["a"].refused_nonfinite, stats["b"].refused_nonfinite) == (0, 1)
    assert np.isfinite(shard.table("b").state_of(IDS)["accum"]).all()


def test_refused_updates_are_on_the_shards_metrics():
    shard = shard_of_one("ftrl")
    push(shard, 1e20)
    scraped = generate_latest(PSMetrics(shard).registry).decode()
    assert 'persimmon_ps_table_refused_nonfinite_total{table="t"} 3.0' in scraped


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"])
def test_every_optimizer_keeps_state_finite_under_huge_gradients(kind):
    shard = shard_of_one(kind)
    for value in (1e20, -3e38, 3e38, 1e30):
        push(shard, value)
        assert_finite(shard)
    assert set(state_layout(shard.table("t").config.optimizer, DIM)) \
        == set(shard.table("t").state_of(IDS))
