"""The staleness of the lookups a PS shard serves, counted over every worker's pushes.

A worker's own pipeline knows how many of *its* earlier pushes a lookup missed (the per-worker
figure its summary reports). Only the PS sees every worker's pushes, so the global figure (the
most pushes of any one worker a lookup missed) is counted here: a step call may carry a
:data:`StepTag` (worker rank, training step, number of workers) for its push and for its
lookup (``ShardedIds.tag`` on the worker's side); whoever serves the call (the gRPC servicer,
the in-process shards) runs it inside :func:`step_tags`, and the shard reports to its
:class:`GlobalStaleness` where it applies a push and where it reads rows. Untagged calls
(evaluations, tools) are not counted.

Usage (a server)::

    with step_tags(lookup=(rank, step, world_size)):
        rows = await shard.lookup_many(tables, counts, ids)
    shard.stats("C1").tables["C1"].global_staleness_max
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgspec

from services.common.messages import TableCounters, TableStats

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
    """How many earlier pushes of each worker each tagged lookup did not see, per table.

    A lookup tagged (worker w, step t) should see the push of every step before t of every
    worker. For each table the shard keeps the last step applied of each worker (a worker's
    pushes reach a shard in step order; one not heard of yet has applied none); the lookup
    missed ``m_v = max(0, t - 1 - last_v)`` pushes of worker v (all t of one not heard of).
    Per lookup it counts ``global`` = ``max_v m_v``, the most of any one worker's (what the
    bound across workers, stale synchronous parallel, bounds by the window S), ``own`` =
    ``m_w`` (its own worker's, bounded by S - 1) and ``total`` = ``Σ_v m_v`` (every worker's
    summed, at most N·S - 1 under that bound). A step whose push held no id of the table on
    this shard counts as missed until that worker's next push here: the figures are upper
    bounds where a table is sparse on a shard, exact where every step touches it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, dict[int, int]] = {}  # table -> worker -> last step applied
        # table -> [lookups, global sum, global max, own sum, own max, total sum, total max]
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
            unheard = workers - len(heard)  # each missed every earlier step
            total = sum(heard) + unheard * step
            worst = step if unheard else max(heard, default=0)
            own = max(0, step - 1 - last.get(worker, -1))
            sums = self._sums.setdefault(table, [0] * 7)
            sums[0] += 1
            for k, value in ((1, worst), (3, own), (5, total)):
                sums[k] += value
                sums[k + 1] = max(sums[k + 1], value)

    def stats(self, counters: TableCounters) -> TableStats:
        """The table's ``counters`` with the ``tagged_lookups`` of that table and the earlier
        pushes they missed, max and mean: ``global_staleness_*`` (the most of any one
        worker's), ``own_staleness_*`` (their own worker's) and ``total_staleness_*`` (every
        worker's, summed)."""
        with self._lock:
            n, *sums = self._sums.get(counters.name, [0] * 7)
        means = [total / n if n else 0.0 for total in sums[0::2]]
        return TableStats(**msgspec.structs.asdict(counters), tagged_lookups=n,
                          global_staleness_max=sums[1], global_staleness_mean=means[0],
                          own_staleness_max=sums[3], own_staleness_mean=means[1],
                          total_staleness_max=sums[5], total_staleness_mean=means[2])
