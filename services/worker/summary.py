"""What ``Trainer.fit`` returns (:class:`FitSummary`) and the bounded histories it keeps.

A long job never holds every loss of its run: the Trainer keeps the most recent losses
(``RECENT_LOSSES``), running aggregates, and a :class:`LossCurve` of the whole run in at most
``points`` points (the mean loss of spans of steps that double in length as the run grows).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RECENT_LOSSES", "FitSummary", "LossCurve", "StalenessStats", "summary_problem"]

RECENT_LOSSES = 1000  # losses a Trainer keeps (its ``recent_losses``)


class LossCurve:
    """The mean loss of consecutive spans of steps, at most ``points`` spans for any number of
    steps: when full, neighbouring spans merge and the span length doubles."""

    __slots__ = ("_counts", "_firsts", "_points", "_span", "_sums")

    def __init__(self, points: int = 512) -> None:
        if isinstance(points, bool) or not isinstance(points, int) or points < 2:
            raise ValueError(f"points must be an int >= 2, got {points!r}")
        self._points = points
        self._span = 1
        self._firsts: list[int] = []  # the first step of each span
        self._counts: list[int] = []
        self._sums: list[float] = []

    @property
    def span(self) -> int:
        """Steps per point (the last point may hold fewer)."""
        return self._span

    def add(self, step: int, loss: float) -> None:
        """Record the loss of ``step`` (steps come in increasing order)."""
        if self._counts and self._counts[-1] < self._span:
            self._counts[-1] += 1
            self._sums[-1] += loss
            return
        self._firsts.append(step)
        self._counts.append(1)
        self._sums.append(loss)
        if len(self._counts) > self._points:
            self._merge()

    def _merge(self) -> None:
        self._firsts = self._firsts[::2]
        self._counts = [sum(self._counts[i:i + 2]) for i in range(0, len(self._counts), 2)]
        self._sums = [sum(self._sums[i:i + 2]) for i in range(0, len(self._sums), 2)]
        self._span *= 2

    def points(self) -> list[tuple[int, float]]:
        """``(first step, mean loss)`` of every span, in order."""
        return [(f, s / c) for f, c, s in zip(self._firsts, self._counts, self._sums,
                                              strict=True)]

    def __len__(self) -> int:
        return len(self._counts)


@dataclass(slots=True)
class StalenessStats:
    """Running maximum and mean of the steps' staleness."""

    steps: int = 0
    total: int = 0
    max: int = 0

    def add(self, staleness: int) -> None:
        self.steps += 1
        self.total += staleness
        if staleness > self.max:
            self.max = staleness

    @property
    def mean(self) -> float:
        return self.total / self.steps if self.steps else 0.0


