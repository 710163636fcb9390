"""Dedup ids per table and pool looked-up rows per sample, with exact per-row gradients.

A batch holds, per sparse feature, a jagged id list: ``values`` uint64 ``(total,)`` and
``lengths`` int ``(B,)`` (the KeyedJaggedTensor layout). The flow on a worker is:

1. :func:`plan_batch` dedups the ids per table in one hash pass (numba, GIL released) and lays
   the unique ids of a *group* of tables (tables of one dim) out by shard, then table
   (:class:`ShardedIds`): each shard's share is one slice, sent as one message.
2. The rows come back from the shards, concatenated in shard order: ``(U, dim)`` per group,
   aligned with the group's ids.
3. :func:`pool_batch` makes each group's rows one leaf tensor and pools every feature of the
   group per sample in one call (the features' bags end to end; numba kernels on CPU,
   ``embedding_bag`` elsewhere; ``sum`` or ``mean``, an empty bag pools to zeros). The
   pooled tensors come in a :class:`PooledFeatures`, which also records the call that pooled
   each one, for DLRM's interaction to send their gradients straight into the rows.
4. After ``loss.backward()``, :meth:`PooledBatch.row_grads` gives ``(U, dim)`` per group: the
   gradient of the loss w.r.t. each unique row, summed over every place it was used; each
   shard's slice of it is what is pushed to that shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit
from torch import Tensor

from services.common.errors import InvalidArgument
from services.common.sharding import ShardedIds, place_ids
from services.worker.kernels import BagLayout, PoolBags, PooledFrom

__all__ = [
    "POOLING_MODES",
    "BatchPlan",
    "FeaturePlan",
    "GroupPlan",
    "PooledBatch",
    "PooledFeatures",
    "as_jagged",
    "plan_batch",
    "pool",
    "pool_batch",
]

POOLING_MODES = ("sum", "mean")


@dataclass(slots=True, frozen=True)
class FeaturePlan:
    """Where one feature's ids sit in its group's unique ids."""

    table: str
    group: int            # index into BatchPlan.groups
    inverse: np.ndarray   # int64 (total,): index of each id into the group's layout.ids
    lengths: np.ndarray   # int64 (B,)
    offsets: np.ndarray   # int64 (B,): start of each sample's ids in ``inverse``


@dataclass(slots=True, frozen=True)
class GroupPlan:
    """Tables looked up, pooled and pushed together: their unique ids by shard, then table,
    and their features' bags end to end (``inverse`` and ``offsets`` feature after feature)."""

    layout: ShardedIds
    features: tuple[str, ...]
    inverse: np.ndarray   # int64: every id of the group's features into layout.ids
    offsets: np.ndarray   # int64 (len(features) * B,): bag starts into ``inverse``


@dataclass(slots=True, frozen=True)
class BatchPlan:
    """Per group of tables the unique ids to look up; per feature how to pool them back."""

    batch_size: int
    groups: list[GroupPlan]
    features: dict[str, FeaturePlan]

    @property
    def unique(self) -> dict[str, np.ndarray]:
        """Each table's unique ids (shard by shard)."""
        return {t: g.layout.table_ids(t) for g in self.groups for t in g.layout.tables}

    def num_ids(self) -> int:
        """Ids in the batch before dedup (for dedup-ratio metrics)."""
        return int(sum(g.inverse.size for g in self.groups))

    def num_unique(self) -> int:
        return int(sum(g.layout.ids.size for g in self.groups))


def as_jagged(feature: Any, name: str = "feature") -> tuple[np.ndarray, np.ndarray]:
    """``(values uint64, lengths)`` from a ``(values, lengths)`` pair or an object with
    ``.values``/``.lengths``; checks kinds and shapes (:func:`plan_batch` checks the counts
    of every feature at once)."""
    if isinstance(feature, tuple | list) and len(feature) == 2:
        values, lengths = feature
    elif hasattr(feature, "values") and hasattr(feature, "lengths"):
        values, lengths = feature.values, feature.lengths
    else:
        raise InvalidArgument(f"{name}: expected (values, lengths), got {type(feature).__name__}")
    values = np.asarray(values)
    lengths = np.asarray(lengths)
    if values.ndim != 1 or values.dtype.kind not in "iu":
        raise InvalidArgument(f"{name}: values must be a 1-D integer array, "
                              f"got {values.dtype} {values.shape}")
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
        raise InvalidArgument(f"{name}: lengths must be a 1-D integer array, "
                              f"got {lengths.dtype} {lengths.shape}")
    return values.astype(np.uint64, copy=False), lengths


@njit(cache=True, nogil=True)
def _bags(lengths, batch_size, lengths64, offsets, own, totals):  # pragma: no cover - numba
    """One pass over features' lengths end to end (``batch_size`` bags each): ``lengths64``
    (the lengths as int64), ``offsets`` (each bag's start among all the features' ids),
    ``own`` (its start among its own feature's) and ``totals`` (each feature's ids). Returns
    the first feature with a negative length, or -1."""
    run = 0
    for k in range(totals.size):
        start = run
        for b in range(k * batch_size, (k + 1) * batch_size):
            length = lengths[b]
            if length < 0:
                return k
            lengths64[b] = length
            offsets[b] = run
            own[b] = run - start
            run += length
        totals[k] = run - start
    return -1


