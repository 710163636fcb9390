"""Dedup ids per table and pool looked-up rows per sample, with exact per-row gradients.

A batch holds, per sparse feature, a jagged id list: ``values`` uint64 ``(total,)`` and
``lengths`` int ``(B,)`` (the KeyedJaggedTensor layout). The flow on a worker is:

1. :func:`plan_batch` finds, per table, the unique ids (what to look up on the PS) and, per
   feature, the index of every id into its table's unique ids (numpy, vectorised).
2. The rows of the unique ids come back from the PS, ``(U, dim)`` per table.
3. :func:`pool_batch` turns them into leaf tensors with ``requires_grad`` and pools them per
   sample (``sum`` or ``mean``; a sample with no ids pools to zeros) with
   ``torch.nn.functional.embedding_bag`` in offsets mode.
4. After ``loss.backward()``, :meth:`PooledBatch.row_grads` gives ``(U, dim)`` per table: the
   gradient of the loss w.r.t. each unique row, summed over every place it was used — exactly
   what is pushed to the PS for those ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from services.common.errors import InvalidArgument

__all__ = [
    "POOLING_MODES",
    "BatchPlan",
    "FeaturePlan",
    "PooledBatch",
    "as_jagged",
    "plan_batch",
    "pool",
    "pool_batch",
]

POOLING_MODES = ("sum", "mean")


@dataclass(slots=True, frozen=True)
class FeaturePlan:
    """Where one feature's ids sit in its table's unique ids."""

    table: str
    inverse: np.ndarray   # int64 (total,): index of each id into BatchPlan.unique[table]
    lengths: np.ndarray   # int64 (B,)
    offsets: np.ndarray   # int64 (B,): start of each sample's ids in ``inverse``


@dataclass(slots=True, frozen=True)
class BatchPlan:
    """Per table the unique ids to look up; per feature how to pool them back."""

    batch_size: int
    unique: dict[str, np.ndarray]          # table -> uint64 (U,), sorted ascending
    features: dict[str, FeaturePlan]

    def num_ids(self) -> int:
        """Ids in the batch before dedup (for dedup-ratio metrics)."""
        return int(sum(f.inverse.size for f in self.features.values()))

    def num_unique(self) -> int:
        return int(sum(u.size for u in self.unique.values()))


def as_jagged(feature: Any, name: str = "feature") -> tuple[np.ndarray, np.ndarray]:
    """``(values uint64, lengths int64)`` from a ``(values, lengths)`` pair or an object with
    ``.values``/``.lengths``; checks dtypes, signs and that the lengths add up."""
    if isinstance(feature, tuple | list) and len(feature) == 2:
        values, lengths = feature
    elif hasattr(feature, "values") and hasattr(feature, "lengths"):
        values, lengths = feature.values, feature.lengths
    else:
        raise InvalidArgument(f"{name}: expected (values, lengths), got {type(feature).__name__}")
    values = np.asarray(values)
    lengths = np.asarray(lengths)
    if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
        raise InvalidArgument(f"{name}: values must be a 1-D integer array, "
                              f"got {values.dtype} {values.shape}")
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise InvalidArgument(f"{name}: lengths must be a 1-D integer array, "
                              f"got {lengths.dtype} {lengths.shape}")
    if lengths.size and int(lengths.min()) < 0:
        raise InvalidArgument(f"{name}: lengths must be >= 0")
    total = int(lengths.sum())
    if total != values.size:
        raise InvalidArgument(f"{name}: lengths add up to {total} but there are "
                              f"{values.size} values")
    return values.astype(np.uint64, copy=False), lengths.astype(np.int64, copy=False)


def plan_batch(features: Mapping[str, Any], *,
               table_of: Mapping[str, str] | None = None) -> BatchPlan:
    """Dedup a batch's ids per table (features sharing a table are deduped together).

    ``features`` maps a feature name to its jagged ids (see :func:`as_jagged`); ``table_of``
    maps a feature to its table (default: the table has the feature's name).
    """
    if not features:
        raise InvalidArgument("a batch needs at least one sparse feature")
    jagged = {name: as_jagged(f, name) for name, f in features.items()}
    sizes = {name: lengths.size for name, (_, lengths) in jagged.items()}
    if len(set(sizes.values())) != 1:
        raise InvalidArgument(f"every feature needs the same batch size, got {sizes}")
    table_of = dict(table_of or {})
    missing = sorted(set(jagged) - set(table_of)) if table_of else []
    if missing:
        raise InvalidArgument(f"table_of has no table for features {missing}")
    by_table: dict[str, list[str]] = {}
    for name in jagged:
        by_table.setdefault(table_of.get(name, name), []).append(name)

    unique: dict[str, np.ndarray] = {}
    plans: dict[str, FeaturePlan] = {}
    for table, names in by_table.items():
        values = [jagged[n][0] for n in names]
        allv = values[0] if len(values) == 1 else np.concatenate(values)
        uniq, inverse = np.unique(allv, return_inverse=True)
        unique[table] = uniq
        inverse = inverse.reshape(-1).astype(np.int64, copy=False)
        bounds = np.cumsum([0] + [v.size for v in values])
        for n, lo, hi in zip(names, bounds[:-1], bounds[1:], strict=True):
            lengths = jagged[n][1]
            offsets = np.zeros(lengths.size, dtype=np.int64)
            np.cumsum(lengths[:-1], out=offsets[1:])
            plans[n] = FeaturePlan(table=table, inverse=inverse[lo:hi], lengths=lengths,
                                   offsets=offsets)
    return BatchPlan(batch_size=next(iter(sizes.values())), unique=unique, features=plans)


def pool(rows: Tensor, inverse: Tensor, offsets: Tensor, mode: str = "sum") -> Tensor:
    """Pool ``rows[inverse]`` per sample (bags start at ``offsets``): ``(B, dim)``.

    Empty bags give zeros in both modes. The gradient w.r.t. ``rows`` is dense ``(U, dim)``.
    """
    if mode not in POOLING_MODES:
        raise InvalidArgument(f"pooling mode must be one of {POOLING_MODES}, got {mode!r}")
    return F.embedding_bag(inverse, rows, offsets, mode=mode)


def _rows_tensor(table: str, arr: np.ndarray | Tensor, n_unique: int,
                 device: torch.device, dtype: torch.dtype) -> Tensor:
    """A fresh leaf (never aliasing the caller's buffer) of ``(n_unique, dim)`` rows."""
    if isinstance(arr, Tensor):
        t = arr.detach().to(device=device, dtype=dtype, copy=True)
    else:
        a = np.asarray(arr)
        if not np.issubdtype(a.dtype, np.floating):
            raise InvalidArgument(f"rows of table {table!r} must be floats, got {a.dtype}")
        t = torch.tensor(a).to(device=device, dtype=dtype)
    if t.dim() != 2 or t.shape[0] != n_unique:
        raise InvalidArgument(f"rows of table {table!r} must be ({n_unique}, dim), "
                              f"got {tuple(t.shape)}")
    return t.requires_grad_(True)


@dataclass(slots=True)
class PooledBatch:
    """Leaf row tensors per table and the pooled ``(B, dim)`` tensors per feature."""

    plan: BatchPlan
    rows: dict[str, Tensor]       # table -> (U, dim) leaf, requires_grad
    pooled: dict[str, Tensor]     # feature -> (B, dim)

    def row_grads(self) -> dict[str, np.ndarray]:
        """Per table the float32 ``(U, dim)`` gradient of each unique row (after backward);
        zeros for a table the loss did not reach."""
        out: dict[str, np.ndarray] = {}
        for table, t in self.rows.items():
            g = t.grad
            out[table] = (np.zeros(tuple(t.shape), dtype=np.float32) if g is None
                          else g.detach().to("cpu", torch.float32).numpy())
        return out


def pool_batch(plan: BatchPlan, rows: Mapping[str, np.ndarray | Tensor], *,
               mode: str | Mapping[str, str] = "sum", device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> PooledBatch:
    """Pool the looked-up ``rows`` (per table, aligned with ``plan.unique``) per feature.

    ``mode`` is one mode for every feature or a per-feature mapping (default ``sum``).
    The row tensors are fresh leaves, so their ``.grad`` after backward is the push gradient.
    """
    device = torch.device(device)
    missing = sorted(set(plan.unique) - set(rows))
    if missing:
        raise InvalidArgument(f"rows are missing for tables {missing}")
    modes = {f: (mode if isinstance(mode, str) else mode.get(f, "sum")) for f in plan.features}
    bad = {f: m for f, m in modes.items() if m not in POOLING_MODES}
    if bad:
        raise InvalidArgument(f"pooling modes must be one of {POOLING_MODES}, got {bad}")
    leaves = {table: _rows_tensor(table, rows[table], plan.unique[table].size, device, dtype)
              for table in plan.unique}
    pooled: dict[str, Tensor] = {}
    for fname, fp in plan.features.items():
        inverse = torch.from_numpy(fp.inverse).to(device)
        offsets = torch.from_numpy(fp.offsets).to(device)
        pooled[fname] = pool(leaves[fp.table], inverse, offsets, modes[fname])
    return PooledBatch(plan=plan, rows=leaves, pooled=pooled)
