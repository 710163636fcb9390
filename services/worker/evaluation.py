"""Held-out metrics: ROC AUC (rank based, ties averaged) and logloss, streaming over batches.

:func:`auc` equals scikit-learn's ``roc_auc_score`` (ties count one half); it returns NaN when
the labels hold only one class (AUC is undefined there, and an eval loop should not crash on
a tiny split). :func:`logloss` equals ``log_loss`` with probabilities clipped to
``[eps, 1 - eps]``; :func:`logloss_from_logits` is the numerically stable form the models need.
:class:`EvalAccumulator` keeps every (label, score) to compute the exact AUC at the end and a
running logloss sum; :func:`gather_accumulator` merges the accumulators of all ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from services.common.errors import InvalidArgument

__all__ = [
    "EvalAccumulator",
    "EvalResult",
    "auc",
    "gather_accumulator",
    "logloss",
    "logloss_from_logits",
]


def _as_1d(name: str, x: np.ndarray | torch.Tensor | list[float]) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(a)):
        raise InvalidArgument(f"{name} holds NaN or Inf")
    return a


def _pair(labels: np.ndarray | torch.Tensor | list[float],
          scores: np.ndarray | torch.Tensor | list[float]) -> tuple[np.ndarray, np.ndarray]:
    y = _as_1d("labels", labels)
    s = _as_1d("scores", scores)
    if y.shape != s.shape:
        raise InvalidArgument(f"labels {y.shape} and scores {s.shape} differ in size")
    if y.size and not np.all((y == 0) | (y == 1)):
        raise InvalidArgument("labels must be 0 or 1")
    return y, s


def auc(labels: np.ndarray | torch.Tensor | list[float],
        scores: np.ndarray | torch.Tensor | list[float]) -> float:
    """ROC AUC from the Mann-Whitney rank sum, tied scores sharing their average rank."""
    y, s = _pair(labels, scores)
    n_pos = float(y.sum())
    n_neg = float(y.size - n_pos)
    if n_pos == 0 or n_neg == 0:
        return math.nan
    order = np.argsort(s, kind="stable")
    sorted_s = s[order]
    # start index of each run of equal scores, and its length
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    counts = np.diff(np.r_[starts, s.size])
    avg_rank = starts + (counts + 1) / 2.0          # 1-based average rank of each tie run
    ranks = np.repeat(avg_rank, counts)
    pos_rank_sum = float(ranks[y[order] == 1].sum())
    return (pos_rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def logloss(labels: np.ndarray | torch.Tensor | list[float],
            probs: np.ndarray | torch.Tensor | list[float], *, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities clipped to ``[eps, 1 - eps]``."""
    y, p = _pair(labels, probs)
    if y.size == 0:
        return math.nan
    if np.any((p < 0) | (p > 1)):
        raise InvalidArgument("probabilities must lie in [0, 1]")
    p = np.clip(p, eps, 1 - eps)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def _bce_sum_from_logits(y: np.ndarray, z: np.ndarray) -> float:
    # log(1 + e^z) - y z, stable for both signs of z
    return float(np.sum(np.logaddexp(0.0, z) - y * z))


def logloss_from_logits(labels: np.ndarray | torch.Tensor | list[float],
                        logits: np.ndarray | torch.Tensor | list[float]) -> float:
    """Mean binary cross-entropy of ``sigmoid(logits)``, computed without overflow."""
    y, z = _pair(labels, logits)
    return math.nan if y.size == 0 else _bce_sum_from_logits(y, z) / y.size


@dataclass(slots=True, frozen=True)
class EvalResult:
    auc: float
    logloss: float
    count: int
    positive_rate: float

    def as_dict(self) -> dict[str, float]:
        return {"auc": self.auc, "logloss": self.logloss, "count": self.count,
                "positive_rate": self.positive_rate}


class EvalAccumulator:
    """Collects ``(labels, logits)`` batch by batch; :meth:`result` gives AUC and logloss."""

    def __init__(self) -> None:
        self._labels: list[np.ndarray] = []
        self._scores: list[np.ndarray] = []
        self._bce_sum = 0.0
        self._count = 0
        self._positives = 0.0

    def reset(self) -> None:
        """Forget everything collected."""
        self._labels, self._scores = [], []
        self._bce_sum, self._count, self._positives = 0.0, 0, 0.0

    def update(self, labels: np.ndarray | torch.Tensor | list[float],
               logits: np.ndarray | torch.Tensor | list[float]) -> None:
        """Add one batch; ``logits`` are the model's raw outputs (before sigmoid)."""
        y, z = _pair(labels, logits)
        self._labels.append(y.astype(np.float32))
        self._scores.append(z.astype(np.float32))
        self._bce_sum += _bce_sum_from_logits(y, z)
        self._count += y.size
        self._positives += float(y.sum())

    def merge(self, other: EvalAccumulator) -> None:
        """Add everything ``other`` collected."""
        self._labels += other._labels
        self._scores += other._scores
        self._bce_sum += other._bce_sum
        self._count += other._count
        self._positives += other._positives

    @property
    def count(self) -> int:
        return self._count

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """All labels and logits so far, float32."""
        if not self._labels:
            return np.zeros(0, np.float32), np.zeros(0, np.float32)
        return np.concatenate(self._labels), np.concatenate(self._scores)

    def result(self) -> EvalResult:
        y, z = self.arrays()
        n = self._count
        return EvalResult(auc=auc(y, z), logloss=self._bce_sum / n if n else math.nan,
                          count=n, positive_rate=self._positives / n if n else math.nan)


def gather_accumulator(acc: EvalAccumulator, group: object | None = None) -> EvalAccumulator:
    """An accumulator holding every rank's data (collective: all ranks of ``group`` call it).

    Without an initialised process group it returns ``acc`` itself.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return acc
    parts: list[object] = [None] * dist.get_world_size(group)  # type: ignore[arg-type]
    y, z = acc.arrays()
    dist.all_gather_object(parts, (y, z, acc._bce_sum), group=group)  # type: ignore[arg-type]
    merged = EvalAccumulator()
    for part in parts:
        py, pz, bce = cast(tuple[np.ndarray, np.ndarray, float], part)
        if py.size:
            merged._labels.append(py)
            merged._scores.append(pz)
        merged._bce_sum += bce
        merged._count += py.size
        merged._positives += float(py.sum())
    return merged