@dataclass(kw_only=True, slots=True)
class FitSummary:
    """One ``Trainer.fit``: its settings, throughput, losses and held-out figures, bytes.

    ``auc``/``logloss`` are the final held-out figures when ``fit`` evaluated (then
    ``eval_samples`` is set), else the progressive (pre-update) training figures
    (``train_auc``/``train_logloss``). ``loss`` is the mean of the latest 50 training losses,
    ``staleness`` is the window (S) the run had, ``window_choice`` what ``staleness auto``
    measured and chose (None when S was given); ``staleness_max``/``staleness_mean`` are
    those of the windowed rows; ``hot_tables`` and
    ``head_ids`` (how many, at the end) are looked up under ``hot_staleness``;
    ``replicated_rows`` are the rows of those the worker's replica held at the end (0: none).
    ``recent_losses`` this fit's latest ones (at most ``RECENT_LOSSES``), ``loss_curve`` the
    whole fit as ``(first step, mean loss)`` spans; ``history`` holds every held-out
    evaluation. With validation data, ``validation`` holds its evaluations, ``best_step`` and
    ``best_validation_auc`` the best of them, and ``restored_best`` whether the final state
    (and ``auc``) is that step's (keep_best, :mod:`services.worker.best`).
    Timings are mean milliseconds per step; ``step_phases`` splits a training step's wall and
    CPU time into its phases (reading the hot rows, pooling, forward, backward, the dense
    update, applying the hot rows' gradients); byte counts are per stream (and codec).
    ``time_to_first_step_s``: seconds from the call of ``fit`` to the start of its first
    training step (the compute thread's), spent on connecting, building the model from the
    first batch, loading or compiling the step's kernels (:mod:`services.worker.warmup`),
    and planning and looking up the first batch; NaN without a step.
    """

    mode: str
    staleness: int
    steps: int
    samples: int
    seconds: float
    samples_per_s: float
    loss: float = math.nan
    staleness_max: int = 0
    staleness_mean: float = 0.0
    window_choice: dict[str, Any] | None = None
    hot_tables: list[str] = field(default_factory=list)
    head_ids: int = 0
    replicated_rows: int = 0
    step_wall_ms: float = 0.0
    step_cpu_ms: float = 0.0
    batch_wait_ms: float = 0.0
    step_phases: dict[str, dict[str, float]] = field(default_factory=dict)
    time_to_first_step_s: float = math.nan
    worker_cpu_ms_per_step: float = 0.0
    loop_cpu_ms: float = 0.0
    train_auc: float = math.nan
    train_logloss: float = math.nan
    auc: float = math.nan
    logloss: float = math.nan
    eval_samples: int | None = None
    sync: dict[str, Any] = field(default_factory=dict)
    wire_bytes: dict[str, int] = field(default_factory=dict)
    codec_bytes: dict[str, Any] = field(default_factory=dict)
    dense_bytes: dict[str, Any] = field(default_factory=dict)
    activation_bytes: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)
    validation: list[dict[str, float]] = field(default_factory=list)
    best_step: int | None = None
    best_validation_auc: float = math.nan
    restored_best: bool = False
    recent_losses: list[float] = field(default_factory=list)
    loss_curve: list[tuple[int, float]] = field(default_factory=list)

    @property
    def timing(self) -> dict[str, float]:
        """The mean milliseconds per step: wall and CPU of a step, wait for a batch, the
        worker's CPU (its PS-client process included) and its event loop's thread's CPU (the
        lookups, pushes and batch plans that feed the steps)."""
        return {"step_wall_ms": self.step_wall_ms, "step_cpu_ms": self.step_cpu_ms,
                "batch_wait_ms": self.batch_wait_ms,
                "worker_cpu_ms_per_step": self.worker_cpu_ms_per_step,
                "loop_cpu_ms": self.loop_cpu_ms}

    def as_dict(self) -> dict[str, Any]:
        """Every field as plain JSON values (the curve's points as lists)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["history"] = [dict(h) for h in self.history]
        out["validation"] = [dict(h) for h in self.validation]
        out["recent_losses"] = list(self.recent_losses)
        out["loss_curve"] = [[step, loss] for step, loss in self.loss_curve]
        return out


def summary_problem(summary: Mapping[str, Any]) -> str | None:
    """Why a fit summary (:meth:`FitSummary.as_dict`) holds no result to report, or None: no
    step (no valid record), a NaN loss, or an AUC that is undefined (an empty or one-class
    evaluation set, or one-class training data when nothing was evaluated)."""
    if not summary.get("steps"):
        return ("training consumed no valid record: the data is empty, or every record "
                "was malformed (the loader logs each, and its --dead-letter file keeps them)")
    if not math.isfinite(summary.get("loss", math.nan)):
        return f"the training loss is {summary.get('loss')}: the model diverged"
    if math.isfinite(summary.get("auc", math.nan)):
        return None
    evaluated = summary.get("eval_samples")
    if evaluated == 0:
        return "the evaluation set is empty: no AUC or logloss"
    where = "the evaluation set" if evaluated else "the training data (nothing was evaluated)"
    return f"{where} holds one class only: its AUC is undefined"
