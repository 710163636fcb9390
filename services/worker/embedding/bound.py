"""The staleness bound a run's lookups have: how many earlier pushes a lookup may miss.

A lookup of step t should see the push of every step before t of every worker; it *misses*
those not yet applied when it is served (the PS counts them, :mod:`services.ps.staleness`).
With a window of W slots (``hybrid``: W = S; ``sync``: W = 1), a batch takes a slot before
its lookup and frees it when its push is acknowledged, so a lookup misses at most W - 1
pushes of its own worker. With several workers and ``global_bound``, the step gate lets no
worker take the slot of step t before every worker holds its slot of step t - 1 (stale
synchronous parallel): a lookup then misses at most W pushes of any worker (at most
N·W - 1 summed over N workers). ``global_sync`` misses none; ``async`` has no bound.

Usage::

    bound = staleness_bound("hybrid", window=8, workers=4, global_bound=True)
    bound.any_worker  # 8: the PS's global_staleness_max never exceeds it
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import ConfigError

__all__ = ["StalenessBound", "staleness_bound"]


@dataclass(frozen=True, slots=True)
class StalenessBound:
    """The most earlier pushes a lookup may miss: of its ``own`` worker, and of ``any_worker``
    (None: not bounded across the workers)."""

    own: int
    any_worker: int | None

    def describe(self) -> str:
        """One line for the log."""
        across = ("not bounded across the workers" if self.any_worker is None
                  else f"at most {self.any_worker} of any worker's")
        return f"a lookup misses at most {self.own} of its own worker's pushes, {across}"


def staleness_bound(mode: str, *, window: int | None, workers: int,
                    global_bound: bool) -> StalenessBound | None:
    """The bound of ``mode`` with ``window`` slots, ``workers`` workers and the step gate
    (``global_bound``, several workers in ``sync`` and ``hybrid``); None in ``async`` mode."""
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    if mode == "async":
        return None
    if mode == "global_sync":
        return StalenessBound(own=0, any_worker=0)
    if mode not in ("sync", "hybrid"):
        raise ConfigError(f"mode must be sync, global_sync, hybrid or async, got {mode!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"window must be an int >= 1 in {mode} mode, got {window!r}")
    if workers == 1:
        return StalenessBound(own=window - 1, any_worker=window - 1)
    return StalenessBound(own=window - 1, any_worker=window if global_bound else None)
