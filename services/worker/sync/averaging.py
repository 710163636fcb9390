"""Parameter averaging: ``local_sgd`` (everyone, every H steps) and ``ds_sync`` (small groups).

DS-Sync (Divide-and-Shuffle, Wang et al. 2020; the schedule here is our reconstruction):
every ``every`` steps the n ranks split into groups of ``group_size`` that average their
parameters among themselves, all groups in parallel; the grouping changes each round by a
schedule every rank computes alike, so information still mixes across the cluster:

- ``hypercube`` (n and g powers of two): label ranks by their log2(n) bits; round r averages
  over the ranks that differ only in the bits ``{(r*k + t) mod log2 n : t < k}``, k = log2 g.
  After ``ceil(log2 n / k)`` rounds every bit was covered, which gives exactly the global
  average (averaging over bit sets A then B is averaging over A ∪ B).
- ``permutation`` (g divides n): round r groups consecutive chunks of a permutation drawn
  from ``numpy.random.default_rng([seed, r])``; ``period`` rounds are drawn and then reused.
  Mixing is geometric, not exact in finitely many rounds.

Every group is created once in ``prepare`` with ``new_group``, in the same order on every
rank. Averaging inside groups keeps the global mean and never increases the consensus
distance.

``local_sgd`` through a lossy codec sends changes since the last sync (with error feedback,
:mod:`services.worker.sync.base`); ``ds_sync`` refuses a lossy codec (a ConfigError): its
members come from different groups, so they share no reference to send changes against.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch.distributed as dist

from services.common.errors import ConfigError
from services.worker.sync.base import Averager, BaseSync, check_every

__all__ = ["DS_SCHEDULES", "DSSync", "LocalSGD", "ds_rounds"]

DS_SCHEDULES = ("hypercube", "permutation")


class LocalSGD(BaseSync):
    """Local SGD: train alone, average all parameters over every rank every ``every`` steps."""

    name = "local_sgd"

    def __init__(self, *, every: int = 8, averager: Averager | None = None) -> None:
        super().__init__(averager=averager)
        self.every = check_every(self.name, every)

    def _on_step(self, step: int) -> None:
        if (step + 1) % self.every == 0:
            self._average_params(None, self.world_size)


def _is_pow2(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


def _hypercube_rounds(n: int, g: int) -> list[list[list[int]]]:
    m, k = n.bit_length() - 1, g.bit_length() - 1
    rounds = []
    ranks = np.arange(n)
    for r in range(math.ceil(m / k)):
        mask = 0
        for t in range(k):
            mask |= 1 << ((r * k + t) % m)
        keys = ranks & ~mask
        groups = [ranks[keys == key].tolist() for key in np.unique(keys)]
        rounds.append(groups)
    return rounds


def _permutation_rounds(n: int, g: int, period: int, seed: int) -> list[list[list[int]]]:
    rounds = []
    for r in range(period):
        perm = np.random.default_rng([seed, r]).permutation(n)
        rounds.append([sorted(chunk.tolist()) for chunk in perm.reshape(n // g, g)])
    return rounds


def ds_rounds(n: int, group_size: int, schedule: str = "hypercube", *, period: int = 8,
              seed: int = 0) -> list[list[list[int]]]:
    """The DS-Sync schedule: per round, the partition of ranks ``0..n-1`` into groups."""
    if schedule not in DS_SCHEDULES:
        raise ConfigError(f"ds_sync: schedule must be one of {DS_SCHEDULES}, got {schedule!r}")
    if n == 1:
        return [[[0]]]
    if group_size < 2 or n % group_size:
        raise ConfigError(f"ds_sync: group_size {group_size} must be >= 2 and divide the "
                          f"world size {n}")
    if schedule == "hypercube":
        if not (_is_pow2(n) and _is_pow2(group_size)):
            raise ConfigError(f"ds_sync: the hypercube schedule needs a power-of-two world "
                              f"size and group size, got {n} and {group_size}; "
                              "use schedule='permutation'")
        return _hypercube_rounds(n, group_size)
    return _permutation_rounds(n, group_size, period, seed)


class DSSync(BaseSync):
    """DS-Sync: per round, average parameters inside groups of ``group_size``, then shuffle."""

    name = "ds_sync"

    def __init__(self, *, group_size: int = 2, schedule: str = "hypercube", every: int = 1,
                 period: int = 8, seed: int = 0, averager: Averager | None = None) -> None:
        super().__init__(averager=averager)
        if self._lossy:
            codec = getattr(getattr(averager, "codec", None), "name", type(averager).__name__)
            raise ConfigError(f"ds_sync cannot average through the lossy codec {codec!r}: its "
                              "groups change every round, so no reference copy is shared to "
                              "send changes against; use none, fp16 or bf16, or local_sgd")
        if not isinstance(group_size, int) or group_size < 2:
            raise ConfigError(f"ds_sync: group_size must be an int >= 2, got {group_size!r}")
        if schedule not in DS_SCHEDULES:
            raise ConfigError(f"ds_sync: schedule must be one of {DS_SCHEDULES}, "
                              f"got {schedule!r}")
        if not isinstance(period, int) or period < 1:
            raise ConfigError(f"ds_sync: period must be an int >= 1, got {period!r}")
        self.group_size = group_size
        self.schedule = schedule
        self.every = check_every(self.name, every)
        self.period = period
        self.seed = int(seed)
        self.rounds: list[list[list[int]]] = []
        self._my_groups: list[tuple[Any, int]] = []   # per round: (process group, its size)
        self._round = 0

    def _setup(self) -> None:
        if not self.active:
            return
        self.rounds = ds_rounds(self.world_size, self.group_size, self.schedule,
                                period=self.period, seed=self.seed)
        created: dict[tuple[int, ...], Any] = {}
        for groups in self.rounds:          # same order on every rank: new_group is collective
            for ranks in groups:
                key = tuple(ranks)
                if key not in created:
                    created[key] = dist.new_group(ranks=list(key))
        for groups in self.rounds:
            mine = next(r for r in groups if self.rank in r)
            self._my_groups.append((created[tuple(mine)], len(mine)))

    def _on_step(self, step: int) -> None:
        if (step + 1) % self.every:
            return
        group, size = self._my_groups[self._round % len(self._my_groups)]
        self._round += 1
        self._average_params(group, size)
