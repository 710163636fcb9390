"""Counting tables: SGD with lr = 1 on zero rows, and a gradient of -1 per occurrence of an
id, so each id's row equals exactly the number of its occurrences the shard applied."""

from __future__ import annotations

import numpy as np

from services.ps.tables import OptimizerConfig, TableConfig

DIM = 2


def counting_table(name: str = "count", dim: int = DIM) -> TableConfig:
    return TableConfig(name=name, dim=dim, initializer="zeros",
                       optimizer=OptimizerConfig(kind="sgd", lr=1.0))


def count_grads(n: int, dim: int = DIM) -> np.ndarray:
    """The gradient of ``n`` occurrences: -1 in every column."""
    return np.full((n, dim), -1.0, np.float32)


def applied_counts(rows: np.ndarray) -> np.ndarray:
    """The occurrences each row holds (its columns agree, else the rows are no counts)."""
    assert np.all(rows == rows[:, :1]), rows
    return rows[:, 0]
