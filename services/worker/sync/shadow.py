"""``shadow``: ShadowSync, parameter averaging in a background thread off the training path.

(Zheng et al. 2020; the details are our reconstruction.) A round is:

1. at a step boundary the training thread copies the parameters into a snapshot ``s`` (a
   memcpy) and hands it to the shadow thread;
2. the shadow thread averages the snapshots over all ranks on its OWN process group (so it
   never interleaves with other collectives) while training goes on;
3. at the first step boundary after the round finished, the training thread adds
   ``delta = averaged - s`` to the live parameters, which keeps every update made meanwhile.

The training thread never waits for communication: it only copies and adds. Writing back
on the training thread (not from the shadow thread) keeps the update race-free.

Through a lossy codec a round sends each snapshot's change since the last round's average
(the shared reference, error feedback per rank: :mod:`services.worker.sync.base`); the
elastic rounds send ``s − c``, with error feedback too.

Elastic averaging (``elastic_alpha=α``, EASGD-style): the ranks share a centre variable
``c`` (equal on every rank; the first round sets it to the mean); a round moves each replica
``x += α(c - s)`` and the centre ``c += α Σ_i (s_i - c)``. Σ x_i + c is conserved, and with a
zero learning rate all replicas converge to their initial mean. Needs ``α·n <= 1``.

``close()`` is collective: ranks keep running rounds (flagged "stopping") until a round in
which every rank is stopping; its result is applied, so with lr = 0 the replicas end equal.
``finish()`` does the same, then averages the replicas and starts a new thread.
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from services.common.errors import ConfigError, Internal
from services.worker.sync.base import Averager, BaseSync, add_flat_, check_every, flatten

__all__ = ["ShadowSync"]


class ShadowSync(BaseSync):
    """Background all-reduce averaging with delta write-back (optionally elastic)."""

    name = "shadow"

    def __init__(self, *, every: int = 1, elastic_alpha: float | None = None,
                 timeout_s: float = 300.0, averager: Averager | None = None) -> None:
        super().__init__(averager=averager)
        self.every = check_every(self.name, every)
        if elastic_alpha is not None and not (
                isinstance(elastic_alpha, int | float) and 0 < elastic_alpha <= 1):
            raise ConfigError(f"shadow: elastic_alpha must be in (0, 1] or None, "
                              f"got {elastic_alpha!r}")
        if timeout_s <= 0:
            raise ConfigError(f"shadow: timeout_s must be > 0, got {timeout_s}")
        self.elastic_alpha = None if elastic_alpha is None else float(elastic_alpha)
        self.timeout_s = float(timeout_s)
        self._group: Any = None
        self._thread: threading.Thread | None = None
        self._jobs: queue.Queue[tuple[Tensor, bool]] = queue.Queue(maxsize=1)
        self._done = threading.Event()
        self._result: tuple[Tensor, bool] | None = None
        self._error: BaseException | None = None
        self._busy = False
        self._center: Tensor | None = None
        self._closed = False

    def _setup(self) -> None:
        if not self.active:
            return
        if self.elastic_alpha is not None and self.elastic_alpha * self.world_size > 1:
            raise ConfigError(f"shadow: elastic_alpha * world_size must be <= 1 for a stable "
                              f"centre, got {self.elastic_alpha} * {self.world_size}")
        self._group = dist.new_group(ranks=list(range(self.world_size)),
                                     timeout=timedelta(seconds=self.timeout_s))
        self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="persimmon-shadow-sync",
                                        daemon=True)
        self._thread.start()

    # -- shadow thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            snapshot, stopping = self._jobs.get()
            try:
                delta, all_stopping = self._round(snapshot, stopping)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread
                self._error = exc
                self._done.set()
                return
            self._result = (delta, all_stopping)
            self._done.set()
            if all_stopping:
                return

    def _round(self, snapshot: Tensor, stopping: bool) -> tuple[Tensor, bool]:
        t0 = time.perf_counter()
        n = self.world_size
        flag = torch.tensor([1.0 if stopping else 0.0], device=snapshot.device)
        dist.all_reduce(flag, group=self._group)
        all_stopping = int(round(flag.item())) == n
        alpha = self.elastic_alpha
        if alpha is None or self._center is None:
            mean = self._mean(snapshot.clone(), self._group, n)
            if alpha is None:
                delta = mean - snapshot
            else:  # first elastic round: the centre starts at the mean
                self._center = mean
                delta = alpha * (mean - snapshot)
        else:
            diff_sum = self._average_change(snapshot - self._center, self._group, n) * n
            delta = alpha * (self._center - snapshot)
            self._center = self._center + alpha * diff_sum
        self._count_bytes(snapshot)
        self.stats.sync_seconds += time.perf_counter() - t0
        return delta, all_stopping

    # -- training thread -----------------------------------------------------------------

    def _collect(self) -> bool:
        """Apply a finished round's delta; True when it was the final (all-stopping) round."""
        if self._error is not None:
            raise Internal(f"shadow sync thread failed: {self._error!r}") from self._error
        if self._result is None:
            raise Internal("shadow: a round finished without a result")
        delta, final = self._result
        self._result = None
        self._done.clear()
        self._busy = False
        add_flat_(self.params, delta)
        self.stats.syncs += 1
        return final

    def _submit(self, stopping: bool) -> None:
        self._busy = True
        self._jobs.put((flatten(self.params), stopping))

    def _on_step(self, step: int) -> None:
        if self._closed:
            raise Internal("shadow: after_step() called after close()")
        if self._busy and self._done.is_set():
            self._collect()
        if not self._busy and (step + 1) % self.every == 0:
            self._submit(stopping=False)

    @property
    def rounds_in_flight(self) -> int:
        """1 while a background round is running or waiting to be applied, else 0."""
        return int(self._busy)

    def _drain(self) -> None:
        """Run rounds flagged "stopping" until one where every rank stops (collective), apply
        it and let the thread end."""
        assert self._thread is not None
        t0 = time.perf_counter()
        final = False
        while not final:
            if not self._busy:
                self._submit(stopping=True)
            if not self._done.wait(timeout=self.timeout_s):
                raise Internal(f"shadow: a sync round did not finish within {self.timeout_s}s")
            final = self._collect()
        self._thread.join(timeout=self.timeout_s)
        self.stats.blocking_seconds += time.perf_counter() - t0

    def finish(self) -> bool:
        """Drain the background rounds, average every replica, restart the thread."""
        if self._closed:
            raise Internal("shadow: finish() called after close()")
        if self._thread is None:
            return False
        self._drain()
        super().finish()
        self._start()
        return True

    def close(self) -> None:
        """Finish the background rounds together with every other rank (collective)."""
        if self._closed or self._thread is None:
            self._closed = True
            return
        self._closed = True
        self._drain()
