"""The staleness of the lookups a PS shard serves, counted over every worker's pushes.

A worker's own pipeline knows how many of *its* earlier pushes a lookup missed (the per-worker
figure its summary reports). Only the PS sees every worker's pushes, so the global figure is
counted here: a step call may carry a :data:`StepTag` (worker rank, training step, number
of workers) for its
push and for its lookup (``ShardedIds.tag`` on the worker's side); whoever serves the call
(the gRPC servicer, the in-process shards) runs it inside :func:`step_tags`, and the shard
reports to its :class:`GlobalStaleness` where it applies a push and where it reads rows.
Untagged calls (evaluations, tools) are not counted.

Usage (a server)::

    with step_tags(lookup=(rank, step, world_size)):
        rows = await shard.lookup_many(tables, counts, ids)
    shard.staleness.stats("C1")["global_staleness_max"]
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["GlobalStaleness", "StepTag", "StepTags", "step_tags"]

StepTag = tuple[int, int, int]  # (worker rank, training step, number of workers)


@dataclass(frozen=True, slots=True)
class StepTags:
    """The tags of the call being served: its push's and its lookup's."""

    push: StepTag | None = None
    lookup: StepTag | None = None


_UNTAGGED = StepTags()
_TAGS: contextvars.ContextVar[StepTags] = contextvars.ContextVar("persimmon_step_tags",
                                                                 default=_UNTAGGED)


@contextlib.contextmanager
def step_tags(push: StepTag | None = None, lookup: StepTag | None = None) -> Iterator[None]:
    """Serve the call inside with these tags (tasks and threads started inside inherit
    them: ``asyncio`` copies the context)."""
    token = _TAGS.set(StepTags(push, lookup))
    try:
        yield
    finally:
        _TAGS.reset(token)


class GlobalStaleness:
    """How many earlier pushes, of every worker, each tagged lookup did not see, per table.

    Training is data-parallel in lockstep (dense gradients are all-reduced every step), so
    a lookup tagged (worker w, step t) should see the push of every step before t of every
    worker. For each table the shard keeps the last step applied of each worker (a worker's
    pushes reach a shard in step order; one not heard of yet has applied none); the lookup
    missed
    ``Σ_v max(0, t - 1 - last_v)`` pushes (``global``), of which ``max(0, t - 1 - last_w)``
    its own worker's (``own``); ``worker`` is the most of any one worker's
    (``max_v max(0, t - 1 - last_v)``: what the bound across workers, SSP, bounds by S). A
    step whose push held no id of the table on this shard
    counts as missed until that worker's next push here: the figure is an upper bound where
    a table is sparse on a shard, exact where every step touches it (hot tables).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, dict[int, int]] = {}  # table -> worker -> last step applied
        # table -> [lookups, global sum, global max, own sum, own max, any one worker's max]
        self._sums: dict[str, list[int]] = {}

    def pushed(self, tables: Iterable[str]) -> None:
        """The push of the call being served was applied to ``tables``."""
        tag = _TAGS.get().push
        if tag is None:
            return
        worker, step, _ = tag
        with self._lock:
            for table in tables:
                last = self._last.setdefault(table, {})
                last[worker] = max(step, last.get(worker, -1))

    def looked_up(self, table: str) -> None:
        """The lookup of the call being served read the rows of ``table``."""
        tag = _TAGS.get().lookup
        if tag is None:
            return
        worker, step, workers = tag
        with self._lock:  # O(workers heard of), whatever number of workers the tag names
            last = self._last.get(table, {})
            heard = [max(0, step - 1 - s) for v, s in last.items() if v < workers]
            total = sum(heard) + (workers - len(heard)) * step  # the unheard missed every step
            own = max(0, step - 1 - last.get(worker, -1))
            worst = step if len(heard) < workers else max(heard, default=0)
            sums = self._sums.setdefault(table, [0, 0, 0, 0, 0, 0])
            sums[0] += 1
            sums[1] += total
            sums[2] = max(sums[2], total)
            sums[3] += own
            sums[4] = max(sums[4], own)
            sums[5] = max(sums[5], worst)

    def stats(self, table: str) -> dict[str, Any]:
        """``tagged_lookups`` of ``table`` and the earlier pushes they missed, max and mean:
        ``global_staleness_*`` (every worker's), ``own_staleness_*`` (their worker's), and
        ``worker_staleness_max`` (the most of any one worker's)."""
        with self._lock:
            n, g_sum, g_max, o_sum, o_max, w_max = self._sums.get(table, [0, 0, 0, 0, 0, 0])
        return {"tagged_lookups": n, "global_staleness_max": g_max,
                "global_staleness_mean": g_sum / n if n else 0.0,
                "own_staleness_max": o_max, "own_staleness_mean": o_sum / n if n else 0.0,
                "worker_staleness_max": w_max}
