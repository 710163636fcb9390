"""The best state of a fit, selected on validation data (never on the held-out data).

With ``validation_batches``, ``Trainer.fit`` evaluates them every ``eval_every`` steps and
at the end (the held-out batches only at the end). :class:`BestState` records those
evaluations; with ``keep_best`` (on by default with validation data) it snapshots the whole
model whenever the validation AUC improves, as Keras' ``restore_best_weights`` does: the
dense model and its optimizer's state in memory, the embedding rows with their optimizer
state on the PS (a :class:`services.worker.embedding.rows.RowsSnapshots`: the in-process shards
write a checkpoint of their own). At the end of training it puts the best snapshot back, before the
held-out evaluation, so that the final state is the one the same run stopped at that step
would have. Every push is acknowledged before a validation, so the state evaluated is the
state snapshotted.

One worker only: with several, each rank's snapshot and the PS's would have to be one
consistent cut (``services.worker.job_checkpoints``); :func:`keeps_best` and :class:`BestState`
refuse it with a clear error.
"""

from __future__ import annotations

import copy
import math
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from services.common.batch import Batch, Batches
from services.common.errors import ConfigError
from services.worker.config import TrainerConfig
from services.worker.distributed import several_ranks
from services.worker.embedding.pipeline import EmbeddingPipeline
from services.worker.embedding.rows import RowsSnapshots

if TYPE_CHECKING:
    from services.worker.summary import FitSummary

__all__ = ["BestState", "keeps_best"]

Evaluation = Callable[[], Batches] | Sequence[Batch]


class Trained(Protocol):
    """What a BestState uses of its :class:`~services.worker.trainer.Trainer`."""

    config: TrainerConfig
    step: int

    @property
    def pipeline(self) -> EmbeddingPipeline: ...

    @property
    def rows_snapshots(self) -> RowsSnapshots | None: ...

    async def evaluate(self, batches: Batches) -> dict[str, float]: ...

    def dense_state(self) -> dict[str, Any]: ...

    def load_dense_state(self, state: dict[str, Any]) -> None: ...


def keeps_best(config: TrainerConfig, *, validation: bool) -> bool:
    """Whether a fit keeps its best state: ``config.keep_best``, unset meaning on when there
    is validation data. A ConfigError for ``keep_best`` without validation data, and for
    validation data without ``eval_every`` (it would be evaluated at the end only)."""
    if config.keep_best and not validation:
        raise ConfigError("keep_best selects the best state on validation data: give "
                          "validation data (persimmon train --validation-data SPEC); "
                          "selecting on the held-out data would be leakage")
    if validation and config.eval_every < 1:
        raise ConfigError("validation data is evaluated every eval_every steps and at the "
                          "end: set eval_every (once per epoch: ceil(rows / batch_size) "
                          "steps)")
    return validation and config.keep_best is not False


def _score(entry: dict[str, float]) -> float:
    """The AUC to maximise (NaN, a validation set of one class, ranks lowest)."""
    return -math.inf if math.isnan(entry["auc"]) else entry["auc"]


class BestState:
    """The validation evaluations of one fit (``history``: step, auc, logloss, samples) and
    the ``best`` of them; with ``keep``, the snapshot of the state at the best one."""

    def __init__(self, trainer: Trained, validation: Evaluation, *, keep: bool) -> None:
        if keep and several_ranks():
            raise ConfigError("keep_best serves one worker (the ranks' snapshots and the PS's "
                              "are not one consistent cut): set keep_best false to only "
                              "evaluate the validation data")
        if keep and trainer.rows_snapshots is None:
            raise ConfigError("keep_best snapshots the embedding rows: their client must be a "
                              "RowsSnapshots (the PS's shards in this process, persimmon "
                              "train --ps embedded)")
        self._trainer = trainer
        self._validation = validation
        self.keep = keep
        self.history: list[dict[str, float]] = []
        self.best: dict[str, float] | None = None
        self._dense: dict[str, Any] | None = None
        self._rows: str | None = None  # the name of the rows' snapshot

    @classmethod
    def of(cls, trainer: Trained, validation: Evaluation | None) -> BestState | None:
        """The BestState of a fit on ``validation`` (None without); checks the settings."""
        keep = keeps_best(trainer.config, validation=validation is not None)
        return None if validation is None else cls(trainer, validation, keep=keep)

    async def evaluate(self) -> None:
        """Wait for every push, evaluate the validation data; on a better AUC, snapshot."""
        trainer = self._trainer
        await trainer.pipeline.drain()
        source = self._validation() if callable(self._validation) else self._validation
        entry = {"step": trainer.step, **await trainer.evaluate(source)}
        self.history.append(entry)
        if self.best is not None and _score(entry) <= _score(self.best):
            return
        self.best = entry
        if self.keep:
            self._dense = copy.deepcopy(trainer.dense_state())
            self._rows = f"best-{trainer.step}-{uuid.uuid4().hex[:8]}"
            rows = trainer.rows_snapshots
            assert rows is not None  # checked in __init__
            await rows.snapshot_rows(self._rows)

    async def finish(self, summary: FitSummary) -> None:
        """After the last step: evaluate the final state (unless just done), put the best
        snapshot back (``keep``), and fill the summary's validation fields."""
        trainer = self._trainer
        if not self.history or self.history[-1]["step"] != trainer.step:
            await self.evaluate()
        assert self.best is not None
        restore = self.keep and self.best["step"] != trainer.step
        if restore:
            rows = trainer.rows_snapshots
            assert rows is not None and self._rows and self._dense
            await rows.restore_rows(self._rows)
            trainer.load_dense_state(self._dense)
        summary.validation = list(self.history)
        summary.best_step = int(self.best["step"])
        summary.best_validation_auc = self.best["auc"]
        summary.restored_best = restore