def _bag_layout(names: list[str], jagged: dict[str, tuple[np.ndarray, np.ndarray]],
                batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ``names`` features' lengths end to end (int64), their bags' offsets among them all
    and within each feature, and each feature's first id among them all; checks that the
    lengths are non-negative and add up to each feature's number of values."""
    lengths = (jagged[names[0]][1] if len(names) == 1
               else np.concatenate([jagged[n][1] for n in names]))
    out = np.empty((3, lengths.size), dtype=np.int64)
    totals = np.empty(len(names), dtype=np.int64)
    bad = _bags(lengths, batch_size, out[0], out[1], out[2], totals)
    if bad >= 0:
        raise InvalidArgument(f"{names[bad]}: lengths must be >= 0")
    for n, total in zip(names, totals.tolist(), strict=True):
        if total != jagged[n][0].size:
            raise InvalidArgument(f"{n}: lengths add up to {total} but there are "
                                  f"{jagged[n][0].size} values")
    firsts = np.zeros(len(names), dtype=np.int64)
    np.cumsum(totals[:-1], out=firsts[1:])
    return out[0], out[1], out[2], firsts


def plan_batch(features: Mapping[str, Any], *, table_of: Mapping[str, str] | None = None,
               num_shards: int = 1, groups: Sequence[Sequence[str]] | None = None
               ) -> BatchPlan:
    """Dedup a batch's ids per table (features sharing a table are deduped together) and lay
    them out for ``num_shards`` PS shards.

    ``features`` maps a feature name to its jagged ids (see :func:`as_jagged`); ``table_of``
    maps a feature to its table (default: the table has the feature's name); ``groups`` lists
    the tables pooled and sent together, tables of one dim (default: all in one group).
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
    tables = list(dict.fromkeys(table_of.get(name, name) for name in jagged))
    groups = [list(g) for g in groups] if groups is not None else [tables]
    group_of = {t: i for i, g in enumerate(groups) for t in g}
    ungrouped = sorted(set(tables) - set(group_of))
    if ungrouped:
        raise InvalidArgument(f"tables {ungrouped} are in no group")
    batch_size = next(iter(sizes.values()))
    plans: dict[str, FeaturePlan] = {}
    group_plans: list[GroupPlan] = []
    for gi, group in enumerate(groups):
        names = [n for n in jagged if group_of[table_of.get(n, n)] == gi]
        group_tables = [t for t in group if t in tables]
        if not names:
            continue
        owners = [group_tables.index(table_of.get(n, n)) for n in names]
        lengths, offsets, own, firsts = _bag_layout(names, jagged, batch_size)
        layout, inverse = place_ids([jagged[n][0] for n in names], owners, group_tables,
                                    num_shards)
        index = len(group_plans)
        for k, (n, first) in enumerate(zip(names, firsts.tolist(), strict=True)):
            plans[n] = FeaturePlan(table=table_of.get(n, n), group=index,
                                   inverse=inverse[first:first + jagged[n][0].size],
                                   lengths=lengths[k * batch_size:(k + 1) * batch_size],
                                   offsets=own[k * batch_size:(k + 1) * batch_size])
        group_plans.append(GroupPlan(layout=layout, features=tuple(names), inverse=inverse,
                                     offsets=offsets))
    return BatchPlan(batch_size=batch_size, groups=group_plans, features=plans)


def pool(rows: Tensor, inverse: Tensor, offsets: Tensor, mode: str = "sum", *,
         parts: int = 1) -> tuple[Tensor, ...]:
    """Pool ``rows[inverse]`` per bag (bags start at ``offsets``), split into ``parts``
    tensors ``(bags / parts, dim)`` (one per feature when several features' bags are end
    to end).

    Empty bags give zeros in both modes. The gradient w.r.t. ``rows`` is dense ``(U, dim)``.
    CPU float32 rows take numba kernels, other devices and dtypes ``embedding_bag``.
    """
    return _pool(rows, inverse, offsets, mode, parts)[0]


def _pool(rows: Tensor, inverse: Tensor, offsets: Tensor, mode: str, parts: int
          ) -> tuple[tuple[Tensor, ...], BagLayout | None]:
    """:func:`pool`'s outputs and, where the numba kernel pooled them, the call's layout."""
    if mode not in POOLING_MODES:
        raise InvalidArgument(f"pooling mode must be one of {POOLING_MODES}, got {mode!r}")
    if rows.device.type == "cpu" and rows.dtype == torch.float32 \
            and inverse.dtype == offsets.dtype == torch.int64:
        inverse, offsets = inverse.contiguous(), offsets.contiguous()
        mean = mode == "mean"
        outs = PoolBags.apply(rows, inverse, offsets, mean, parts)
        return outs, BagLayout(rows=rows, inverse=inverse.numpy(), offsets=offsets.numpy(),
                               mean=mean)
    out = F.embedding_bag(inverse, rows, offsets, mode=mode)
    return out.view(parts, -1, out.shape[1]).unbind(0), None


class PooledFeatures(dict[str, Tensor]):
    """Pooled ``(B, dim)`` tensors by feature name (a dict: code that takes the plain dict
    takes it), which also knows which of them a :class:`PoolBags` call gave, as they came
    out: :meth:`source_of`. A tensor set in it by hand, or copied out and changed, is
    plain."""

    __slots__ = ("_from",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._from: dict[str, tuple[Tensor, PooledFrom]] = {}

    def pool(self, names: Sequence[str], rows: Tensor, inverse: Tensor, offsets: Tensor,
             mode: str = "sum") -> None:
        """Pool the bags of features ``names`` (their bags end to end, ``B`` each: see
        :func:`pool`) into this mapping, one entry per name."""
        outs, bags = _pool(rows, inverse, offsets, mode, len(names))
        for k, (name, out) in enumerate(zip(names, outs, strict=True)):
            self[name] = out
            if bags is not None:
                self._from[name] = (out, PooledFrom(bags=bags, part=k))

    def source_of(self, name: str, tensor: Tensor) -> PooledFrom | None:
        """The :class:`PoolBags` call that pooled feature ``name``, if ``tensor`` is the very
        tensor it gave (not a copy, view or function of it); else None."""
        held = self._from.get(name)
        return held[1] if held is not None and held[0] is tensor else None


def _rows_tensor(group: int, arr: np.ndarray | Tensor, n_unique: int,
                 device: torch.device, dtype: torch.dtype) -> Tensor:
    """A fresh leaf (never aliasing the caller's buffer) of ``(n_unique, dim)`` rows."""
    if isinstance(arr, Tensor):
        t = arr.detach().to(device=device, dtype=dtype, copy=True)
    else:
        a = np.asarray(arr)
        if not np.issubdtype(a.dtype, np.floating):
            raise InvalidArgument(f"rows of group {group} must be floats, got {a.dtype}")
        if device.type == "cpu" and dtype == torch.float32:  # numpy's copy keeps the GIL
            t = torch.from_numpy(np.array(a, dtype=np.float32))
        else:
            t = torch.tensor(a).to(device=device, dtype=dtype)
    if t.dim() != 2 or t.shape[0] != n_unique:
        raise InvalidArgument(f"rows of group {group} must be ({n_unique}, dim), "
                              f"got {tuple(t.shape)}")
    return t.requires_grad_(True)


@dataclass(slots=True)
class PooledBatch:
    """Leaf row tensors per group and the pooled ``(B, dim)`` tensors per feature."""

    plan: BatchPlan
    rows: list[Tensor]            # per group: (U, dim) leaf, requires_grad
    pooled: dict[str, Tensor]     # feature -> (B, dim); from pool_batch a PooledFeatures

    def row_grads(self) -> list[np.ndarray]:
        """Per group the float32 ``(U, dim)`` gradient of each unique row (after backward);
        zeros for a group the loss did not reach."""
        return [np.zeros(tuple(t.shape), dtype=np.float32) if t.grad is None
                else t.grad.detach().to("cpu", torch.float32).numpy() for t in self.rows]


def pool_batch(plan: BatchPlan, rows: Sequence[np.ndarray | Tensor], *,
               mode: str | Mapping[str, str] = "sum", device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> PooledBatch:
    """Pool the looked-up ``rows`` (per group, aligned with its ``layout.ids``) per feature.

    ``mode`` is one mode for every feature or a per-feature mapping (default ``sum``). The
    features of a group that share a mode are pooled by one :func:`pool` call, into a
    :class:`PooledFeatures`. The row tensors are fresh leaves, so their ``.grad`` after
    backward is the push gradient.
    """
    device = torch.device(device)
    if len(rows) != len(plan.groups):
        raise InvalidArgument(f"rows are needed for {len(plan.groups)} groups, "
                              f"got {len(rows)}")
    modes = {f: (mode if isinstance(mode, str) else mode.get(f, "sum")) for f in plan.features}
    bad = {f: m for f, m in modes.items() if m not in POOLING_MODES}
    if bad:
        raise InvalidArgument(f"pooling modes must be one of {POOLING_MODES}, got {bad}")
    leaves = [_rows_tensor(i, r, g.layout.ids.size, device, dtype)
              for i, (g, r) in enumerate(zip(plan.groups, rows, strict=True))]
    pooled = PooledFeatures()
    for group, leaf in zip(plan.groups, leaves, strict=True):
        group_modes = {modes[f] for f in group.features}
        if len(group_modes) == 1:  # every bag of the group in one call
            pooled.pool(group.features, leaf, torch.from_numpy(group.inverse).to(device),
                        torch.from_numpy(group.offsets).to(device), group_modes.pop())
            continue
        for f in group.features:
            fp = plan.features[f]
            pooled.pool([f], leaf, torch.from_numpy(fp.inverse).to(device),
                        torch.from_numpy(fp.offsets).to(device), modes[f])
    return PooledBatch(plan=plan, rows=leaves, pooled=pooled)
