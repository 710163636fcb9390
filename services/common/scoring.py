"""Binary-classification scores shared by every service: ROC AUC and logloss (numpy only).

:func:`auc` equals scikit-learn's ``roc_auc_score`` (tied scores count one half) and returns
NaN when the labels hold one class only (AUC is undefined there; an eval loop on a tiny split
should not crash). :func:`logloss` equals ``log_loss`` with probabilities clipped to
``[eps, 1 - eps]``; :func:`logloss_from_logits` is the overflow-free form for raw logits.
Inputs are anything ``np.asarray`` takes (a CPU torch tensor included); NaN/Inf scores, labels
other than 0/1 and mismatched sizes are :class:`InvalidArgument`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from services.common.errors import InvalidArgument

__all__ = ["auc", "bce_sum_from_logits", "labels_and_scores", "logloss", "logloss_from_logits"]


def _as_1d(name: str, x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, possibly on a device or requiring grad
        x = x.detach().cpu().double().numpy()
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(a)):
        raise InvalidArgument(f"{name} holds NaN or Inf")
    return a


def labels_and_scores(labels: Any, scores: Any) -> tuple[np.ndarray, np.ndarray]:
    """Both as float64 1-d arrays, checked: same size, finite, labels 0 or 1."""
    y = _as_1d("labels", labels)
    s = _as_1d("scores", scores)
    if y.shape != s.shape:
        raise InvalidArgument(f"labels {y.shape} and scores {s.shape} differ in size")
    bad = np.flatnonzero((y != 0) & (y != 1))
    if bad.size:
        raise InvalidArgument(f"labels must be 0 or 1, got {y[bad[0]]:g} ({bad.size} of "
                              f"{y.size})")
    return y, s


def auc(labels: Any, scores: Any) -> float:
    """ROC AUC from the Mann-Whitney rank sum, tied scores sharing their average rank."""
    y, s = labels_and_scores(labels, scores)
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


def logloss(labels: Any, probs: Any, *, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities clipped to ``[eps, 1 - eps]``."""
    y, p = labels_and_scores(labels, probs)
    if y.size == 0:
        return math.nan
    if np.any((p < 0) | (p > 1)):
        raise InvalidArgument("probabilities must lie in [0, 1]")
    p = np.clip(p, eps, 1 - eps)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def bce_sum_from_logits(y: np.ndarray, z: np.ndarray) -> float:
    """Sum of ``log(1 + e^z) - y z`` (BCE of sigmoid(z)), stable for both signs of z."""
    return float(np.sum(np.logaddexp(0.0, z) - y * z))


def logloss_from_logits(labels: Any, logits: Any) -> float:
    """Mean binary cross-entropy of ``sigmoid(logits)``, computed without overflow."""
    y, z = labels_and_scores(labels, logits)
    return math.nan if y.size == 0 else bce_sum_from_logits(y, z) / y.size
