"""One set of head ids for the whole job: every worker's counts decide it together.

With several workers each one sees its own batches, so head ids decided per worker differ:
an id head for one worker (looked up synchronously, its updates applied at once) is tail for
another (pushed S steps stale), and the bound a head id should have holds for neither. Here a
decision is a vote: an id is head when it occurs at least ``threshold`` times per worker over
the job's recent batches (its occurrences summed over the workers reach ``threshold ×
workers``), so it is head for every worker or for none.

Two collectives per decision, both small: every worker's own candidates (its ids at or above
``threshold``: any id whose sum reaches ``threshold × workers`` is one of some worker's, by
pigeonhole) are gathered into their union, then each worker's counts of that union are summed
across the workers. Run in a thread off the event loop; every worker calls :func:`vote` at the
same batch (decisions fall on fixed batch counts).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Ballot", "vote"]

Gather = Callable[[Any], Awaitable[list[Any]]]  # every worker's object, in rank order
Add = Callable[[np.ndarray], Awaitable[np.ndarray]]  # an int64 array summed over the workers


@dataclass(frozen=True)
class Ballot:
    """One worker's counts for a decision: per group, its distinct keys in key order and how
    often each occurred in the recent batches; and the head threshold per worker."""

    counts: dict[int, tuple[np.ndarray, np.ndarray]]
    threshold: float


def _count_of(counts: tuple[np.ndarray, np.ndarray], keys: np.ndarray) -> np.ndarray:
    """How often each of ``keys`` occurred (0 where never), from sorted ``counts``."""
    known, total = counts
    if not known.size:
        return np.zeros(keys.size, np.int64)
    at = np.minimum(np.searchsorted(known, keys), known.size - 1)
    return np.where(known[at] == keys, total[at], 0).astype(np.int64)


async def vote(ballot: Ballot, workers: int, gather: Gather, add: Add) -> dict[int, np.ndarray]:
    """The head keys per group that the workers' ballots elect (the same on every worker)."""
    groups = sorted(ballot.counts)
    mine = {i: keys[total >= ballot.threshold] for i, (keys, total) in ballot.counts.items()}
    everyone = await gather(mine)
    union = {i: np.unique(np.concatenate([m[i] for m in everyone])) for i in groups}
    local = np.concatenate([_count_of(ballot.counts[i], union[i]) for i in groups]) \
        if groups else np.zeros(0, np.int64)
    summed = await add(local) if local.size else local  # (the same union everywhere)
    elected, start = {}, 0
    for i in groups:
        n = union[i].size
        elected[i] = union[i][summed[start:start + n] >= ballot.threshold * workers]
        start += n
    return elected
