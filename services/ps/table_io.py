"""What goes into and out of an embedding table: validated id and gradient batches, the result
of a push, and snapshots (with the check that one fits a table)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from services.common.errors import FailedPrecondition, InvalidArgument
from services.ps.optimizers import state_layout
from services.ps.tables import OptimizerConfig, TableConfig

__all__ = ["ACCUM", "BUCKETS", "DIRTY", "LAST_USED", "PLAIN_DTYPES", "ROWS", "SEEN",
           "SLOT_IDS", "TICKS", "USES", "PlainTable", "PushResult", "TableSnapshot",
           "check_snapshot", "validate_grads", "validate_ids"]


# A plain table's arrays as its kernel row carries them (services.common.kernel_arrays.refs):
# its index (SlotIndex.arrays), rows, push scratch, dirty flags, Adagrad accumulator (empty
# for other optimizers) and use bookkeeping (empty where it keeps none), in this order.
PLAIN_DTYPES = (np.int32, np.uint64, np.float32, np.uint8, np.uint8, np.float32, np.int64,
                np.int64, np.float64)
BUCKETS, SLOT_IDS, ROWS, SEEN, DIRTY, ACCUM, TICKS, USES, LAST_USED = range(len(PLAIN_DTYPES))


class PlainTable(NamedTuple):
    """A plain table for kernels over several tables
    (:meth:`services.ps.store.EmbeddingTable.plain_view`): its arrays as one kernel row
    (``refs``, fields :data:`BUCKETS` ... :data:`LAST_USED`), its counters, its optimizer's
    update of distinct slots (``apply(slots, grads)``) and that optimizer's config, and
    ``next_use()``, which starts a use (the table's next tick and its clock's time; None: it
    keeps no use bookkeeping)."""

    refs: np.ndarray
    counters: dict[str, int]
    apply: Callable[[np.ndarray, np.ndarray], int]  # returns the rows it refused
    optimizer: OptimizerConfig
    next_use: Callable[[], tuple[int, float]] | None


@dataclass(slots=True)
class PushResult:
    """What a push did, counted in unique ids."""

    applied: int = 0
    dropped_nonfinite: int = 0
    not_admitted: int = 0

    @classmethod
    def total(cls, results: Iterable[PushResult]) -> PushResult:
        """The counts of several pushes (or parts of one) added up."""
        done = list(results)
        return cls(applied=sum(r.applied for r in done),
                   dropped_nonfinite=sum(r.dropped_nonfinite for r in done),
                   not_admitted=sum(r.not_admitted for r in done))


@dataclass(slots=True)
class TableSnapshot:
    """Rows of a table (all, or those changed since the previous snapshot) and tombstones.

    ``rows`` are float32 in ``ids`` order (ids sorted ascending); ``state`` holds the
    optimizer state rows by name; ``meta`` the eviction bookkeeping (``tick``, ``uses``);
    ``tombstones`` the ids dropped since the previous snapshot. Restoring applies the
    tombstones first, then the rows.
    """

    config: TableConfig
    ids: np.ndarray
    rows: np.ndarray
    state: dict[str, np.ndarray]
    tombstones: np.ndarray
    incremental: bool = False
    meta: dict[str, np.ndarray] = field(default_factory=dict)


def validate_ids(name: str, ids: Any) -> np.ndarray:
    """``ids`` as a contiguous uint64 vector, or :class:`InvalidArgument` naming table ``name``."""
    if not isinstance(ids, np.ndarray):
        raise InvalidArgument(f"table {name}: ids must be a numpy array, got {type(ids).__name__}")
    if ids.ndim != 1:
        raise InvalidArgument(f"table {name}: ids must be 1-D, got shape {ids.shape}")
    if ids.dtype == np.uint64:
        return np.ascontiguousarray(ids)
    if ids.dtype.kind not in "iu":
        raise InvalidArgument(f"table {name}: ids must be uint64, got dtype {ids.dtype}")
    if ids.dtype.kind == "i" and ids.size and ids.min() < 0:
        raise InvalidArgument(f"table {name}: ids must be non-negative, got {ids.min()}")
    return ids.astype(np.uint64)


def validate_grads(config: TableConfig, ids: np.ndarray, grads: Any) -> np.ndarray:
    """``grads`` as contiguous float32 ``(len(ids), dim)``, or :class:`InvalidArgument`."""
    name, dim = config.name, config.dim
    if not isinstance(grads, np.ndarray):
        raise InvalidArgument(f"table {name}: grads must be a numpy array, "
                              f"got {type(grads).__name__}")
    if grads.dtype.kind != "f":
        raise InvalidArgument(f"table {name}: grads must be floats, got dtype {grads.dtype}")
    if grads.ndim != 2:
        raise InvalidArgument(f"table {name}: grads must be 2-D (n, {dim}), "
                              f"got shape {grads.shape}")
    if grads.shape[1] != dim:
        raise InvalidArgument(f"table {name}: grads have dim {grads.shape[1]}, "
                              f"the table has dim {dim}")
    if grads.shape[0] != ids.shape[0]:
        raise InvalidArgument(f"table {name}: {ids.shape[0]} ids but {grads.shape[0]} "
                              f"gradient rows")
    return np.ascontiguousarray(grads, dtype=np.float32)


def check_snapshot(config: TableConfig, snap: TableSnapshot) -> None:
    """:class:`FailedPrecondition` unless ``snap`` can be restored into a table of ``config``."""
    name, dim = config.name, config.dim
    if snap.config.dim != dim:
        raise FailedPrecondition(f"table {name}: snapshot has dim {snap.config.dim}, "
                                 f"the table has dim {dim}")
    if snap.config.optimizer.kind != config.optimizer.kind:
        raise FailedPrecondition(f"table {name}: snapshot optimizer is "
                                 f"{snap.config.optimizer.kind}, the table's is "
                                 f"{config.optimizer.kind}")
    n = snap.ids.shape[0]
    if snap.rows.shape != (n, dim):
        raise FailedPrecondition(f"table {name}: snapshot rows have shape {snap.rows.shape}, "
                                 f"expected ({n}, {dim})")
    for key, (shape, _) in state_layout(config.optimizer, dim).items():
        got = snap.state.get(key)
        if got is None or got.shape != (n, *shape):
            raise FailedPrecondition(f"table {name}: snapshot optimizer state {key!r} is "
                                     f"missing or has the wrong shape")
