"""Held-out metrics streamed over batches (the scores themselves: :mod:`services.common.scoring`).

:class:`EvalAccumulator` keeps every (label, score) to compute the exact AUC at the end and a
running logloss sum; :func:`gather_accumulator` merges the accumulators of all ranks.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np
import torch
import torch.distributed as dist

from services.common.errors import InvalidArgument, TrainingFailed
from services.common.scoring import (
    auc,
    bce_sum_from_logits,
    labels_and_scores,
    logloss,
    logloss_from_logits,
)
from services.worker.distributed import joined

__all__ = [
    "EvalAccumulator",
    "EvalResult",
    "auc",
    "evaluate_overlapped",
    "gather_accumulator",
    "logloss",
    "logloss_from_logits",
]


T = TypeVar("T")
Item = TypeVar("Item")


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
    """Collects ``(labels, logits)`` batch by batch; :meth:`result` gives AUC and logloss.
    ``source`` (``"the evaluation data"``) is named in the error of a label other than 0/1."""

    def __init__(self, source: str = "the data") -> None:
        self.source = source
        self._labels: list[np.ndarray] = []
        self._scores: list[np.ndarray] = []
        self._bce_sum = 0.0
        self._count = 0

    def reset(self) -> None:
        """Forget everything collected."""
        self._labels, self._scores = [], []
        self._bce_sum, self._count = 0.0, 0

    def update(self, labels: np.ndarray | torch.Tensor | list[float],
               logits: np.ndarray | torch.Tensor | list[float]) -> None:
        """Add one batch; ``logits`` are the model's raw outputs (before sigmoid)."""
        y, z = self._checked(labels_and_scores, labels, logits)
        self._labels.append(y.astype(np.float32))
        self._scores.append(z.astype(np.float32))
        self._bce_sum += bce_sum_from_logits(y, z)
        self._count += y.size

    def add_step(self, labels: np.ndarray, logits: np.ndarray, mean_bce: float) -> None:
        """Add a training step's float32 ``labels`` and ``logits`` with the mean BCE the step
        computed as its loss: the event loop's path for every step, with no pass over the
        arrays (each numpy pass there hands the GIL to compute and back). The labels are
        checked by :meth:`result`, which raises if one is not 0 or 1."""
        if not math.isfinite(mean_bce):
            raise TrainingFailed(f"the training loss is {mean_bce}: the model diverged")
        if labels.shape != logits.shape:
            raise InvalidArgument(f"labels {labels.shape} and logits {logits.shape} differ")
        self._labels.append(labels.copy())  # not a view that keeps a whole message alive
        self._scores.append(logits)
        self._bce_sum += mean_bce * labels.size
        self._count += labels.size

    def merge(self, other: EvalAccumulator) -> None:
        """Add everything ``other`` collected."""
        self._labels += other._labels
        self._scores += other._scores
        self._bce_sum += other._bce_sum
        self._count += other._count

    @property
    def count(self) -> int:
        return self._count

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """All labels and logits so far, float32."""
        if not self._labels:
            return np.zeros(0, np.float32), np.zeros(0, np.float32)
        return np.concatenate(self._labels), np.concatenate(self._scores)

    def _checked(self, score: Callable[..., T], labels: Any, scores: Any) -> T:
        try:
            return score(labels, scores)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{self.source}: {exc.message}") from exc

    def result(self) -> EvalResult:
        y, z = self.arrays()
        n = self._count
        return EvalResult(auc=self._checked(auc, y, z),
                          logloss=self._bce_sum / n if n else math.nan,
                          count=n, positive_rate=float(y.sum()) / n if n else math.nan)


def gather_accumulator(acc: EvalAccumulator, group: object | None = None) -> EvalAccumulator:
    """An accumulator holding every rank's data (collective: all ranks of ``group`` call it).

    Without an initialised process group it returns ``acc`` itself.
    """
    if not joined():
        return acc
    parts: list[object] = [None] * dist.get_world_size(group)  # type: ignore[arg-type]
    y, z = acc.arrays()
    dist.all_gather_object(parts, (y, z, acc._bce_sum), group=group)  # type: ignore[arg-type]
    merged = EvalAccumulator(acc.source)
    for part in parts:
        py, pz, bce = cast(tuple[np.ndarray, np.ndarray, float], part)
        if py.size:
            merged._labels.append(py)
            merged._scores.append(pz)
        merged._bce_sum += bce
        merged._count += py.size
    return merged


async def evaluate_overlapped(batches: AsyncIterable[Any],
                              look_up: Callable[[Any], Awaitable[Item]],
                              score: Callable[[Item], Awaitable[np.ndarray]]
                              ) -> dict[str, float]:
    """Held-out ``auc``, ``logloss`` and ``samples`` of ``batches`` (objects with
    ``labels``), every rank's merged (:func:`gather_accumulator`): each batch is looked up
    (``look_up``, e.g. its rows from the PS) while the one before it is scored (``score``
    gives its logits), so the two overlap."""
    acc = EvalAccumulator("the evaluation data")
    iterator = batches.__aiter__()

    async def fetch() -> tuple[Any, Item] | None:
        try:
            batch = await iterator.__anext__()
        except StopAsyncIteration:
            return None
        return batch, await look_up(batch)

    pending = asyncio.create_task(fetch())
    try:
        while (got := await pending) is not None:
            pending = asyncio.create_task(fetch())  # the next lookup overlaps this scoring
            batch, item = got
            acc.update(batch.labels, await score(item))
    finally:
        if not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
    result = gather_accumulator(acc).result()
    return {"auc": result.auc, "logloss": result.logloss, "samples": result.count}
