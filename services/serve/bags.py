"""A batch's embedding bags pooled per record, in NumPy: each table's ids looked up in one
call, the features of one dim pooled together (their bags end to end).

The pooling is the trainer's (:func:`services.worker.pooling.pool`): a bag's rows are added
in order, a mean multiplies that sum by ``1 / length`` (float32), an empty bag pools to zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from services.common.batch import Jagged
from services.common.errors import InvalidArgument

__all__ = ["POOLING", "pool_bags"]

POOLING = ("sum", "mean")  # the trainer's pooling modes (services.worker.pooling.POOLING_MODES)

# {table: unique uint64 ids} -> {table: float32 (len(ids), dim)}
Lookup = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def pool_bags(sparse: Mapping[str, Jagged], table_of: Mapping[str, str], lookup: Lookup,
              mode: str = "sum") -> dict[str, np.ndarray]:
    """``{feature: (B, dim) float32}`` for every feature of ``table_of`` (feature -> table):
    its records' rows pooled; ``lookup`` gives the rows of each table's ids (all of the
    table's features' ids end to end, repeats included)."""
    if mode not in POOLING:
        raise InvalidArgument(f"pooling mode must be one of {POOLING}, got {mode!r}")
    names = list(table_of)
    batch = _check(sparse, names)
    by_table: dict[str, list[str]] = {}
    for f in names:
        by_table.setdefault(table_of[f], []).append(f)
    rows = lookup({t: _concat([sparse[f].values for f in fs]) for t, fs in by_table.items()})
    per_feature: dict[str, np.ndarray] = {}
    for t, fs in by_table.items():
        start = 0
        for f in fs:  # each feature's part of its table's rows
            end = start + sparse[f].values.size
            per_feature[f] = np.asarray(rows[t][start:end], dtype=np.float32)
            start = end
    by_dim: dict[int, list[str]] = {}
    for f in names:
        by_dim.setdefault(per_feature[f].shape[1], []).append(f)
    out: dict[str, np.ndarray] = {}
    for fs in by_dim.values():
        pooled = _pool(_concat([per_feature[f] for f in fs]),
                       _concat([sparse[f].lengths for f in fs]), mode == "mean")
        out.update((f, pooled[k * batch:(k + 1) * batch]) for k, f in enumerate(fs))
    return out


def _check(sparse: Mapping[str, Jagged], names: list[str]) -> int:
    """The batch size; every feature's lengths are >= 0 and add up to its values."""
    sizes = {f: int(sparse[f].lengths.size) for f in names}
    if len(set(sizes.values())) != 1:
        raise InvalidArgument(f"every feature needs the same batch size, got {sizes}")
    lengths = np.stack([sparse[f].lengths for f in names]).astype(np.int64)
    if lengths.size and lengths.min() < 0:
        raise InvalidArgument(f"{names[int(np.argmin(lengths.min(1)))]}: lengths must be >= 0")
    totals = lengths.sum(1)
    for f, total in zip(names, totals.tolist(), strict=True):
        if total != sparse[f].values.size:
            raise InvalidArgument(f"{f}: lengths add up to {total} but there are "
                                  f"{sparse[f].values.size} values")
    return sizes[names[0]]


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _pool(rows: np.ndarray, lengths: np.ndarray, mean: bool) -> np.ndarray:
    """Bag ``b`` is the next ``lengths[b]`` of ``rows``, pooled."""
    out = np.zeros((lengths.size, rows.shape[1]), dtype=np.float32)
    full = lengths > 0
    if rows.shape[0]:
        starts = np.cumsum(lengths) - lengths
        # the non-empty bags tile the rows in order: reduceat sums each bag in turn
        out[full] = np.add.reduceat(rows, starts[full], axis=0)
    if mean:
        out[full] *= (np.float32(1.0) / lengths[full].astype(np.float32))[:, None]
    return out
